"""The client's transfer threads are not confined to the cores of the thread that started them
(an engine's model thread, which vLLM on CPU binds to its cores): kvstore.client.cpus."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest

from kvstore.client.cpus import allowed_cpus, parse_cpu_list

torch = pytest.importorskip("torch")

from kvstore.client.kv_client import KVClient, KVClientConfig  # noqa: E402
from kvstore.client.kvlayout import KVLayout, namespace_for  # noqa: E402
from kvstore.client.layouts import ContiguousKV  # noqa: E402
from kvstore.client.requests import LoadRequest  # noqa: E402
from kvstore.client.store_client import DataPlane, StoreClient, StoreClientConfig  # noqa: E402
from tests.support.daemon import DaemonProcess  # noqa: E402

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_tokens=16,
                  dtype=torch.float32)


def test_cpu_lists_parse_as_the_kernel_writes_them() -> None:
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("5") == {5}
    with pytest.raises(ValueError):
        parse_cpu_list("3-1")
    with pytest.raises(ValueError):
        parse_cpu_list("a")


def test_allowed_cpus_include_every_cpu_this_process_may_use() -> None:
    assert os.sched_getaffinity(0) <= allowed_cpus()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("cpus"), "node-cpus", dram_bytes="4MiB",
                      nvme=False)
    d.start()
    yield d
    d.stop()


def _pool_affinity_after_a_load_from_a_pinned_thread(daemon: DaemonProcess, widen: bool
                                                      ) -> list[set[int]]:
    """Start the client's pool from a thread bound to one CPU, as vLLM's model thread is."""
    sc = StoreClient.connect(daemon.grpc_address, StoreClientConfig(data_plane=DataPlane.SHM))
    client = KVClient(sc, LAYOUT, namespace_for(LAYOUT, "m", f"cpus-{widen}"),
                      KVClientConfig(data_plane=DataPlane.SHM, workers=2,
                                     widen_thread_affinity=widen))
    one_cpu = {min(os.sched_getaffinity(0))}
    seen: list[set[int]] = []

    def engine_thread() -> None:
        os.sched_setaffinity(0, one_cpu)
        try:
            os.sched_setaffinity(0, one_cpu)
            requests = [LoadRequest(list(range(first, first + 2 * LAYOUT.block_tokens)),
                                    ContiguousKV(torch.zeros(
                                        LAYOUT.num_layers, 2, LAYOUT.num_kv_heads,
                                        2 * LAYOUT.block_tokens, LAYOUT.head_dim), LAYOUT))
                        for first in (0, 100)]  # nothing stored: the loads run and miss
            for handle in client.load_many(requests):
                handle.result(timeout_s=60)
            seen.extend(os.sched_getaffinity(t.native_id) for t in threading.enumerate()
                        if t.name.startswith("kvclient") and t.native_id is not None)
        except BaseException as exc:
            errors.append(exc)

    errors: list[BaseException] = []
    try:
        worker = threading.Thread(target=engine_thread)
        worker.start()
        worker.join()
    finally:
        client.close()
    if errors:
        raise errors[0]
    assert seen, "the load ran on no pool thread"
    return seen


def test_pool_threads_leave_the_engine_thread_s_cores(daemon: DaemonProcess) -> None:
    if len(allowed_cpus() & os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    one_cpu = {min(os.sched_getaffinity(0))}
    widened = _pool_affinity_after_a_load_from_a_pinned_thread(daemon, widen=True)
    assert all(cpus > one_cpu for cpus in widened), widened
    inherited = _pool_affinity_after_a_load_from_a_pinned_thread(daemon, widen=False)
    assert all(cpus == one_cpu for cpus in inherited), inherited
