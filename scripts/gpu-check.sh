#!/usr/bin/env bash
# The GPU check: everything in kvtier that needs CUDA, in one command that ends within
# GPU_CHECK_TOTAL_S (default 285 s) on one GPU. Run it on the GPU machine from the repository
# root, after `bash scripts/gpu-wheels.sh` filled .gpu-wheels/ on a machine with PyPI. With the
# device tool:  run(command="bash scripts/gpu-check.sh", carry=[".gpu-wheels"], timeout_s=360)
#
#   bash scripts/gpu-check.sh          run every step below
#   bash scripts/gpu-check.sh --plan   print what it would run and exit (no GPU, nothing written;
#                                      tests/test_gpu_check.py checks the plan against the tree)
#
# Steps, each under its own timeout and all under one deadline:
#   python       the interpreter that has torch (python3, or $PYTHON) and its pinned wheel list
#   venv         a venv in /tmp with --system-site-packages, so the machine's torch and numpy
#                serve; when python3 is itself a venv (the H200 image's /opt/torch/.venv), a
#                .pth adds that venv's site-packages, which --system-site-packages would miss
#   install      .gpu-wheels/requirements-cpXY.txt (exact pins, --no-index --find-links), then
#                kvtier editable (--no-deps; setuptools and wheel come from the folder too)
#   native       the optional C fast path (python -m kvstore.dataplane.native) when gcc exists
#   cuda         torch.cuda.is_available(), or stop here with exit 3; versions and the GPU
#   etcd         .gpu-wheels/etcd.gz unpacked for the one gpu test that runs a whole cluster
#   gpu-tests    pytest -m gpu over every test file holding a gpu mark (found by grep, so a moved
#                file is still found): the HBM tier's conformance suite and device copies, the
#                pinned arena, StoreClient and KVClient CUDA copies, the workers' --device cuda
#   bench-tiers  kvtier bench tiers --quick: DRAM (a pinned arena with CUDA), NVMe and HBM rows
#                beside the limits measured in the same run
#
# Written to $OUT (the device tool's output folder), else .gpu-check-out/ (ignored by git),
# at most 8 plain files, none in a subfolder:
#   gpu-check.log        everything printed, every step
#   summary.txt, .json   one row per step: status (PASS, WARN, FAIL, SKIP), seconds, note
#   env.json             python, torch, CUDA, GPU, driver, the versions that were imported
#   pytest-gpu.xml       JUnit XML of the gpu tests
#   tiers.json           the bench's JSON (rows, limits, git sha, machine)
#   pytest-logs.tar.gz   daemon, worker and etcd logs of the test run, only when a test failed
# Exit status: 0 when no step failed (WARN: something was not checked, e.g. a skipped test),
# 1 when one failed, 3 when torch sees no CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."

ROOT=$PWD
TOTAL_S=${GPU_CHECK_TOTAL_S:-285}
PY=${PYTHON:-python3}
WHEELS=${GPU_WHEELS_DIR:-$ROOT/.gpu-wheels}
OUT=${OUT:-$ROOT/.gpu-check-out}
WORK=${GPU_CHECK_WORK:-/tmp/kvtier-gpu-check}
VENV=$WORK/venv
VPY=$VENV/bin/python
MARKER=gpu
PER_TEST_S=150
BENCH_ARGS=(bench tiers --quick --json "$OUT/tiers.json")  # NVMe files: the bench's default dir
MODULES=(kvstore.dataplane.native kvstore.cli.main kvstore.dataplane.cuda)

# Test files holding a gpu mark: a decorator, a module-level pytestmark, or a parameter's marks=.
gpu_test_files() {
  grep -rlE --include='test_*.py' -e "^[[:space:]]*@pytest\.mark\.$MARKER\b" \
    -e "^pytestmark[[:space:]]*=.*pytest\.mark\.$MARKER\b" \
    -e "marks=\[?pytest\.mark\.$MARKER\b" tests | sort
}

NOTE=$WORK/step.note
export ROOT PY WHEELS OUT WORK NOTE PYTHONUNBUFFERED=1 PATH=$WORK/bin:$PATH
START=$SECONDS
STEPS=()

note() { echo "$*" >"$NOTE"; }  # a step's one-line result; "WARN ..." makes the step WARN

