"""Following one vLLM engine's KV cache events over ZMQ into an :class:`EngineCacheView`.

Per engine record with ``vllm_kv_events`` the conductor runs one :class:`EngineEventFollower`
(an asyncio task): a SUB socket connected to the engine's publisher (subscribed to its topic)
and, whenever the view needs one, a replay over a fresh DEALER socket to the engine's ROUTER:
send ``[b"", start_seq as 8 bytes big-endian]``, receive ``[b"", topic, seq, payload]`` for each
buffered batch from ``start_seq`` on, then an end marker with seq -1 (vLLM's
``ZmqEventPublisher._service_replay``). A fresh socket per replay means a late answer to a
replay that timed out can never be read as the answer to the next one.

A new view asks for a replay from seq 0 at once: a conductor that starts (or an engine followed
late) learns what the engine cached before it subscribed, as far back as the engine's replay
buffer (``buffer_steps``, 10,000 batches by default) reaches. PUB/SUB drops what is published
before the subscription reaches the publisher (ZMQ's slow joiner) and what overflows its high
water mark; both show up as a gap in the seq and are repaired by the same replay. The pure
state machine (what a seq means) is :mod:`conductor.engine_index`.

No liveness here: a dead engine is noticed when its etcd record goes (its lease expires), and
the conductor then cancels the follower and drops the view.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

import zmq
import zmq.asyncio

from conductor.engine_index import (
    EngineCacheIndex,
    EngineCacheView,
    EngineEventError,
    decode_batch,
)
from kvstore.membership.engines import VllmKvEvents

log = logging.getLogger(__name__)

__all__ = ["EngineEventFollower", "EngineFollowers"]

_END_SEQ = -1
_RECV_POLL_S = 0.5
"""How long a receive waits before the loop checks whether a replay is still owed."""
_RETRY_S = 0.5


def _seq(frame: bytes, signed: bool = False) -> int:
    if len(frame) != 8:
        raise EngineEventError(f"a KV event seq frame is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=signed)


class EngineEventFollower:
    """One engine's events into its view (see the module docstring). Asyncio; one task."""

    def __init__(self, index: EngineCacheIndex, view: EngineCacheView, context: zmq.asyncio.Context,
                 *, replay_timeout_s: float = 2.0) -> None:
        """Record settings only: no sockets until :meth:`run`."""
        self.index = index
        self.view = view
        self._context = context
        self._replay_timeout_s = replay_timeout_s
        self._topic = view.spec.topic.encode()
        self.drop_live_batches = 0
        """Test hook: drop this many of the next live batches, as a lost message would (the
        next one then opens a gap that a replay must repair)."""
        self.replays = 0
        self.replay_failures = 0

    async def run(self) -> None:
        """Follow until cancelled."""
        spec = self.view.spec
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        sub.setsockopt(zmq.RCVHWM, 0)
        try:
            sub.connect(spec.endpoint)
            log.info("engine %s: following KV events at %s (replay %s)", self.view.instance_id,
                     spec.endpoint, spec.replay_endpoint)
            while True:
                if self.view.replay_from is not None:
                    await self._replay()
                if not await sub.poll(int(_RECV_POLL_S * 1000)):
                    continue
                frames = await sub.recv_multipart()
                self._on_live(frames)
        finally:
            sub.close(linger=0)

    def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[0] != self._topic:
            log.warning("engine %s: ignoring a KV event message of %d frames (topic %r)",
                        self.view.instance_id, len(frames), frames[0][:64] if frames else b"")
            return
        try:
            seq = _seq(frames[1])
        except EngineEventError as exc:
            log.warning("engine %s: %s", self.view.instance_id, exc)
            return
        if self.drop_live_batches > 0:
            self.drop_live_batches -= 1
            log.info("engine %s: dropping live KV event batch %d (test hook)",
                     self.view.instance_id, seq)
            return
        try:
            batch = decode_batch(seq, frames[2])
        except EngineEventError as exc:
            self.index.malformed(self.view, seq, str(exc))
            return
        self.index.on_live(self.view, batch)

    async def _replay(self) -> None:
        """Ask for every buffered batch from ``view.replay_from``; apply them in order."""
        view = self.view
        endpoint = view.spec.replay_endpoint
        start = view.replay_from
        if start is None:
            return
        if endpoint is None:
            self.index.no_replay(view)
            return
        self.replays += 1
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(int(self._replay_timeout_s * 1000)):
                    raise TimeoutError(f"no answer within {self._replay_timeout_s} s")
                frames = await dealer.recv_multipart()
                if len(frames) != 4:
                    raise EngineEventError(f"a replay answer of {len(frames)} frames")
                _, topic, seq_frame, payload = frames
                seq = _seq(seq_frame, signed=True)
                if seq == _END_SEQ:
                    break
                if topic != self._topic:
                    continue
                try:
                    batch = decode_batch(seq, payload)
                except EngineEventError as exc:
                    self.index.malformed(view, seq, str(exc))
                    return
                self.index.on_replayed(view, batch)
            if self.index.replay_done(view):
                log.info("engine %s: replayed KV events from seq %d; next %d", view.instance_id,
                         start, view.expected)
        except (TimeoutError, EngineEventError, zmq.ZMQError) as exc:
            self.replay_failures += 1
            log.warning("engine %s: replay from seq %d at %s failed (%s); retrying",
                        view.instance_id, start, endpoint, exc)
            await asyncio.sleep(_RETRY_S)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                dealer.close(linger=0)


