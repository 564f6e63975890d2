"""The prepared GPU check (``scripts/gpu-check.sh``, ``scripts/gpu-wheels.sh``), checked here
without a GPU; and the KVClient's copies into and out of an engine's CUDA KV cache.

CI never has a GPU, so what could break the check unseen is checked here, cheaply:

* both scripts parse (``bash -n``);
* every test file the check would run (``gpu-check.sh --plan``, which greps for the mark) exists
  and holds ``gpu``-marked tests, an AST scan finds no gpu-marked test file the grep misses, and
  the tests the check exists for are among them (so a test moved, renamed or unmarked fails here,
  not silently on the GPU machine); the marker is registered under ``--strict-markers``;
* every module the check runs with ``python -m`` exists and runs as a script, and the ``kvtier``
  command line it calls parses on the real CLI (typer's click command, as ``test_helm`` does);
* every runtime dependency in pyproject.toml is classified by ``gpu-wheels.sh --list`` (carried,
  on the GPU machine already, or not needed), and no "not needed" one is imported at module level
  by ``kvstore/``, ``bench/`` or a gpu test file; when ``.gpu-wheels/`` exists, it holds a wheel
  for every carried one and nothing the device provides.

The KVClient test runs on CPU everywhere and on CUDA (``gpu``) in the GPU check: a vLLM-style
paged cache on the device, saved to and loaded from a real daemon, bit for bit.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon import DaemonProcess

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "scripts" / "gpu-check.sh"
WHEELS_SCRIPT = ROOT / "scripts" / "gpu-wheels.sh"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# The gpu tests the check exists for (by name: files may move). Removing one of these, or its
# mark, is a decision: say so here.
EXPECTED_GPU_TESTS = {
    "TestHbmTierConformance",  # the HBM tier under the tier conformance suite
    "test_device_tensor_round_trip",
    "test_pinned_dram_arena_is_copied_directly",
    "test_pinning_with_a_gpu_registers_and_unregisters",  # the pinned shm arena
    "test_with_a_gpu_the_arena_is_pinned_by_default",
    "test_cuda_tensors_load_through_the_arena_or_a_bounce_buffer",  # StoreClient, shm and TCP
    "test_kv_client_paged_cache_round_trip",  # KVClient (this file)
    "test_model_is_loaded_on_the_gpu",  # the reference workers' --device cuda
    "test_disaggregated_requests_on_the_gpu_equal_the_reference",
}
# Import names of the packages gpu-wheels.sh leaves out as not needed.
IMPORT_NAMES = {"matplotlib": "matplotlib", "tqdm": "tqdm", "grpcio-tools": "grpc_tools",
                "cupy-cuda12x": "cupy", "ucxx-cu12": "ucxx", "ruff": "ruff", "mypy": "mypy"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _req_name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9_.-]+", requirement)
    assert match, requirement
    return _norm(match.group(0))


def _run(*args: str) -> str:
    return subprocess.run(["bash", *args], cwd=ROOT, capture_output=True, text=True, check=True,
                          timeout=60).stdout


@pytest.fixture(scope="module")
def plan() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in _run(str(CHECK), "--plan").splitlines():
        kind, _, rest = line.partition(" ")
        out.setdefault(kind, []).append(rest)
    return out


@pytest.fixture(scope="module")
def wheel_lists() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {"want": [], "build": [], "device": [], "skip": []}
    for line in _run(str(WHEELS_SCRIPT), "--list").splitlines():
        kind, name = line.split()
        out[kind].append(_norm(name))
    return out


def _is_gpu_mark(node: ast.expr) -> bool:
    # pytest.mark.gpu, or pytest.mark.gpu(...) called
    target = node.func if isinstance(node, ast.Call) else node
    return ast.unparse(target) == "pytest.mark.gpu"


def _gpu_tests(path: Path) -> set[str]:
    """Names of the gpu-marked tests and test classes in ``path`` (a module-level pytestmark
    marks them all)."""
    tree = ast.parse(path.read_text())
    whole = any(isinstance(n, ast.Assign) and any(ast.unparse(t) == "pytestmark" for t in n.targets)
                and "pytest.mark.gpu" in ast.unparse(n.value) for n in tree.body)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and \
                node.name.startswith(("test", "Test")):
            if whole or any(_is_gpu_mark(d) for d in node.decorator_list):
                names.add(node.name)
            elif isinstance(node, ast.FunctionDef):  # pytest.param(..., marks=pytest.mark.gpu)
                for dec in node.decorator_list:
                    if "marks=pytest.mark.gpu" in ast.unparse(dec).replace(" ", ""):
                        names.add(node.name)
    return names


def _module_level_imports(path: Path) -> set[str]:
    """Top-level package names imported when ``path`` is imported (not inside functions)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


