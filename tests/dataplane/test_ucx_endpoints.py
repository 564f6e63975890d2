"""The UCX data plane's endpoints, counted in Stats (``ucx_endpoints_open``) and bounded by
``server.max_connections`` as the TCP plane's connections are, against real daemon processes
and real ``ucxx`` clients (docs/transport.md, "UCX endpoints").

* A client process SIGKILLed while one lane is mid-GET (the server's send posted, never
  received), another idle and two more looping gets: the daemon counted its endpoints, and
  after the kill the count returns to what it was before (the mid-GET one cut after
  ``server.ucx_io_timeout_s``, the idle ones after ``server.idle_timeout_s``), the chunk's read
  lease is gone (it can be removed) and a fresh client reads a value byte for byte.
* A flood of client lanes up to the bound is served; one more is refused with CapacityError
  naming the limit (its refusal endpoint closed afterwards: the count is the bound again), and
  once the flood leaves (BYE) a well-behaved client is served, its bytes exact.

Skipped, with the reason, when ``ucxx`` does not import.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client.store_client import DataPlane, StoreClient, StoreClientConfig
from kvstore.dataplane.transport.ucx import UcxClient, ucx_unavailable
from kvstore.errors import CapacityError
from tests.support.common import payload, wait_until
from tests.support.daemon import REPO, DaemonProcess

_REASON = ucx_unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"UCX transport: {_REASON}")

MiB = 1 << 20
HELD_BYTES = 32 * MiB
LOOP_BYTES = 4 * MiB

_CHILD = """
import sys, threading, time
from kvstore.dataplane.transport import ucx
address, held_key, held_size = bytes.fromhex(sys.argv[1]), sys.argv[2].encode(), int(sys.argv[3])
loop_key, loop_size = sys.argv[4].encode(), int(sys.argv[5])
idle = ucx.UcxClient(address, lanes=1)
assert idle.exists(loop_key)  # introduced, then silent until killed
held = ucx.UcxClient(address, lanes=1)
lane_cm = held._lane()
lane = lane_cm.__enter__()
lane.call(ucx.Op.GET, held_key, held_size)  # the server sends; nobody posts the receive
loops = ucx.UcxClient(address, lanes=2)
def loop():
    buf = bytearray(loop_size)
    while True:
        loops.get_into(loop_key, buf)
for _ in range(2):
    threading.Thread(target=loop, daemon=True).start()
time.sleep(0.2)
print("READY", flush=True)
time.sleep(600)
"""


def _endpoints(control: StoreClient) -> int:
    return int(control.stats().ucx_endpoints_open)


@pytest.fixture
def reaping_daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path, "ucx-reap", nvme=False, dram_bytes="128MiB", settings={
        "server.ucx": "required", "server.ucx_io_timeout_s": "2",
        "server.idle_timeout_s": "2", "server.shm_channel": "false"})
    d.start()
    yield d
    d.stop()


def test_a_client_killed_mid_get_leaves_no_ucx_endpoint(reaping_daemon: DaemonProcess) -> None:
    address = bytes.fromhex(str(reaping_daemon.addresses["ucx_address"]))
    control = StoreClient.connect(reaping_daemon.grpc_address,
                                  StoreClientConfig(data_plane=DataPlane.TCP))
    child: subprocess.Popen[str] | None = None
    try:
        held_key, loop_key = b"held-32MiB", b"loop-4MiB"
        control.put(held_key, payload(HELD_BYTES, 1))
        control.put(loop_key, payload(LOOP_BYTES, 2))
        before = _endpoints(control)
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, address.hex(), held_key.decode(), str(HELD_BYTES),
             loop_key.decode(), str(LOOP_BYTES)], stdout=subprocess.PIPE, text=True, cwd=REPO)
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "READY"
        # idle + held + two loop lanes (the loops' second lane may still be saying HELLO)
        wait_until(lambda: _endpoints(control) >= before + 3, timeout_s=30,
                   what="the child's endpoints to be counted")
        child.kill()
        child.wait(30)
        wait_until(lambda: _endpoints(control) == before, timeout_s=60,
                   what="the killed client's UCX endpoints to be closed")
        wait_until(lambda: control.remove(held_key), timeout_s=30,
                   what="the held GET's read lease to be released")
        with UcxClient(address) as fresh:
            out = bytearray(LOOP_BYTES)
            assert fresh.get_into(loop_key, out) == LOOP_BYTES
            assert out == payload(LOOP_BYTES, 2)
            assert _endpoints(control) == before + 1
        wait_until(lambda: _endpoints(control) == before, timeout_s=30,
                   what="a closed client's endpoint to end with its BYE")
    finally:
        if child is not None:
            child.kill()
            child.wait(30)
        control.close()


def test_a_flood_past_max_connections_is_refused_and_a_client_is_served_after(
        tmp_path: Path) -> None:
    bound = 8
    daemon = DaemonProcess(tmp_path, "ucx-flood", nvme=False, settings={
        "server.ucx": "required", "server.max_connections": str(bound),
        "server.shm_channel": "false"})
    daemon.start()
    address = bytes.fromhex(str(daemon.addresses["ucx_address"]))
    control = StoreClient.connect(daemon.grpc_address, StoreClientConfig(data_plane=DataPlane.TCP))
    flood: list[UcxClient] = []
    try:
        assert _endpoints(control) == 0
        for _ in range(bound):
            c = UcxClient(address, lanes=1, io_timeout_s=10)
            flood.append(c)
            assert not c.exists(b"nothing-here")  # served: one endpoint each
        assert _endpoints(control) == bound
        extra = UcxClient(address, lanes=1, io_timeout_s=10)
        try:
            with pytest.raises(CapacityError, match=rf"limit of {bound} UCX endpoints "
                                                    r"\(max_connections\)"):
                extra.exists(b"nothing-here")
        finally:
            extra.close()
        wait_until(lambda: _endpoints(control) == bound, timeout_s=30,
                   what="the refusal's endpoint to be closed")
        for c in flood:
            c.close()
        wait_until(lambda: _endpoints(control) == 0, timeout_s=30,
                   what="the flood's endpoints to end with their BYE")
        value = payload(3 * MiB, 7)
        with UcxClient(address, lanes=1, io_timeout_s=10) as served:
            served.put(b"after-the-flood", value)
            assert served.get(b"after-the-flood") == value
        assert "refusing UCX client" in daemon.log_path.read_text()
    finally:
        for c in flood:
            c.close()
        control.close()
        daemon.stop()