class EngineFollowers:
    """The followers of a set of engine records: one :class:`EngineEventFollower` task per
    record that describes a KV-event publisher, a fresh one when its description or its etcd
    registration changed, none for records that left (their views leave ``index``). The
    conductor and the front door's in-process router each keep one. Asyncio; one ZMQ context,
    made when the first follower starts."""

    def __init__(self, index: EngineCacheIndex, task_prefix: str) -> None:
        self.index = index
        self._task_prefix = task_prefix
        self.followers: dict[str, tuple[EngineEventFollower, asyncio.Task[None]]] = {}
        """Instance id -> its follower and the task running it."""
        self._zmq: zmq.asyncio.Context | None = None
        self._closed = False

    def sync(self, wanted: Mapping[str, tuple[VllmKvEvents, int]]) -> list[str]:
        """Follow exactly ``wanted`` (instance id -> (its record's ``vllm_kv_events``, the
        record's create revision)); the ids whose view was dropped (their record is gone).
        Call on the event loop; after :meth:`close` nothing new starts."""
        dropped = []
        for instance_id, (follower, task) in list(self.followers.items()):
            want = wanted.get(instance_id)
            if want == (follower.view.spec, follower.view.generation):
                continue
            task.cancel()
            del self.followers[instance_id]
            if want is None:
                self.index.remove(instance_id)
                dropped.append(instance_id)
        if self._closed:
            return dropped
        loop = asyncio.get_running_loop()
        for instance_id, (spec, generation) in wanted.items():
            if instance_id in self.followers:
                continue
            if self._zmq is None:
                self._zmq = zmq.asyncio.Context()
            view = self.index.track(instance_id, spec, generation)
            follower = EngineEventFollower(self.index, view, self._zmq)
            task = loop.create_task(follower.run(), name=f"{self._task_prefix}-{instance_id}")
            task.add_done_callback(_follower_ended)
            self.followers[instance_id] = (follower, task)
        return dropped

    def tasks(self) -> list[asyncio.Task[None]]:
        return [task for _, task in self.followers.values()]

    def close(self) -> list[asyncio.Task[None]]:
        """Cancel every follower (nothing new starts after this); the tasks, for the caller
        to await before :meth:`destroy`."""
        self._closed = True
        tasks = self.tasks()
        self.followers = {}
        for task in tasks:
            task.cancel()
        return tasks

    def destroy(self) -> None:
        """Close the ZMQ context (after the tasks of :meth:`close` ended). Idempotent."""
        if self._zmq is not None:
            self._zmq.destroy(linger=0)
            self._zmq = None


def _follower_ended(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s stopped: %r; that engine's cache view no longer changes",
                  task.get_name(), task.exception(), exc_info=task.exception())
