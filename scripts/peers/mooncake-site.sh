#!/usr/bin/env bash
# Mooncake Store's non-CUDA wheel for the Mooncake mode of `kvtier bench vllm`
# (bench/vllm_serving.py): vLLM's MooncakeStoreConnector runs inside vLLM and imports
# `mooncake.store`, so the wheel goes into a directory put on the vLLM children's PYTHONPATH
# (pip --target, no dependencies: the project's .venv has numpy and the rest) instead of
# into .venv. The plain `mooncake-transfer-engine` wheel fails to import without libcuda.so.1.
# Also installs the Debian libraries store.so and mooncake_master link against (as root).
# Idempotent: a stamp records what was installed.
#
#   bash scripts/peers/mooncake-site.sh [DIR]     # default: .peers/mooncake in the repo root
#
# Prints DIR on its last line.
set -euo pipefail
cd "$(dirname "$0")/../.."

DIR=${1:-.peers/mooncake}
PKG=${MOONCAKE_PKG:-mooncake-transfer-engine-non-cuda==0.3.13.post1}
PY=${PYTHON:-.venv/bin/python}
STAMP=$DIR/.kvtier-mooncake

missing=()
for lib in libibverbs.so.1 libnuma.so.1 libcurl.so.4; do
  ldconfig -p | grep -q "$lib" || missing+=("$lib")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "mooncake-site: apt-get install libibverbs1 ibverbs-providers libnuma1 libcurl4" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      libibverbs1 ibverbs-providers libnuma1 libcurl4 >&2
  else
    echo "mooncake-site: missing ${missing[*]} and cannot apt-get install them" >&2
    exit 1
  fi
fi

if [[ ! -f $STAMP || $(cat "$STAMP") != "$PKG" ]]; then
  rm -rf "$DIR"
  "$PY" -m pip install -q --no-deps --target "$DIR" "$PKG" >&2
  echo "$PKG" >"$STAMP"
fi
PYTHONPATH=$DIR "$PY" -c "from mooncake.store import MooncakeDistributedStore" >&2
echo "$DIR"
