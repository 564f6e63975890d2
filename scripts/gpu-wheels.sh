#!/usr/bin/env bash
# Fetch, here (where PyPI is reachable), what scripts/gpu-check.sh installs on the GPU machine,
# which has PyTorch, CuPy, numpy and transformers but none of kvtier's other dependencies and no
# network. Everything lands in one ignored folder (.gpu-wheels/) that travels in the device
# tool's `carry` (64 MiB for the whole working tree), so the script prints its size and refuses
# to leave a folder that would not fit.
#
#   bash scripts/gpu-wheels.sh           download into .gpu-wheels/ (replacing what is there)
#   bash scripts/gpu-wheels.sh --list    print how each dependency is provided, download nothing
#
# What the folder holds:
#   *.whl                        binary wheels for CPython $GPU_PYTHON_VERSIONS on manylinux x86-64
#                                (the device's python3 is 3.12.3: .library/device/KINDS.md)
#   requirements-cpXY.txt        an exact pin of every downloaded wheel but the build backend
#                                (pip on the device installs exactly what was fetched)
#   setuptools, wheel            pyproject's build backend, for `pip install -e .` offline
#   etcd.gz                      this machine's etcd (a static-ish Go binary, only libc), for the
#                                one GPU test that runs a whole cluster; GPU_WHEELS_ETCD=0 skips it
#
# Versions are those of this checkout's .venv (the suite passes with them here): the top-level
# names are pinned to them and every other pip freeze line is a constraint. Without .venv the
# pyproject specifiers apply.
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=${GPU_WHEELS_DIR:-.gpu-wheels}
PY_VERSIONS=${GPU_PYTHON_VERSIONS:-3.12}
MAX_MIB=${GPU_WHEELS_MAX_MIB:-40}
WITH_ETCD=${GPU_WHEELS_ETCD:-1}

# How each dependency reaches the GPU run. tests/test_gpu_check.py checks that every runtime
# dependency in pyproject.toml is in exactly one list, and that no NOT_NEEDED one is imported at
# module level by kvstore/ or by a gpu test file.
#   WANT: installed from the folder (runtime dependencies the run imports, the test runner).
WANT=(xxhash lz4 zstandard cbor2 typer rich prometheus-client pyyaml
      grpcio grpcio-health-checking grpcio-reflection protobuf aetcd
      pyzmq msgspec aiohttp cryptography
      pytest pytest-timeout hypothesis)
#   BUILD: the build backend (pyproject [build-system]), for the editable install of kvtier.
BUILD=(setuptools wheel)
#   FROM_DEVICE: in the GPU machine's image already (KINDS.md) and large: never carried.
#   tokenizers comes with transformers and jinja2 with torch.
FROM_DEVICE=(numpy torch transformers tokenizers jinja2)
#   NOT_NEEDED: not imported by the GPU run. matplotlib: planner plots, imported lazily;
#   tqdm: imported nowhere; grpcio-tools: proto generation and the proto tests only;
#   cupy-cuda12x: imported nowhere (the device has cupy-cuda13x anyway); ucxx-cu12: the UCX
#   transport tests skip without it; ruff, mypy: lint only.
NOT_NEEDED=(matplotlib tqdm grpcio-tools cupy-cuda12x ucxx-cu12 ruff mypy)

if [[ ${1:-} == --list ]]; then
  for n in "${WANT[@]}"; do echo "want $n"; done
  for n in "${BUILD[@]}"; do echo "build $n"; done
  for n in "${FROM_DEVICE[@]}"; do echo "device $n"; done
  for n in "${NOT_NEEDED[@]}"; do echo "skip $n"; done
  exit 0
