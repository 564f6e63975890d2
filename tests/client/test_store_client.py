"""StoreClient details: errors keep their class across the wire, the lease channel frames, and
torch buffers (CPU here; CUDA tensors on a GPU machine) against a real daemon process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvstore import errors
from kvstore.client import DataPlane, StoreClient, StoreClientConfig
from kvstore.dataplane.transport.shm.frames import pack_keys, unpack_keys
from kvstore.wire import error_from_name, error_name, grpc_code_name
from tests.support.daemon import DaemonProcess


@pytest.mark.parametrize("exc", [
    errors.SizeMismatch("get_into k", expected=4, actual=3),
    errors.ChunkNotFound(b"\x01", "node a"),
    errors.ChunkBusy("leased"),
    errors.DiskFull("full"),
    errors.InvariantViolation("bug"),
])
def test_errors_round_trip_by_class_name(exc: errors.KvtierError) -> None:
    back = error_from_name(error_name(exc), str(exc))
    assert type(back) is type(exc)
    assert str(back) == str(exc)


def test_grpc_codes_follow_the_most_specific_class() -> None:
    assert grpc_code_name(errors.SizeMismatch("x", expected=1, actual=2)) == "INVALID_ARGUMENT"
    assert grpc_code_name(errors.DiskFull("x")) == "RESOURCE_EXHAUSTED"
    assert grpc_code_name(errors.ChunkBusy("x")) == "ABORTED"
    assert grpc_code_name(errors.PeerUnavailable("x")) == "UNAVAILABLE"
    assert grpc_code_name(errors.KvtierError("x")) == "UNKNOWN"
    assert type(error_from_name("NoSuchError", "m")) is errors.KvtierError


def test_lease_channel_keys_pack_and_unpack() -> None:
    keys = [b"a", b"", b"x" * 64]
    assert unpack_keys(pack_keys(keys), 3) == keys
    with pytest.raises(errors.ProtocolError):
        unpack_keys(pack_keys(keys) + b"z", 3)
    with pytest.raises(errors.ProtocolError):
        unpack_keys(pack_keys(keys)[:-1], 3)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("client"), "node-client", nvme=False)
    d.start()
    yield d
    d.stop()


@pytest.mark.parametrize("plane", [DataPlane.SHM, DataPlane.TCP])
def test_torch_cpu_tensors_in_and_out(daemon: DaemonProcess, plane: DataPlane) -> None:
    torch = pytest.importorskip("torch")
    with StoreClient.connect(daemon.grpc_address, StoreClientConfig(data_plane=plane)) as c:
        src = torch.arange(1 << 16, dtype=torch.float16)
        c.put(b"cpu-tensor-" + plane.value.encode(), src)
        out = torch.empty_like(src)
        assert c.get_into(b"cpu-tensor-" + plane.value.encode(), out) == src.numel() * 2
        assert torch.equal(out, src)


@pytest.mark.gpu
@pytest.mark.parametrize("plane", [DataPlane.SHM, DataPlane.TCP])
def test_cuda_tensors_load_through_the_arena_or_a_bounce_buffer(daemon: DaemonProcess,
                                                                plane: DataPlane) -> None:
    torch = pytest.importorskip("torch")
    with StoreClient.connect(daemon.grpc_address, StoreClientConfig(data_plane=plane)) as c:
        src = torch.randn(1 << 20, device="cuda", dtype=torch.float16)
        key = b"gpu-tensor-" + plane.value.encode()
        c.put(key, src)
        out = torch.empty_like(src)
        assert c.get_into(key, out) == src.numel() * 2
        assert torch.equal(out, src)
        host = torch.empty(src.numel(), dtype=torch.float16)
        c.get_into(key, host)
        assert torch.equal(host, src.cpu())
        with pytest.raises(errors.SizeMismatch):
            c.get_into(key, torch.empty(10, device="cuda", dtype=torch.float16))