# --- the scripts ------------------------------------------------------------------------------


@pytest.mark.parametrize("script", [CHECK, WHEELS_SCRIPT], ids=lambda p: p.name)
def test_script_parses(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "set -euo pipefail" in script.read_text()


def test_the_gpu_test_files_exist_and_hold_the_tests_the_check_is_for(
        plan: dict[str, list[str]]) -> None:
    assert plan["marker"] == ["gpu"]
    files = plan.get("test-file", [])
    found: set[str] = set()
    for name in files:
        path = ROOT / name
        assert path.is_file(), f"the GPU check would run {name}, which does not exist"
        tests = _gpu_tests(path)
        assert tests, f"{name} is in the GPU check's list but holds no gpu-marked test"
        found |= tests
    missing = EXPECTED_GPU_TESTS - found
    assert not missing, f"gpu tests no longer found by scripts/gpu-check.sh: {sorted(missing)}"
    # The grep in the script and an AST scan agree on which files hold gpu tests.
    by_ast = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
              if _gpu_tests(p)}
    assert by_ast == set(files)


def test_the_marker_is_registered_and_strict() -> None:
    options = PYPROJECT["tool"]["pytest"]["ini_options"]
    assert any(m.split(":")[0].strip() == "gpu" for m in options["markers"])
    assert "--strict-markers" in options["addopts"]


def test_the_modules_the_check_runs_exist(plan: dict[str, list[str]]) -> None:
    assert plan["module"]
    for module in plan["module"]:
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin, f"the GPU check runs {module}, which is gone"
        if module in ("kvstore.dataplane.native", "kvstore.cli.main"):  # run with python -m
            assert 'if __name__ == "__main__":' in Path(spec.origin).read_text()


def test_the_bench_command_line_parses_on_the_real_cli(plan: dict[str, list[str]]) -> None:
    import typer

    from kvstore.cli.main import app

    (line,) = plan["cli"]
    args = line.split()
    # Typer carries its own click (typer._click): duck-typed, as tests/test_helm.py does.
    command: Any = typer.main.get_command(app)
    path: list[str] = []
    while hasattr(command, "commands") and args and not args[0].startswith("-"):
        name = args.pop(0)
        assert name in command.commands, f"kvtier {' '.join(path)} has no command {name!r}"
        command, path = command.commands[name], [*path, name]
    assert path == ["bench", "tiers"]
    known = {opt for p in command.params for opt in p.opts}
    flags = [a for a in args if a.startswith("-")]
    assert set(flags) <= known, f"kvtier bench tiers has no {set(flags) - known}"
    ctx = command.make_context("tiers", list(args))  # raises on a bad flag or value
    assert ctx.params["quick"] is True and ctx.params["json_path"] is not None


# --- the wheels ---------------------------------------------------------------------------------


def test_every_runtime_dependency_is_classified_once(wheel_lists: dict[str, list[str]]) -> None:
    every = [n for names in wheel_lists.values() for n in names]
    assert len(every) == len(set(every)), "a package in two of gpu-wheels.sh's lists"
    project = PYPROJECT["project"]
    runtime = {_req_name(r) for r in project["dependencies"]}
    unclassified = runtime - set(every)
    assert not unclassified, f"add these to a list in scripts/gpu-wheels.sh: {unclassified}"
    for name in ("pytest", "pytest-timeout", "hypothesis"):  # what the gpu tests run under
        assert name in wheel_lists["want"]
        assert name in {_req_name(r) for r in project["optional-dependencies"]["dev"]}
    assert {_req_name(r) for r in PYPROJECT["build-system"]["requires"]} == \
        set(wheel_lists["build"])
    assert "torch" in wheel_lists["device"]


