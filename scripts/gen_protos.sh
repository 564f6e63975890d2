#!/usr/bin/env bash
# Generate the Python protobuf/gRPC code for proto/ into kvstore/_proto/ (or into $1).
# The output is checked in; tests/node/test_protos.py regenerates into a temp dir and
# compares byte for byte, so never edit the generated files by hand: edit the .proto
# and run this script.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-kvstore/_proto}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
"$PY" -m grpc_tools.protoc -I proto \
  --python_out="$OUT" --grpc_python_out="$OUT" --pyi_out="$OUT" \
  proto/kvtier/v1/store.proto proto/kvtier/v1/conductor.proto
# protoc writes absolute imports of the proto package ("from kvtier.v1 import ..."); the
# package lives under kvstore._proto, so rewrite them.
sed -i 's/^from kvtier\.v1 import /from kvstore._proto.kvtier.v1 import /' \
  "$OUT/kvtier/v1/store_pb2_grpc.py" "$OUT/kvtier/v1/conductor_pb2_grpc.py"
for d in "$OUT" "$OUT/kvtier" "$OUT/kvtier/v1"; do
  [[ -f $d/__init__.py ]] || : >"$d/__init__.py"
done