elif [[ $# -gt 0 ]]; then
  echo "usage: $0 [--list]" >&2
  exit 2
fi

if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi
"$PY" -m pip --version >/dev/null

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# pip, without the warnings a local index of this machine's pip config repeats for every name.
pip_() {
  local rc=0
  "$PY" -m pip "$@" 2>"$work/pip.err" || rc=$?
  grep -v 'is ignored: it is neither a file nor a directory' "$work/pip.err" >&2 || true
  return "$rc"
}

# Top-level requirement lines: the .venv's version where installed, else pyproject's specifier.
"$PY" - "$work/top.txt" "${WANT[@]}" <<'EOF'
import importlib.metadata as md, re, sys, tomllib
out, names = sys.argv[1], sys.argv[2:]
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
specs = {}
for line in project["dependencies"] + [d for ds in project["optional-dependencies"].values() for d in ds]:
    name = re.match(r"[A-Za-z0-9_.-]+", line).group(0)
    specs[re.sub(r"[-_.]+", "-", name).lower()] = line
lines = []
for name in names:
    try:
        lines.append(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        lines.append(specs.get(name, name))
open(out, "w").write("\n".join(lines) + "\n")
EOF
# Constraints: every other pinned package of the .venv (no local versions such as +cpu).
if [[ $PY == .venv/bin/python ]]; then
  "$PY" -m pip freeze --exclude-editable | grep -E '^[A-Za-z0-9_.-]+==[^+ ]+$' >"$work/constraints.txt" || true
else
  : >"$work/constraints.txt"
fi

platforms=()
for n in $(seq 17 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)

rm -rf "$DEST"
mkdir -p "$DEST"
for ver in $PY_VERSIONS; do
  tag=cp${ver/./}
  echo "gpu-wheels: CPython $ver ($tag)"
  pip_ download -q --disable-pip-version-check --dest "$work/$tag" --only-binary=:all: \
    --implementation cp --python-version "$ver" "${platforms[@]}" \
    -r "$work/top.txt" -c "$work/constraints.txt"
  # A FROM_DEVICE package pulled in as a dependency stays out: the device's copy serves.
  for n in "${FROM_DEVICE[@]}"; do rm -f "$work/$tag/${n//-/_}"-[0-9]*.whl; done
  "$PY" - "$work/$tag" "$DEST/requirements-$tag.txt" <<'EOF'
import pathlib, sys
wheels = sorted(pathlib.Path(sys.argv[1]).glob("*.whl"))
pins = [f"{w.name.split('-')[0]}=={w.name.split('-')[1]}" for w in wheels]
pathlib.Path(sys.argv[2]).write_text("\n".join(pins) + "\n")
EOF
  mv -f "$work/$tag"/*.whl "$DEST/"
done

build_pins=()
for n in "${BUILD[@]}"; do build_pins+=("$n==$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$n" 2>/dev/null || echo 0)"); done
# pyproject needs setuptools>=77; fall back to the newest when the .venv has none.
build_pins=("${build_pins[@]/%==0/}")
pip_ download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --dest "$DEST" "${build_pins[@]}"

if [[ $WITH_ETCD == 1 ]]; then
  etcd_bin=$(command -v etcd || true)
  if [[ -z $etcd_bin ]]; then
    echo "gpu-wheels: warning: no etcd here; the cluster GPU test will skip on the device" >&2
  elif [[ $(uname -m) != x86_64 ]]; then
    echo "gpu-wheels: warning: this etcd is $(uname -m), the device is x86-64; not carried" >&2
  else
    gzip -9 -c "$etcd_bin" >"$DEST/etcd.gz"
    echo "gpu-wheels: etcd $("$etcd_bin" --version 2>/dev/null | head -1 | awk '{print $3}') from $etcd_bin"
  fi
fi

count=$(find "$DEST" -name '*.whl' | wc -l)
size=$(du -sb "$DEST" | cut -f1)
tree=$( (git ls-files -z; git ls-files -z -o --exclude-standard) | xargs -0 du -cb 2>/dev/null \
  | awk '$2 == "total" {s += $1} END {print s + 0}')
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
echo "gpu-wheels: $DEST: $count wheels$([[ -f $DEST/etcd.gz ]] && echo ' + etcd.gz'), $(mib "$size") MiB"
echo "gpu-wheels: travels: working tree $(mib "$tree") MiB + $DEST $(mib "$size") MiB" \
  "= $(mib $((tree + size))) MiB of the device tool's 64 MiB"
if ((size > MAX_MIB * 1048576)); then
  echo "gpu-wheels: $DEST is over GPU_WHEELS_MAX_MIB=$MAX_MIB MiB" >&2
  exit 1
fi