def test_no_package_left_out_is_imported_at_module_level(
        plan: dict[str, list[str]], wheel_lists: dict[str, list[str]]) -> None:
    unmapped = set(wheel_lists["skip"]) - set(IMPORT_NAMES)
    assert not unmapped, f"give IMPORT_NAMES the import name of {unmapped}"
    left_out = {IMPORT_NAMES[n] for n in wheel_lists["skip"]}
    files = [*(ROOT / "kvstore").rglob("*.py"), *(ROOT / "bench").glob("*.py"),
             *(ROOT / "tests" / "support").rglob("*.py"), ROOT / "tests" / "conftest.py",
             *(ROOT / f for f in plan.get("test-file", []))]
    for path in files:
        imported = _module_level_imports(path) & left_out
        assert not imported, (f"{path.relative_to(ROOT)} imports {imported} at module level, "
                              "which scripts/gpu-wheels.sh does not carry")


def test_the_wheels_folder_when_present(wheel_lists: dict[str, list[str]]) -> None:
    folder = ROOT / ".gpu-wheels"
    if not folder.is_dir():
        pytest.skip("no .gpu-wheels/ (bash scripts/gpu-wheels.sh makes it)")
    wheels = {_norm(w.name.split("-")[0]) for w in folder.glob("*.whl")}
    assert set(wheel_lists["want"]) | set(wheel_lists["build"]) <= wheels
    assert not wheels & set(wheel_lists["device"])
    requirements = sorted(folder.glob("requirements-cp3*.txt"))
    assert requirements
    for req in requirements:
        names = [_req_name(line) for line in req.read_text().split()]
        assert len(names) == len(set(names)), f"two versions of one package in {req.name}"
        assert set(wheel_lists["want"]) <= set(names)
    size = sum(f.stat().st_size for f in folder.iterdir())
    assert size < 40 << 20, f".gpu-wheels is {size >> 20} MiB: it must travel in 64 MiB"


# --- KVClient and an engine's KV cache on the device -------------------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("gpu-check"), "node-gpu-check",
                      dram_bytes="8MiB", nvme=False)
    d.start()
    yield d
    d.stop()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_kv_client_paged_cache_round_trip(daemon: DaemonProcess, device: str) -> None:
    """A vLLM-style paged cache on ``device``: gathered out of the pages into the client's host
    staging (device to host), saved, loaded into another cache with another block table (host
    to device, scattered into the pages), bit for bit; pages outside the table are untouched."""
    torch = pytest.importorskip("torch")
    import kvstore.client as kv_client

    layout = kv_client.KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_tokens=16,
                                dtype=torch.float16)
    page, pages, blocks = 8, 40, 4
    n_tokens = blocks * layout.block_tokens + 5  # the partial block is not stored
    gen = torch.Generator().manual_seed(7)
    toks = torch.randint(0, 50_000, (n_tokens,), generator=gen).tolist()

    def caches(fill: str) -> tuple[list[torch.Tensor], list[int]]:
        table = torch.randperm(pages, generator=gen)[:-(-n_tokens // page)].tolist()
        shape = (2, pages, page, layout.num_kv_heads, layout.head_dim)
        made = [(torch.randn(shape, generator=gen) if fill == "random" else torch.zeros(shape))
                .to(layout.dtype).to(device) for _ in range(layout.num_layers)]
        return made, table

    def tokens_of(cache: torch.Tensor, table: list[int], n: int) -> torch.Tensor:
        slots = (torch.tensor(table)[:, None] * page + torch.arange(page)).reshape(-1)[:n]
        return cache.view(2, pages * page, *cache.shape[3:])[:, slots.to(cache.device)].cpu()

    src, src_table = caches("random")
    dst, dst_table = caches("zeros")
    namespace = kv_client.namespace_for(layout, "gpu-check", f"paged-{device}")
    with kv_client.KVClient.connect(daemon.grpc_address, layout, namespace) as client:
        saved = client.save(toks, kv_client.PagedKV(src, src_table, layout)).result(30)
        assert saved.stored_blocks == tuple(range(blocks)) and saved.error is None
        handle = client.load(toks, kv_client.PagedKV(dst, dst_table, layout))
        for layer in range(layout.num_layers):
            handle.wait_for_layer(layer, timeout_s=30)
        result = handle.result(30)
    assert result.complete and result.loaded_blocks == blocks, result
    stored = blocks * layout.block_tokens
    used = {dst_table[t // page] for t in range(stored)}
    for layer in range(layout.num_layers):
        assert dst[layer].device.type == device
        assert torch.equal(tokens_of(dst[layer], dst_table, stored),
                           tokens_of(src[layer], src_table, stored))
        untouched = [p for p in range(pages) if p not in used]
        assert not dst[layer][:, untouched].any()
