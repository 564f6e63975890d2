"""Workers' ``--device``: parsing, the refusal of a GPU this machine lacks (CPU tests), and
the whole disaggregated path on a real GPU (``gpu`` tests, skipped cleanly without CUDA)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvstore.cluster.local import ClusterSpec, LocalCluster  # noqa: E402
from kvstore.engine.model import build_reference_model  # noqa: E402
from kvstore.engine.worker.cli import main  # noqa: E402
from kvstore.engine.worker.config import WorkerConfig, load_worker_model  # noqa: E402
from kvstore.engine.worker.device import resolve_device  # noqa: E402
from kvstore.errors import ConfigError, InvalidArgument  # noqa: E402
from kvstore.membership.engines import EngineRole  # noqa: E402
from kvstore.membership.launcher import find_etcd_binary  # noqa: E402
from tests.support.models import tiny_spec  # noqa: E402

SPEC = tiny_spec()
BLOCK = 16
CUDA = torch.cuda.is_available()
no_cuda_here = pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")


def config(**overrides: object) -> WorkerConfig:
    fields: dict[str, object] = dict(role=EngineRole.DECODE, instance_id="d0", node_id="n0",
                                     daemon_address="127.0.0.1:1", etcd_endpoint="http://x:1",
                                     spec=SPEC)
    fields.update(overrides)
    return WorkerConfig(**fields)  # type: ignore[arg-type]


WORKER_ARGS = ["--role", "decode", "--instance-id", "d0", "--node-id", "n0",
               "--daemon", "127.0.0.1:1", "--etcd", "http://127.0.0.1:1"]


@pytest.mark.parametrize("device", ["nvidia", "cuda:", "cuda:x", "CPU", "", "mps"])
def test_malformed_device_is_rejected(device: str) -> None:
    with pytest.raises(InvalidArgument, match="device"):
        config(device=device)
    with pytest.raises(ConfigError, match="device"):
        resolve_device(device)


def test_cpu_and_auto_resolve_on_this_machine() -> None:
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if CUDA else "cpu")
    assert config().device == "cpu"  # the default
    assert config(device="cuda:1").device == "cuda:1"  # well-formed: checked at start


@no_cuda_here
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_is_refused_clearly_without_a_gpu(device: str) -> None:
    with pytest.raises(ConfigError, match="CUDA is not available") as info:
        resolve_device(device)
    assert "--device cpu" in str(info.value)


@no_cuda_here
def test_worker_command_refuses_cuda_before_starting(capsys: pytest.CaptureFixture[str]) -> None:
    # Nothing listens at the daemon or etcd addresses: exit code 2 and the message show that
    # the refusal came first, not a connection failure.
    assert main([*WORKER_ARGS, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "CUDA is not available" in err and "cuda" in err


def test_worker_command_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*WORKER_ARGS, "--device", "tpu"]) == 2
    assert "device must be" in capsys.readouterr().err
    assert main([*WORKER_ARGS, "--max-decode-batch", "0"]) == 2
    assert "max_decode_batch" in capsys.readouterr().err


def test_cluster_passes_device_and_batch_to_its_workers(tmp_path: Path) -> None:
    cluster = LocalCluster(ClusterSpec(work_dir=tmp_path, spec=SPEC, device="auto",
                                       max_decode_batch=3))
    cluster.daemon_addresses = {"node-b": "127.0.0.1:9"}  # what start() would have learned
    argv = cluster._worker_child("decode-0", "decode", "node-b").argv
    assert argv[argv.index("--device") + 1] == "auto"
    assert argv[argv.index("--max-decode-batch") + 1] == "3"
    with pytest.raises(ConfigError):
        ClusterSpec(work_dir=tmp_path, max_decode_batch=0)


def test_model_is_loaded_on_the_resolved_device() -> None:
    model = load_worker_model(config(), resolve_device("cpu"))
    assert {p.device.type for p in model.parameters()} == {"cpu"}


# --- on a real GPU --------------------------------------------------------------------------


@pytest.mark.gpu
def test_model_is_loaded_on_the_gpu() -> None:
    model = load_worker_model(config(device="cuda"), resolve_device("cuda"))
    assert {p.device.type for p in model.parameters()} == {"cuda"}


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    if find_etcd_binary() is None:
        pytest.skip("etcd binary not found")
    spec = ClusterSpec(work_dir=tmp_path_factory.mktemp("gpu-cluster"), spec=SPEC,
                       block_tokens=BLOCK, dram_bytes=16 << 20, nvme_bytes=32 << 20,
                       device="cuda")
    with LocalCluster(spec) as c:
        yield c


@pytest.mark.gpu
def test_disaggregated_requests_on_the_gpu_equal_the_reference(
        gpu_cluster: LocalCluster) -> None:
    # Prefill on the GPU, KV saved layer by layer from GPU tensors, loaded by the decode
    # worker into GPU tensors, batched decode on the GPU; with and without reuse.
    from kvstore.engine.gateway import Gateway, GatewayResult

    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(0, SPEC.vocab_size, (2 * BLOCK,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, SPEC.vocab_size, (n,), generator=gen).tolist()
               for n in (5, BLOCK, 2 * BLOCK + 3)]

    async def go(tenant: str, reuse: bool) -> list[GatewayResult]:
        async with Gateway(etcd_endpoint=gpu_cluster.etcd_endpoint,
                           prefix=gpu_cluster.spec.prefix,
                           model_name=gpu_cluster.spec.model_name) as gateway:
            return list(await asyncio.gather(*(
                gateway.generate(f"{tenant}-{i}", p, max_new_tokens=12, tenant=tenant,
                                 reuse=reuse) for i, p in enumerate(prompts))))

    plain = asyncio.run(go("gpu-plain", False))
    reused = asyncio.run(go("gpu-reuse", True))
    model = build_reference_model(SPEC).to("cuda")
    for p, a, b in zip(prompts, plain, reused, strict=True):
        assert a.tokens == b.tokens == reference_on_device(model, p, 12)
        assert a.decode["loaded_blocks"] == len(p) // BLOCK
    assert sum(r.prefill["reused_tokens"] for r in reused) > 0


def reference_on_device(model: object, tokens: list[int], n: int) -> list[int]:
    """Greedy reference on the model's device (one request, no kvtier)."""
    out: list[int] = []
    with torch.no_grad():
        device = next(model.parameters()).device  # type: ignore[attr-defined]
        res = model(input_ids=torch.tensor([tokens], device=device),  # type: ignore[operator]
                    use_cache=True)
        for _ in range(n):
            out.append(int(torch.argmax(res.logits[0, -1])))
            res = model(input_ids=torch.tensor([[out[-1]]], device=device),  # type: ignore[operator]
                        past_key_values=res.past_key_values, use_cache=True)
    return out
