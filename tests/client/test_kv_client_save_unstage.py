"""A one-copy save whose first layers were staged (handed over while the daemon could not
answer the reservation) and the rest written straight into the arena: the staged layers are
moved into the reserved chunks per run of chunks and range of staged layers (issue 13), and
every block lands byte for byte, for requests sharing the step, whatever layers were staged."""

from __future__ import annotations

import os
import signal

import pytest

torch = pytest.importorskip("torch")

from kvstore.client.handles import DirectBatchSave  # noqa: E402
from kvstore.client.requests import SaveRequest  # noqa: E402
from kvstore.integrations.vllm.layout import engine_kv_for  # noqa: E402
from tests.client.test_kv_client_save_direct import (  # noqa: E402
    LAYOUT,
    B,
    client_for,
    daemon,
    loaded,
    no_leases,
    same_blocks,
    tokens,
    vllm_caches,
)
from tests.support.daemon import DaemonProcess  # noqa: E402

__all__ = ["daemon"]  # the module-scoped fixture, shared


@pytest.mark.parametrize("staged", [(0, 2), (1,), (0, 1)])
def test_staged_and_direct_layers_of_one_step_land_whole(daemon: DaemonProcess,
                                                         staged: tuple[int, ...]) -> None:
    src = vllm_caches("layer-major", seed=90 + len(staged))
    toks = [tokens(4 * B, seed=91 + staged[0]), tokens(3 * B, seed=95 + staged[-1])]
    ids = [[7, 2, 15, 9], [0, 21, 4]]
    expected = [t.clone() for t in src]
    with client_for(daemon, f"unstage-{'-'.join(map(str, staged))}") as client:
        client.store.stats()  # connected before the stop
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            saver = client.begin_save_many([
                SaveRequest(t, engine_kv_for(src, i, LAYOUT))
                for t, i in zip(toks, ids, strict=True)])
            assert isinstance(saver, DirectBatchSave)
            for layer in staged:
                saver.save_layer(layer).result(30)  # into staging rows: no reservation yet
            assert not saver.reservation.done()
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        saver.reservation.result(30)
        for layer in range(LAYOUT.num_layers):
            if layer not in staged:
                saver.save_layer(layer).result(30)  # straight into the arena
        results = saver.finish().result(30)
        assert [r.stored_blocks for r in results] == [(0, 1, 2, 3), (0, 1, 2)]
        for t, i in zip(toks, ids, strict=True):
            assert same_blocks(loaded(client, t, range(len(i))), range(len(i)), expected, i)
        no_leases(client)