# run_step NAME LIMIT_S KEEP_S FUNCTION [ARG...]: run FUNCTION ARG... in a child process (this
# script again, `--step`: the function is read from the file, its variables recomputed) under
# min(LIMIT_S, time left - KEEP_S), KEEP_S being the time kept for the steps after it (given for
# the default 285 s deadline and scaled to GPU_CHECK_TOTAL_S).
run_step() {
  local name=$1 limit=$2 keep=$(($3 * TOTAL_S / 285)) fn=$4
  shift 4
  local left=$((TOTAL_S - (SECONDS - START) - keep))
  local t=$((limit < left ? limit : left)) rc=0 t0=$SECONDS status detail
  printf '\n==== %s (limit %ss, %ss elapsed) ====\n' "$name" "$t" "$((SECONDS - START))"
  if ((t < 5)); then
    STEPS+=("$name|SKIP|0|no time left under GPU_CHECK_TOTAL_S=$TOTAL_S")
    return 1
  fi
  : >"$NOTE"
  timeout -k 5 "$t" bash "$ROOT/scripts/gpu-check.sh" --step "$fn" "$@" || rc=$?
  detail=$(head -1 "$NOTE")
  if ((rc == 124 || rc == 137)); then status=FAIL detail="timed out after ${t}s${detail:+; $detail}"
  elif ((rc != 0)); then status=FAIL detail="exit $rc${detail:+; $detail}"
  elif [[ $detail == WARN* ]]; then status=WARN detail=${detail#WARN }
  else status=PASS; fi
  STEPS+=("$name|$status|$((SECONDS - t0))|$detail")
  echo "---- $name: $status ${detail:+($detail)}"
  return "$rc"
}

summary() {
  local row name status secs detail worst=0
  {
    printf '\n==== summary (%ss of %ss) ====\n' "$((SECONDS - START))" "$TOTAL_S"
    printf '%-12s %-5s %5s  %s\n' step status s note
    for row in "${STEPS[@]}"; do
      IFS='|' read -r name status secs detail <<<"$row"
      printf '%-12s %-5s %5s  %s\n' "$name" "$status" "$secs" "$detail"
    done
  } | tee "$OUT/summary.txt"
  "$PY" - "$OUT/summary.json" "$((SECONDS - START))" "${STEPS[@]}" <<'EOF'
import json, sys
path, total, rows = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
steps = [dict(zip(("step", "status", "seconds", "note"), r.split("|", 3))) for r in rows]
for s in steps:
    s["seconds"] = int(s["seconds"])
json.dump({"elapsed_s": total, "steps": steps}, open(path, "w"), indent=2)
EOF
  for row in "${STEPS[@]}"; do [[ $row == *"|FAIL|"* ]] && worst=1; done
  return "$worst"
}

# --- the steps (each in its own process: `gpu-check.sh --step step_NAME ARG...`) --------------

step_python() {
  "$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])'
  local tag
  tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  if [[ ! -f $WHEELS/requirements-$tag.txt ]]; then
    echo "no $WHEELS/requirements-$tag.txt: run, where PyPI is reachable," \
      "GPU_PYTHON_VERSIONS=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
      "bash scripts/gpu-wheels.sh, and carry .gpu-wheels" >&2
    note "no wheels for $tag"
    return 1
  fi
  note "$("$PY" -c 'import sys; print(sys.version.split()[0])') ($tag)"
}

step_venv() {
  rm -rf "$VENV"
  if ! "$PY" -m venv --system-site-packages "$VENV"; then
    echo "venv with pip failed; making one without (the parent interpreter's pip serves)"
    rm -rf "$VENV"
    "$PY" -m venv --without-pip --system-site-packages "$VENV"
  fi
  "$PY" - "$VPY" <<'EOF'
import pathlib, site, subprocess, sys
vpy = sys.argv[1]
if sys.prefix != sys.base_prefix:  # python3 is a venv: add its site-packages behind the new one's
    purelib = subprocess.check_output(
        [vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip()
    dirs = list(dict.fromkeys(site.getsitepackages()))
    # addsitedir, not a bare path line: the parent's own .pth files are processed too.
    lines = "".join(f"import site; site.addsitedir({d!r})\n" for d in dirs)
    (pathlib.Path(purelib) / "_kvtier_parent_site.pth").write_text(lines)
    print("parent site-packages:", *dirs)
EOF
  "$VPY" -c 'import torch, numpy; print("torch", torch.__version__, "numpy", numpy.__version__)'
  "$VPY" -m pip --version
  note "$VENV"
}

step_install() {
  local tag pip=("$VPY" -m pip) flags=(--no-index --find-links "$WHEELS" --no-cache-dir
                                       --disable-pip-version-check --progress-bar off)
  tag=$("$VPY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  "${pip[@]}" install -q "${flags[@]}" -r "$WHEELS/requirements-$tag.txt"
  "${pip[@]}" install -q "${flags[@]}" --no-deps -e "$ROOT"
  "$VPY" -c '
import importlib.metadata as md
import aetcd, cbor2, grpc, grpc_health, grpc_reflection, google.protobuf, hypothesis, lz4
import prometheus_client, pytest, pytest_timeout, rich, typer, xxhash, yaml, zstandard
import kvstore, kvstore.cli.main
print("kvtier", md.version("kvtier"), "from", kvstore.__file__)'
  note "$(wc -l <"$WHEELS/requirements-$tag.txt") pinned wheels + kvtier (editable)"
}

step_native() {
  if ! command -v gcc >/dev/null; then
    note "WARN no gcc: the fast path stays off, everything runs in Python"
    return 0
  fi
  "$VPY" -m kvstore.dataplane.native
  ls native/build
  note "$(cd native/build && echo *)"
}

step_cuda() {
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv,noheader || true
  "$VPY" - "$OUT/env.json" <<'EOF'
import importlib.metadata as md, json, os, platform, shutil, subprocess, sys

import torch

def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None

try:  # the device tool's copy of the tree may come without .git, the machine without git
    sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
except OSError:
    sha = ""
sha = os.environ.get("GPU_CHECK_SHA") or sha or "unknown"
env = {"git_sha": sha, "python": sys.version.split()[0], "executable": sys.executable,
       "platform": platform.platform(), "cpus": os.cpu_count(),
       "torch": torch.__version__, "torch_cuda": torch.version.cuda,
       "cuda_available": torch.cuda.is_available(),
       "versions": {d: version(d) for d in (
           "kvtier", "numpy", "transformers", "grpcio", "protobuf", "aetcd", "pytest",
           "hypothesis", "cupy-cuda13x", "cupy-cuda12x")}}
smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                     capture_output=True, text=True) if shutil.which("nvidia-smi") else None
env["driver"] = smi.stdout.strip() if smi and smi.returncode == 0 else None
if env["cuda_available"]:
    p = torch.cuda.get_device_properties(0)
    env["gpu"] = {"name": p.name, "count": torch.cuda.device_count(),
                  "capability": f"{p.major}.{p.minor}", "memory_bytes": p.total_memory,
                  "multiprocessors": p.multi_processor_count}
json.dump(env, open(sys.argv[1], "w"), indent=2)
print(json.dumps(env, indent=2))
if not env["cuda_available"]:
    why = f"torch {torch.__version__} (built for CUDA {torch.version.cuda}) sees no CUDA device"
    print(f"gpu-check: {why}: there is nothing here to check", file=sys.stderr)
    open(os.environ["NOTE"], "w").write(why + "\n")
    sys.exit(3)
from kvstore.dataplane.cuda import cuda_available
if not cuda_available():
    sys.exit("gpu-check: torch sees a GPU but kvstore.dataplane.cuda.cuda_available() is False")
g = env["gpu"]
open(os.environ["NOTE"], "w").write(
    f"{g['name']} x{g['count']}, torch {env['torch']}, CUDA {env['torch_cuda']}\n")
EOF
}

step_etcd() {
  mkdir -p "$WORK/bin"
  if [[ -f $WHEELS/etcd.gz ]]; then
    "$PY" -c 'import gzip, shutil, sys; shutil.copyfileobj(gzip.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      "$WHEELS/etcd.gz" "$WORK/bin/etcd"
    chmod +x "$WORK/bin/etcd"
  fi
  if ! command -v etcd >/dev/null; then
    note "WARN no etcd (not carried, none installed): the cluster gpu test will skip"
    return 0
  fi
  etcd --version | head -1
  note "$(command -v etcd)"
}

step_gpu_tests() {
  local files rc=0
  mapfile -t files < <(gpu_test_files)
  if ((${#files[@]} == 0)); then
    note "no test file under tests/ holds a $MARKER mark"
    return 1
  fi
  printf 'gpu test file: %s\n' "${files[@]}"
  rm -rf "$WORK/pytest"
  "$VPY" -m pytest -m "$MARKER" -v -rs -p no:cacheprovider --timeout "$PER_TEST_S" \
    --junitxml "$OUT/pytest-gpu.xml" --basetemp "$WORK/pytest" "${files[@]}" || rc=$?
  [[ -f $OUT/pytest-gpu.xml ]] || { note "no JUnit XML: pytest exited $rc before writing it"; return 1; }
  "$VPY" - "$OUT/pytest-gpu.xml" "$NOTE" <<'EOF' || echo "gpu-check: could not read the JUnit XML"
import collections, sys, xml.etree.ElementTree as ET
cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
per_file = collections.defaultdict(collections.Counter)
total = collections.Counter()
for case in cases:
    outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
    module = case.get("classname", "?").split(".")
    name = "/".join(m for m in module if not m[:1].isupper()) + ".py"
    per_file[name][outcome] += 1
    total[outcome] += 1
for name, counts in sorted(per_file.items()):
    print(f"  {name:48s} " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
line = ", ".join(f"{n} {k}" for k, n in sorted(total.items())) or "no tests"
bad = total["failure"] + total["error"]
open(sys.argv[2], "w").write(("WARN " if total["skipped"] and not bad else "") + line + "\n")
EOF
  if ((rc != 0)); then
    (cd "$WORK/pytest" 2>/dev/null && find . -name '*.log' -size -4M -print0 |
      tar czf "$OUT/pytest-logs.tar.gz" --null -T -) || true
  fi
  return "$rc"
}

step_bench_tiers() {  # ARG...: the kvtier command line
  "$VPY" -m kvstore.cli.main "$@"
  "$VPY" - "$OUT/tiers.json" "$NOTE" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
if r["hbm"] != "measured":
    sys.exit(f"gpu-check: the bench did not measure the HBM tier: {r['hbm']}")
big = max(row["chunk_bytes"] for row in r["rows"])
parts = [f"{row['tier']} {row['op']} {row['gbps']:.1f} GB/s ({row['ratio_to_limit']:.2f} of limit)"
         for row in r["rows"] if row["chunk_bytes"] == big and row["tier"] in ("hbm", "dram")]
open(sys.argv[2], "w").write(f"at {big >> 20} MiB: " + "; ".join(parts) + "\n")
EOF
}

main() {
  echo "gpu-check: $(date -u +%FT%TZ) in $ROOT; output in $OUT; deadline ${TOTAL_S}s"
  local rc=0
  run_step python 30 250 step_python &&
    run_step venv 60 220 step_venv &&
    run_step install 90 190 step_install || { summary || true; return 1; }
  run_step native 60 180 step_native || true
  run_step cuda 60 160 step_cuda || rc=$?
  if ((rc != 0)); then
    summary || true
    return $((rc == 3 ? 3 : 1))
  fi
  run_step etcd 20 150 step_etcd || true
  [[ -x $WORK/bin/etcd ]] && export KVTIER_ETCD_BINARY=$WORK/bin/etcd
  run_step gpu-tests 180 80 step_gpu_tests || true
  run_step bench-tiers 90 0 step_bench_tiers "${BENCH_ARGS[@]}" || true
  summary
}

case ${1:-} in
  --plan)
    echo "marker $MARKER"
    gpu_test_files | sed 's/^/test-file /'
    for m in "${MODULES[@]}"; do echo "module $m"; done
    echo "cli ${BENCH_ARGS[*]}"
    echo "wheels $WHEELS"
    ;;
  --step)  # internal: one step, run by run_step
    [[ $(type -t "${2:-}") == function && $2 == step_* ]] || { echo "no step ${2:-}" >&2; exit 2; }
    "${@:2}"
    ;;
  "")
    mkdir -p "$OUT" "$WORK"
    set +e
    main 2>&1 | tee "$OUT/gpu-check.log"
    exit "${PIPESTATUS[0]}"
    ;;
  *)
    echo "usage: $0 [--plan]" >&2
    exit 2
    ;;
esac
