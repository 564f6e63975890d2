"""Bad input gets a clear error, never a server fault (issue 12).

Bytes that are not a protobuf message, sent with a raw ``channel.unary_unary`` (or
``unary_stream``) to every method of the store daemon's Store service and of the conductor's
Conductor service (real processes), are INVALID_ARGUMENT with the kvtier error name, and the
server logs no ERROR (grpc used to answer UNKNOWN and log a traceback). A 10 MB key in any key
field is INVALID_ARGUMENT with a short message.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvstore._proto.kvtier.v1 import conductor_pb2, store_pb2
from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore.membership.etcd import KeyLayout
from kvstore.membership.launcher import LocalEtcd
from kvstore.wire import ERROR_METADATA_KEY
from tests.support.conductor import ConductorProcess
from tests.support.daemon import DaemonProcess

HUGE = b"\xab" * (10 << 20)
MESSAGE_LIMIT = 1024


def _garbage(seed: int) -> bytes:
    # Tag 0x0f is field 1 with wire type 7, which does not exist: never a valid message,
    # whatever random bytes follow.
    return b"\x0f" + np.random.default_rng(seed).bytes(64)


def _send_garbage(address: str, service: Any, log_path: Path) -> None:
    before = log_path.read_text() if log_path.exists() else ""
    with grpc.insecure_channel(address) as channel:
        for i, method in enumerate(service.methods):
            path = f"/{service.full_name}/{method.name}"
            if method.server_streaming:
                call: Any = channel.unary_stream(path, request_serializer=None,
                                                 response_deserializer=None)
                with pytest.raises(grpc.RpcError) as caught:
                    list(call(_garbage(i), timeout=10))
            else:
                call = channel.unary_unary(path, request_serializer=None,
                                           response_deserializer=None)
                with pytest.raises(grpc.RpcError) as caught:
                    call(_garbage(i), timeout=10)
            err: Any = caught.value
            assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, (path, err.details())
            assert dict(err.trailing_metadata() or ()).get(ERROR_METADATA_KEY) == \
                "InvalidArgument", path
            assert "not a valid message" in err.details(), path
    logged = log_path.read_text()[len(before):]
    assert " ERROR " not in logged and "Traceback" not in logged, logged[-4000:]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("bad-input"), "node-bad", dram_bytes="16MiB",
                      nvme=False)
    d.start()
    yield d
    d.stop()


def test_garbage_to_every_store_method_is_invalid_argument(daemon: DaemonProcess) -> None:
    service = store_pb2.DESCRIPTOR.services_by_name["Store"]
    assert len(service.methods) > 20
    _send_garbage(daemon.grpc_address, service, daemon.log_path)


def test_garbage_to_every_conductor_method_is_invalid_argument(
        tmp_path: Path, etcd_server: LocalEtcd, etcd_layout: KeyLayout) -> None:
    conductor = ConductorProcess(tmp_path, "c-bad", etcd_endpoint=etcd_server.client_url,
                                 prefix=etcd_layout.prefix)
    address = conductor.start()
    try:
        _send_garbage(address, conductor_pb2.DESCRIPTOR.services_by_name["Conductor"],
                      conductor.log_path)
    finally:
        conductor.stop()


def test_a_huge_key_in_any_field_is_a_short_invalid_argument(daemon: DaemonProcess) -> None:
    options = [("grpc.max_send_message_length", 64 << 20)]
    with grpc.insecure_channel(daemon.grpc_address, options=options) as channel:
        from kvstore._proto.kvtier.v1 import store_pb2_grpc

        stub: Any = store_pb2_grpc.StoreStub(channel)  # type: ignore[no-untyped-call]
        stub.Put(pb.PutRequest(key=b"root", value=b"v"))
        calls = {
            "Put parent": lambda: stub.Put(pb.PutRequest(key=b"k", parent=HUGE, value=b"v")),
            "Put key": lambda: stub.Put(pb.PutRequest(key=HUGE, value=b"v")),
            "BatchPut parent": lambda: stub.BatchPut(pb.BatchPutRequest(
                items=[pb.PutRequest(key=b"k", parent=HUGE, value=b"v")])),
            "Get": lambda: stub.Get(pb.GetRequest(key=HUGE)),
            "Lookup": lambda: stub.Lookup(pb.LookupRequest(keys=[b"root", HUGE])),
            "Exists": lambda: stub.Exists(pb.ExistsRequest(keys=[HUGE])),
            "Remove": lambda: stub.Remove(pb.RemoveRequest(key=HUGE)),
            "Inspect": lambda: stub.Inspect(pb.InspectRequest(key=HUGE)),
            "List": lambda: stub.List(pb.ListRequest(key_prefix=HUGE)),
            "Evict": lambda: stub.Evict(pb.EvictRequest(key_prefix=HUGE)),
            "Pin": lambda: stub.Pin(pb.PinRequest(keys=[HUGE])),
            "AcquireRead": lambda: stub.AcquireRead(pb.AcquireReadRequest(keys=[HUGE])),
            "Reserve key": lambda: stub.Reserve(pb.ReserveRequest(key=HUGE, size_bytes=64)),
            "Reserve parent": lambda: stub.Reserve(pb.ReserveRequest(key=b"k", parent=HUGE,
                                                                     size_bytes=64)),
            "SetParents": lambda: stub.SetParents(pb.SetParentsRequest(keys=[b"k"],
                                                                       parents=[HUGE])),
        }
        for what, call in calls.items():
            if what == "BatchPut parent":  # per-item outcome, not a failed call
                item = call().items[0]
                assert not item.ok and item.error == "InvalidArgument", what
                assert len(item.detail) < MESSAGE_LIMIT, (what, len(item.detail))
                continue
            with pytest.raises(grpc.RpcError) as caught:
                call()
            err: Any = caught.value
            assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, (what, err.details()[:200])
            assert len(err.details()) < MESSAGE_LIMIT, (what, len(err.details()))
        assert not stub.Exists(pb.ExistsRequest(keys=[b"k"])).exists[0]
