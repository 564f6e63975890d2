"""What each vLLM engine holds in its own prefix cache, learned from vLLM's KV cache events.

vLLM (``KVEventsConfig``, ZMQ publisher) sends one numbered batch per engine step that changed
its prefix cache: ``[topic, seq (8-byte big-endian, from 0), msgpack [ts, events, dp_rank]]``,
each event a map with ``"type"``: ``BlockStored`` (``block_hashes``, ``parent_block_hash``,
``token_ids``, ``block_size``, ``extra_keys``, ``medium``, ``group_idx``...), ``BlockRemoved``
(``block_hashes``) or ``AllBlocksCleared``. A block hash is vLLM's chained ``sha256_cbor`` digest
(32 bytes) or, by default, its last 8 bytes as an unsigned int. This module is the pure part:
decoding, the per-instance state machine over sequence numbers, matching a prompt's hashes, and
checking that the conductor's hashes agree with the engine's. The sockets are in
:mod:`conductor.engine_events`.

Sequence numbers (:class:`EngineCacheView`), per instance; ``expected`` is the next seq to apply
(0 for a fresh view):

=============================  ================================================================
live batch ``seq == expected``  applied, then any buffered successors in order
live ``seq > expected``         a **gap**: buffered (never applied out of order: a block removed
                                in a missing batch would come back), and a replay from
                                ``expected`` is needed (:attr:`EngineCacheView.replay_from`)
live ``seq < expected``         a duplicate of a batch a replay just delivered (only within that
                                window), otherwise the publisher **restarted** (its seq counts
                                from 0 again): the view is reset, and a seq > 0 is a gap from 0
replayed ``seq < expected``     duplicate, ignored
replayed ``seq > expected``     the engine's replay buffer no longer reaches back: the view is
                                reset and followed from there (``unrecoverable_gaps``): what it
                                then holds is a subset of the truth (it may miss blocks stored
                                earlier, never keeps one removed since)
=============================  ================================================================

``AllBlocksCleared`` empties the view; so does a new registration of the instance (its etcd
lease changed: :meth:`EngineCacheIndex.track` with a new ``generation``). A view never holds more
blocks than the engine's KV cache has (``num_blocks`` of its record, else
:data:`DEFAULT_MAX_BLOCKS`): more means removals were missed, and the view is reset
(``overflows``). Buffered batches are bounded by :data:`MAX_PENDING_BATCHES` likewise.

Only KV cache group 0 (full attention) and the engine's own ``GPU`` medium are tracked (on CPU
vLLM also says ``GPU``); events of other groups or media (an offloading tier) are counted in
``ignored_events`` and not applied.

Mismatch detection: a record whose ``hash_algo`` is not ``sha256_cbor`` is a mismatch at once.
Otherwise every ``BlockStored`` whose first block can be recomputed (its parent is known as a
full digest, or it starts a sequence; no LoRA or multimodal keys) is re-hashed from its token
ids with the conductor's hasher and compared (``verified_blocks`` / ``hash_mismatches``); and
the last new block of every prompt the conductor routed to the instance is expected to appear
in its events (``probes``): :data:`MISMATCH_PROBES` routed prompts with none seen means the
conductor's token ids or hashes are not the engine's. A mismatch is logged at ERROR once per
view, counted, and makes the view match nothing (a wrong match would misroute).

Thread safety: :class:`EngineCacheIndex` takes its own lock around every use of its views (the
RPC threads match while the event loop applies batches; a prompt is hashed outside the lock);
:class:`EngineCacheView` is not thread-safe alone.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NewType, cast

import msgspec
import numpy as np
import numpy.typing as npt
import xxhash

from kvstore.errors import InvalidArgument
from kvstore.keys import BlockHasher, HashMode, KVDtype, KVFingerprint, Namespace, PrefixKey
from kvstore.membership.engines import VllmKvEvents

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_BLOCKS", "MAX_PENDING_BATCHES", "MISMATCH_PROBES", "ChainMemo", "EngineBatch",
           "EngineCacheIndex", "EngineCacheStats", "EngineCacheView", "LiveOutcome", "PromptMatch",
           "TokenIds", "VllmBlockHashes", "VllmHash", "decode_batch"]

TokenIds = Sequence[int] | npt.NDArray[np.uint32]
"""A prompt's token ids: a sequence, or a numpy array (as the RPC handlers make them)."""

VllmHash = NewType("VllmHash", object)
"""One vLLM block hash as the engine's events carry it: ``int`` (last 8 bytes) or 32 ``bytes``."""

DEFAULT_MAX_BLOCKS = 1 << 20
"""The bound of a view whose record does not say how many blocks the engine's KV cache has."""
MAX_PENDING_BATCHES = 4096
"""Live batches buffered behind a gap while the replay runs; more: reset."""
MISMATCH_PROBES = 32
"""Routed prompts whose expected block never appeared in the engine's events, with none ever
seen, that make a mismatch."""
_PROBES_KEPT = 256
_SUPPORTED_ALGO = "sha256_cbor"
_VLLM_DIGEST_BYTES = 32
_NS_PREFIX_BYTES = 16
_KEY_WORDS = (_NS_PREFIX_BYTES + _VLLM_DIGEST_BYTES) // 8
"""A SHA256_CBOR store key (namespace prefix + vLLM digest) in 8-byte words."""
_HASHERS_KEPT = 256


class EngineEventError(InvalidArgument):
    """A batch that does not decode as vLLM's KV event batch."""


@dataclass(frozen=True, slots=True)
class StoredEvent:
    hashes: tuple[VllmHash, ...]
    parent: VllmHash | None
    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: tuple[Any, ...] | None
    tracked: bool


@dataclass(frozen=True, slots=True)
class RemovedEvent:
    hashes: tuple[VllmHash, ...]
    tracked: bool


@dataclass(frozen=True, slots=True)
class ClearedEvent:
    pass


Event = StoredEvent | RemovedEvent | ClearedEvent


@dataclass(frozen=True, slots=True)
class EngineBatch:
    """One decoded batch: its seq and its events, in order."""

    seq: int
    events: tuple[Event, ...]


_decoder = msgspec.msgpack.Decoder()


def _hash(value: Any, what: str) -> VllmHash:
    if isinstance(value, bool) or not isinstance(value, int | bytes):
        raise EngineEventError(f"{what} must be an int or bytes, got {type(value).__name__}")
    return VllmHash(value)


def _tracked(event: dict[str, Any]) -> bool:
    group = event.get("group_idx")
    medium = event.get("medium")
    return group in (None, 0) and medium in (None, "GPU")


def decode_batch(seq: int, payload: bytes) -> EngineBatch:
    """Decode one batch's msgpack payload (``[ts, events, dp_rank]``). EngineEventError for
    anything that is not vLLM's format; events of unknown types are skipped (a newer vLLM)."""
    try:
        doc = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise EngineEventError(f"batch {seq}: not msgpack: {exc}") from exc
    if not isinstance(doc, list) or len(doc) < 2 or not isinstance(doc[1], list):
        raise EngineEventError(f"batch {seq}: expected [ts, events, dp_rank], got {doc!r:.200}")
    out: list[Event] = []
    for raw in doc[1]:
        if not isinstance(raw, dict):
            raise EngineEventError(f"batch {seq}: an event is not a map: {raw!r:.200}")
        kind = raw.get("type")
        try:
            if kind == "BlockStored":
                extra = raw.get("extra_keys")
                out.append(StoredEvent(
                    tuple(_hash(h, "block hash") for h in raw["block_hashes"]),
                    None if raw.get("parent_block_hash") is None
                    else _hash(raw["parent_block_hash"], "parent_block_hash"),
                    tuple(raw["token_ids"]), int(raw["block_size"]),
                    None if extra is None else tuple(extra), _tracked(raw)))
            elif kind == "BlockRemoved":
                out.append(RemovedEvent(tuple(_hash(h, "block hash") for h in raw["block_hashes"]),
                                        _tracked(raw)))
            elif kind == "AllBlocksCleared":
                out.append(ClearedEvent())
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, EngineEventError):
                raise
            raise EngineEventError(f"batch {seq}: malformed {kind} event: {exc!r}") from exc
    return EngineBatch(seq, tuple(out))


class VllmBlockHashes:
    """vLLM's block hashes of token ids, as one engine's events carry them (int or digest).

    ``sha256_cbor`` with the engine's block size and seed; a non-empty ``tenant`` is vLLM's
    ``cache_salt`` (kvstore.keys, SHA256_CBOR mode). Immutable; any thread may use it.
    """

    __slots__ = ("_as_int", "_hasher")

    def __init__(self, spec: VllmKvEvents, tenant: str = "") -> None:
        if spec.hash_algo != _SUPPORTED_ALGO:
            raise InvalidArgument(
                f"cannot compute vLLM {spec.hash_algo!r} block hashes: only {_SUPPORTED_ALGO!r}")
        # The namespace prefix of the store keys is cut off below: only the vLLM hash remains,
        # so the fingerprint's fields other than the block size do not matter.
        fingerprint = KVFingerprint("vllm-events", KVDtype.FLOAT16, 1, 1, 1,
                                    block_size_tokens=spec.block_size_tokens)
        self._hasher = BlockHasher(Namespace(fingerprint, tenant), mode=HashMode.SHA256_CBOR,
                                   vllm_hash_seed=spec.hash_seed)
        self._as_int = spec.int_block_hashes

    @property
    def block_size_tokens(self) -> int:
        return self._hasher.block_size_tokens

    def _convert(self, keys: Sequence[PrefixKey]) -> list[VllmHash]:
        if self._as_int:
            # The last 8 bytes of each 48-byte key as a big-endian int, for all keys in one
            # numpy pass: a few microseconds where int.from_bytes per key costs ~0.4 us each.
            words = np.frombuffer(b"".join(keys), dtype=">u8").reshape(len(keys), _KEY_WORDS)
            return cast("list[VllmHash]", words[:, -1].tolist())
        return [VllmHash(k[_NS_PREFIX_BYTES:]) for k in keys]

    def keys(self, token_ids: npt.NDArray[np.uint32], parent: PrefixKey | None = None
             ) -> list[PrefixKey]:
        """The store keys (namespace prefix + vLLM digest) of the full blocks of ``token_ids``,
        after the block whose key is ``parent`` (None: they start the prompt)."""
        return self._hasher.hash_blocks(token_ids, parent=parent)

    def convert(self, keys: Sequence[PrefixKey]) -> list[VllmHash]:
        """Store keys of :meth:`keys` as the engine's events carry the hashes."""
        return self._convert(keys)

    def hashes(self, token_ids: TokenIds) -> list[VllmHash]:
        """One hash per full block of ``token_ids`` (vLLM's ``maybe_convert_block_hash``)."""
        # A list, tuple or numpy array is hashed as it is (a list copy of thousands of ids
        # costs more than the hashing's own setup); any other sequence is copied once.
        tokens = token_ids if isinstance(token_ids, list | tuple | np.ndarray) \
            else list(token_ids)
        return self._convert(self._hasher.hash_blocks(tokens))

    def recompute(self, event: StoredEvent) -> VllmHash | None:
        """The first block's hash of ``event`` recomputed here, or None when it cannot be
        (its parent is an int, or it has LoRA or multimodal keys)."""
        if not event.hashes or len(event.token_ids) < event.block_size \
                or event.block_size != self.block_size_tokens:
            return None
        first_extra = event.extra_keys[0] if event.extra_keys else None
        tokens = list(event.token_ids[: event.block_size])
        if event.parent is None:
            salt = ""
            if first_extra is not None:
                if len(first_extra) != 1 or not isinstance(first_extra[0], str):
                    return None
                salt = first_extra[0]
            if salt != self._hasher.namespace.tenant:
                return None  # another tenant's sequence: its own hasher would be needed
            return self.hashes(tokens)[0]
        if first_extra is not None or not isinstance(event.parent, bytes) \
                or len(event.parent) != _VLLM_DIGEST_BYTES:
            return None
        parent = PrefixKey(self._hasher.namespace.key_prefix() + event.parent)
        return self._convert(self._hasher.hash_blocks(tokens, parent=parent))[0]


@dataclass(slots=True)
class EngineCacheStats:
    """Counters of one instance's view (since the conductor started following it)."""

    instance_id: str = ""
    blocks: int = 0
    """Blocks the view holds now."""
    expected_seq: int = 0
    batches: int = 0
    """Batches applied (live or replayed)."""
    events: int = 0
    gaps: int = 0
    """Gaps seen (a live seq beyond the next expected one)."""
    gaps_repaired: int = 0
    """Gaps closed by a replay."""
    replayed_batches: int = 0
    unrecoverable_gaps: int = 0
    """Replays that could not reach back (the engine's buffer had moved on): view reset."""
    resets: int = 0
    """Views emptied: AllBlocksCleared, the publisher restarted, a new registration, overflow."""
    restarts: int = 0
    cleared: int = 0
    overflows: int = 0
    ignored_events: int = 0
    malformed_batches: int = 0
    verified_blocks: int = 0
    hash_mismatches: int = 0
    """Events whose recomputed hash differed, plus a record with an unusable hash algorithm."""
    probes: int = 0
    probes_matched: int = 0
    mismatch: str = ""
    """Why the view matches nothing ('' when it is fine)."""

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class LiveOutcome(enum.Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"
    GAP = "gap"
    """Buffered; a replay from :attr:`EngineCacheView.replay_from` is needed."""
    RESTART = "restart"
    """The publisher restarted: the view was reset (and the batch applied, or buffered)."""


class EngineCacheView:
    """One instance's prefix cache as its events tell it (see the module docstring)."""

    def __init__(self, instance_id: str, spec: VllmKvEvents, generation: int = 0) -> None:
        self.instance_id = instance_id
        self.spec = spec
        self.generation = generation
        self.max_blocks = spec.num_blocks or DEFAULT_MAX_BLOCKS
        self.stats = EngineCacheStats(instance_id=instance_id)
        self._blocks: dict[VllmHash, None] = {}
        self._pending: dict[int, EngineBatch] = {}
        self._gap_open = False
        self._replayed_to = -1
        """Highest seq applied from a replay whose live copy may still arrive (-1: none)."""
        self.expected = 0
        self.replay_from: int | None = 0
        """Set when a replay is needed (a fresh view asks for everything buffered)."""
        self._probes: dict[VllmHash, None] = {}
        self._salted: dict[str, VllmBlockHashes] = {}
        self.hashes: VllmBlockHashes | None = None
        if spec.hash_algo != _SUPPORTED_ALGO:
            self._mismatch(f"its hash algorithm is {spec.hash_algo!r}; the conductor computes "
                           f"only {_SUPPORTED_ALGO!r} (run vLLM with --prefix-caching-hash-algo "
                           f"{_SUPPORTED_ALGO})")
        else:
            self.hashes = VllmBlockHashes(spec)

    # -- reading -----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def cached_blocks(self, hashes: Sequence[VllmHash]) -> int:
        """Leading blocks of ``hashes`` the engine holds (0 while the view is mismatched)."""
        if self.stats.mismatch:
            return 0
        blocks = self._blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    # -- sequence numbers ----------------------------------------------------------------

    def on_live(self, batch: EngineBatch) -> LiveOutcome:
        """A batch from the PUB socket."""
        seq = batch.seq
        if seq == self.expected:
            self._apply(batch)
            if seq > self._replayed_to:
                self._replayed_to = -1
            self._drain()
            return LiveOutcome.APPLIED
        if seq > self.expected:
            if self.replay_from is None:
                self._open_gap(self.expected)
            self._buffer(batch)
            return LiveOutcome.GAP
        if seq <= self._replayed_to:
            return LiveOutcome.DUPLICATE
        # Live batches never repeat: a smaller seq is a new publisher counting from 0 again.
        log.warning("engine %s: KV event seq went back from %d to %d: the engine restarted; "
                    "its view starts over", self.instance_id, self.expected - 1, seq)
        self.stats.restarts += 1
        self.reset()
        self.replay_from = None
        if seq == 0:
            self._apply(batch)
            self._drain()
        else:
            self._open_gap(0)
            self._buffer(batch)
        return LiveOutcome.RESTART

    def _open_gap(self, replay_from: int) -> None:
        self.stats.gaps += 1
        self._gap_open = True
        self.replay_from = replay_from

    def on_replayed(self, batch: EngineBatch) -> None:
        """A batch answered by the replay socket (in seq order, up to the end marker)."""
        seq = batch.seq
        # Its live copy may still be on its way (published before we subscribed again, or
        # while the replay ran): a live seq up to here is a duplicate, not a restart.
        self._replayed_to = max(self._replayed_to, seq)
        if seq < self.expected:
            return
        self.stats.replayed_batches += 1
        if seq > self.expected:
            log.warning("engine %s: replay starts at seq %d, not %d (the engine's buffer moved "
                        "on): following from there with a view reset", self.instance_id, seq,
                        self.expected)
            self.stats.unrecoverable_gaps += 1
            self._clear_blocks()
            self.stats.resets += 1
            self._gap_open = False
            self.expected = seq
            self._pending = {s: b for s, b in self._pending.items() if s > seq}
        self._apply(batch)
        self._drain()

    def replay_done(self) -> bool:
        """The replay's end marker came. True when no gap is left open (else ``replay_from``
        says where to replay from again)."""
        self._pending = {s: b for s, b in self._pending.items() if s >= self.expected}
        self._drain()
        if self._pending:
            self.replay_from = self.expected
            return False
        if self._gap_open:
            self.stats.gaps_repaired += 1
            self._gap_open = False
        self.replay_from = None
        return True

    def no_replay(self) -> None:
        """The engine has no replay socket (or it does not answer): give up on the gap and
        follow from the oldest buffered batch with a view reset (a subset of the truth)."""
        self.replay_from = None
        if not self._pending:
            return
        self.stats.unrecoverable_gaps += 1
        self._clear_blocks()
        self.stats.resets += 1
        self._gap_open = False
        self.expected = min(self._pending)
        self._drain()

    def reset(self) -> None:
        """Start over from empty: the engine's cache is unknown (a restart, a new lease)."""
        self._clear_blocks()
        self._pending.clear()
        self._replayed_to = -1
        self._gap_open = False
        self.expected = 0
        self.replay_from = 0
        self.stats.resets += 1

    def malformed(self, seq: int, why: str) -> None:
        """A batch that did not decode: skipping it would hide its changes, so start over."""
        log.warning("engine %s: malformed KV event batch %d (%s): view reset", self.instance_id,
                    seq, why)
        self.stats.malformed_batches += 1
        self.reset()

    def _buffer(self, batch: EngineBatch) -> None:
        if len(self._pending) >= MAX_PENDING_BATCHES:
            log.warning("engine %s: %d KV event batches buffered behind a gap at %d: following "
                        "from %d with a view reset", self.instance_id, len(self._pending),
                        self.expected, batch.seq)
            self.stats.unrecoverable_gaps += 1
            self._clear_blocks()
            self.stats.resets += 1
            self._pending.clear()
            self._gap_open = False
            self.expected = batch.seq
            self._apply(batch)
            self.replay_from = None
            return
        self._pending[batch.seq] = batch

    def _drain(self) -> None:
        pending = self._pending
        while pending:
            batch = pending.pop(self.expected, None)
            if batch is None:
                break
            self._apply(batch)

    # -- events ---------------------------------------------------------------------------

    def _apply(self, batch: EngineBatch) -> None:
        stats = self.stats
        stats.batches += 1
        stats.events += len(batch.events)
        self.expected = batch.seq + 1
        blocks = self._blocks
        for event in batch.events:
            if isinstance(event, StoredEvent):
                if not event.tracked:
                    stats.ignored_events += 1
                    continue
                self._check(event)
                for h in event.hashes:
                    blocks[h] = None
                    if self._probes and h in self._probes:
                        del self._probes[h]
                        stats.probes_matched += 1
                if len(blocks) > self.max_blocks:
                    log.warning("engine %s: %d blocks in view, its cache has %d: removals were "
                                "missed; view reset", self.instance_id, len(blocks),
                                self.max_blocks)
                    stats.overflows += 1
                    stats.resets += 1
                    self._clear_blocks()
                    blocks = self._blocks
            elif isinstance(event, RemovedEvent):
                if not event.tracked:
                    stats.ignored_events += 1
                    continue
                for h in event.hashes:
                    blocks.pop(h, None)
            else:
                stats.cleared += 1
                stats.resets += 1
                self._clear_blocks()
                blocks = self._blocks  # later events of this batch go into the new one
        stats.blocks = len(blocks)
        stats.expected_seq = self.expected

    def _clear_blocks(self) -> None:
        self._blocks = {}
        self.stats.blocks = 0

    # -- mismatch detection ----------------------------------------------------------------

    def _check(self, event: StoredEvent) -> None:
        hasher = self.hashes
        if hasher is None:
            return
        if event.hashes and isinstance(event.hashes[0], int) != self.spec.int_block_hashes:
            self.stats.hash_mismatches += 1
            self._mismatch(f"its events carry {type(event.hashes[0]).__name__} hashes, its record "
                           f"says int_block_hashes={self.spec.int_block_hashes}")
            return
        salt = event.extra_keys[0] if event.parent is None and event.extra_keys else None
        if salt is not None and len(salt) == 1 and isinstance(salt[0], str):
            hasher = self._salted.get(salt[0]) or self._salt_hasher(salt[0])
        mine = hasher.recompute(event)
        if mine is None:
            return
        if mine == event.hashes[0]:
            self.stats.verified_blocks += 1
            return
        self.stats.hash_mismatches += 1
        self._mismatch(f"a block it stored hashes to {mine!r:.80} here, {event.hashes[0]!r:.80} "
                       f"in its event (a different PYTHONHASHSEED or block size?)")

    def _salt_hasher(self, salt: str) -> VllmBlockHashes:
        if len(self._salted) >= _HASHERS_KEPT:
            self._salted.clear()
        hasher = self._salted[salt] = VllmBlockHashes(self.spec, salt)
        return hasher

    def expect(self, block_hash: VllmHash) -> None:
        """The conductor routed a prompt here whose block ``block_hash`` the engine does not
        hold yet: it should appear in the engine's events."""
        if self.stats.mismatch:
            return
        probes = self._probes
        probes[block_hash] = None
        self.stats.probes += 1
        if len(probes) > _PROBES_KEPT:
            del probes[next(iter(probes))]
        if self.stats.probes_matched == 0 and self.stats.probes >= MISMATCH_PROBES:
            self._mismatch(f"none of the {self.stats.probes} prompts routed to it appeared in "
                           "its KV events: the conductor's token ids or block hashes are not "
                           "the engine's")

    def _mismatch(self, why: str) -> None:
        if self.stats.mismatch:
            return
        self.stats.mismatch = why
        log.error("engine %s: KV event hash mismatch: %s; its prefix cache is ignored for "
                  "routing", self.instance_id, why)


class ChainMemo:
    """The block keys of recent prompts, so that a prompt extending one of them (a
    conversation's next turn, which repeats the whole previous prompt) hashes only its new
    blocks: sha256 over CBOR costs ~1 us a block here, an xxh3_128 over the raw token bytes of a
    remembered prefix ~0.1 us a block.

    An entry is the keys of a prompt's ``n`` full blocks under ``(what, n, xxh3_128 of those
    blocks' token bytes)``, where ``what`` names the hashing (block size, seed, int hashes,
    tenant). A lookup tries the ``max_probes`` longest remembered lengths that fit the prompt,
    longest first; the first entry found is the longest remembered prefix. Least recently used
    entries go once more than ``max_blocks`` keys are held. A digest collision (2^-128) would
    return another prefix's keys: a misrouted request, never a wrong output (the engine hashes
    the prompt itself). Thread-safe (its own lock, never held while hashing)."""

    def __init__(self, max_blocks: int = 1 << 16, max_probes: int = 8) -> None:
        if max_blocks < 0 or max_probes < 1:
            raise InvalidArgument("max_blocks must be >= 0 and max_probes >= 1")
        self.max_blocks = max_blocks
        self.max_probes = max_probes
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[Any, int, bytes], list[PrefixKey]] = OrderedDict()
        self._lengths: dict[Any, Counter[int]] = {}
        """Per hashing: how many entries of each length (the lengths worth probing)."""
        self._blocks = 0
        self.hits = 0
        """Lookups that found a remembered prefix (of any length)."""
        self.reused_blocks = 0
        """Blocks whose keys came from the memo instead of being hashed."""

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def blocks(self) -> int:
        """Keys held, over all entries."""
        return self._blocks

    def keys(self, what: Any, hasher: VllmBlockHashes, tokens: npt.NDArray[np.uint32]
             ) -> list[PrefixKey]:
        """The keys of every full block of ``tokens`` (a contiguous uint32 array), from the
        longest remembered prefix on; the prompt is remembered afterwards. The list may be the
        memo's own: read it, never change it."""
        size = hasher.block_size_tokens
        n_blocks = tokens.size // size
        if n_blocks == 0:
            return []
        found = self._probe(what, size, tokens)
        if found is not None and len(found) == n_blocks:
            return found
        if found is None:
            keys = hasher.keys(tokens)
        else:
            keys = found + hasher.keys(tokens[len(found) * size:], parent=found[-1])
        self.remember(what, hasher, tokens, keys)
        return keys

    def longest(self, what: Any, hasher: VllmBlockHashes, tokens: npt.NDArray[np.uint32]
                ) -> list[PrefixKey]:
        """The keys of the longest remembered prefix of ``tokens``' full blocks ([] when none
        is remembered), hashing nothing and remembering nothing. The list may be the memo's
        own: read it, never change it."""
        if tokens.size < hasher.block_size_tokens:
            return []
        return self._probe(what, hasher.block_size_tokens, tokens) or []

    def remember(self, what: Any, hasher: VllmBlockHashes, tokens: npt.NDArray[np.uint32],
                 keys: list[PrefixKey]) -> None:
        """Remember ``keys`` as those of every full block of ``tokens`` (as :meth:`keys`
        does once it hashed them)."""
        size = hasher.block_size_tokens
        n_blocks = tokens.size // size
        if n_blocks == 0 or len(keys) != n_blocks:
            raise InvalidArgument(f"{len(keys)} keys for {n_blocks} full blocks")
        raw = tokens[: n_blocks * size].data.cast("B")  # zero-copy: contiguous uint32
        self._remember(what, xxhash.xxh3_128_digest(raw), keys)

    def _probe(self, what: Any, size: int, tokens: npt.NDArray[np.uint32]
               ) -> list[PrefixKey] | None:
        """The longest remembered prefix's keys (see the class docstring), or None."""
        n_blocks = tokens.size // size
        raw = tokens[: n_blocks * size].data.cast("B")  # zero-copy: contiguous uint32
        block_bytes = size * 4
        with self._lock:
            counts = self._lengths.get(what)
            lengths = sorted((n for n in counts if n <= n_blocks), reverse=True) \
                if counts else []
        for n in lengths[: self.max_probes]:
            digest = xxhash.xxh3_128_digest(raw[: n * block_bytes])
            with self._lock:
                found = self._entries.get((what, n, digest))
                if found is not None:
                    self._entries.move_to_end((what, n, digest))
                    self.hits += 1
                    self.reused_blocks += n
                    return found
        return None

    def _remember(self, what: Any, digest: bytes, keys: list[PrefixKey]) -> None:
        if len(keys) > self.max_blocks:
            return
        entry = (what, len(keys), digest)
        with self._lock:
            if entry in self._entries:
                self._entries.move_to_end(entry)
                return
            self._entries[entry] = keys
            self._lengths.setdefault(what, Counter())[len(keys)] += 1
            self._blocks += len(keys)
            while self._blocks > self.max_blocks:
                (old_what, old_n, _), old = self._entries.popitem(last=False)
                self._blocks -= len(old)
                counts = self._lengths[old_what]
                counts[old_n] -= 1
                if not counts[old_n]:
                    del counts[old_n]
                    if not counts:
                        del self._lengths[old_what]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._lengths.clear()
            self._blocks = 0


_HashKey = tuple[int, str, bool]
"""What makes two instances' hashes of one prompt equal: block size, seed, int hashes."""


def _hash_key(spec: VllmKvEvents) -> _HashKey:
    return (spec.block_size_tokens, spec.hash_seed, spec.int_block_hashes)


@dataclass(frozen=True, slots=True)
class PromptMatch:
    """One prompt matched against the engines' own caches (:meth:`EngineCacheIndex.match`)."""

    cached_tokens: dict[str, int]
    """Instance id -> leading tokens of the prompt it holds (whole blocks)."""
    tenant: str
    _hashes: dict[_HashKey, list[VllmHash]]
    """The prompt's vLLM block hashes, by what makes them differ between instances."""
    complete: bool = True
    """False for :meth:`EngineCacheIndex.match_held`'s: ``_hashes`` cover a leading part of
    the prompt only (:meth:`EngineCacheIndex.complete` hashes the rest)."""
    _keys: dict[_HashKey, list[PrefixKey]] = field(default_factory=dict)
    """A partial match's store keys (where the rest of the chain continues from)."""

    def hashes(self, key: _HashKey, tenant: str) -> list[VllmHash] | None:
        """The prompt's hashes for instances of ``key`` and ``tenant``; None: not computed
        (or only in part)."""
        if not self.complete or tenant != self.tenant:
            return None
        return self._hashes.get(key)


class EngineCacheIndex:
    """The views of every followed instance, behind one lock (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._views: dict[str, EngineCacheView] = {}
        self._tenant_hashers: dict[tuple[str, str], VllmBlockHashes] = {}
        self.chains = ChainMemo()
        """Recent prompts' block keys (a prompt extending one hashes only its new blocks)."""

    def track(self, instance_id: str, spec: VllmKvEvents, generation: int = 0) -> EngineCacheView:
        """The view of ``instance_id``: kept when ``spec`` and ``generation`` (e.g. the record's
        etcd create revision) are those it has, else a fresh one (its old view left)."""
        with self._lock:
            view = self._views.get(instance_id)
            if view is not None and view.spec == spec and view.generation == generation:
                return view
            fresh = EngineCacheView(instance_id, spec, generation)
            if view is not None:
                fresh.stats.resets = view.stats.resets + 1
            self._views[instance_id] = fresh
            self._tenant_hashers.clear()
            return fresh

    def remove(self, instance_id: str) -> bool:
        with self._lock:
            return self._views.pop(instance_id, None) is not None

    def view(self, instance_id: str) -> EngineCacheView | None:
        with self._lock:
            return self._views.get(instance_id)

    def instances(self) -> list[str]:
        with self._lock:
            return sorted(self._views)

    # -- applying (the subscriber's calls) --------------------------------------------------

    def on_live(self, view: EngineCacheView, batch: EngineBatch) -> LiveOutcome:
        with self._lock:
            return view.on_live(batch)

    def on_replayed(self, view: EngineCacheView, batch: EngineBatch) -> None:
        with self._lock:
            view.on_replayed(batch)

    def replay_done(self, view: EngineCacheView) -> bool:
        with self._lock:
            return view.replay_done()

    def malformed(self, view: EngineCacheView, seq: int, why: str) -> None:
        with self._lock:
            view.malformed(seq, why)

    def reset(self, view: EngineCacheView) -> None:
        with self._lock:
            view.reset()

    def no_replay(self, view: EngineCacheView) -> None:
        with self._lock:
            view.no_replay()

    # -- matching -------------------------------------------------------------------------------

    def _hasher(self, view: EngineCacheView, tenant: str) -> VllmBlockHashes | None:
        if view.hashes is None:
            return None
        if not tenant:
            return view.hashes
        spec = view.spec
        key = (f"{spec.block_size_tokens}/{spec.hash_seed}/{spec.int_block_hashes}", tenant)
        hasher = self._tenant_hashers.get(key)
        if hasher is None:
            if len(self._tenant_hashers) >= _HASHERS_KEPT:
                self._tenant_hashers.clear()
            hasher = self._tenant_hashers[key] = VllmBlockHashes(spec, tenant)
        return hasher

    def match(self, token_ids: TokenIds, tenant: str = "",
              instances: Iterable[str] | None = None) -> PromptMatch:
        """Per followed instance (or those of ``instances`` followed): how many leading tokens
        of the prompt it holds in its own prefix cache (whole blocks; 0 when mismatched), in
        :attr:`PromptMatch.cached_tokens`. Instances sharing a block size and seed share one
        hashing of the prompt, which the match keeps for :meth:`expect_routed`.

        The prompt is hashed outside the lock (hundreds of microseconds for thousands of
        tokens, during which the event loop may apply batches): an instance whose view was
        replaced meanwhile (a new registration) counts 0, what its fresh view would say."""
        plan: list[tuple[EngineCacheView, VllmBlockHashes, _HashKey]] = []
        out: dict[str, int] = {}
        with self._lock:
            for instance_id, view in self._views.items():
                if instances is not None and instance_id not in instances:
                    continue
                hasher = self._hasher(view, tenant)
                if hasher is None or view.stats.mismatch:
                    out[instance_id] = 0
                else:
                    plan.append((view, hasher, _hash_key(view.spec)))
        memo: dict[_HashKey, list[VllmHash]] = {}
        for _, hasher, key in plan:
            if key not in memo:
                memo[key] = self._hashes(hasher, key, tenant, token_ids)
        with self._lock:
            for view, _, key in plan:
                current = self._views.get(view.instance_id) is view
                out[view.instance_id] = view.cached_blocks(memo[key]) * \
                    view.spec.block_size_tokens if current else 0
        return PromptMatch(out, tenant, memo)

    def match_held(self, token_ids: npt.NDArray[np.uint32], tenant: str = "",
                   instances: Iterable[str] | None = None) -> PromptMatch:
        """:meth:`match`'s cached tokens, hashing the prompt only as far as an instance holds
        it: after the longest prefix the chain memo remembers, blocks are hashed in growing
        steps (8, then doubling) while some instance of a hashing holds every block hashed so
        far. An instance's count ends at the first block it lacks, and the hashing ends only
        past every instance's, so the counts are :meth:`match`'s; a new prompt costs one step
        of hashing instead of all of it. The match is partial (``complete`` False) and the
        prompt is not remembered: :meth:`complete` (off the request's path) hashes the rest,
        remembers it, and gives the hashes :meth:`expect_routed` needs. ``token_ids``: a
        contiguous uint32 array."""
        if not (token_ids.dtype == np.uint32 and token_ids.ndim == 1
                and token_ids.flags.c_contiguous):
            raise InvalidArgument("match_held needs a contiguous uint32 array of token ids")
        groups: dict[_HashKey, tuple[VllmBlockHashes, list[EngineCacheView]]] = {}
        out: dict[str, int] = {}
        with self._lock:
            for instance_id, view in self._views.items():
                if instances is not None and instance_id not in instances:
                    continue
                hasher = self._hasher(view, tenant)
                if hasher is None or view.stats.mismatch:
                    out[instance_id] = 0
                else:
                    groups.setdefault(_hash_key(view.spec), (hasher, []))[1].append(view)
        all_hashes: dict[_HashKey, list[VllmHash]] = {}
        all_keys: dict[_HashKey, list[PrefixKey]] = {}
        for key, (hasher, views) in groups.items():
            size = hasher.block_size_tokens
            n_blocks = token_ids.size // size
            keys = list(self.chains.longest((key, tenant), hasher, token_ids))
            hashes = hasher.convert(keys) if keys else []
            step = 8
            while len(keys) < n_blocks:
                with self._lock:
                    held = max(v.cached_blocks(hashes) for v in views)
                if held < len(keys):
                    break  # every instance lacks a block hashed already
                end = min(n_blocks, len(keys) + step)
                more = hasher.keys(token_ids[len(keys) * size: end * size],
                                   parent=keys[-1] if keys else None)
                keys += more
                hashes += hasher.convert(more)
                step *= 2
            all_hashes[key], all_keys[key] = hashes, keys
        with self._lock:
            for key, (_, views) in groups.items():
                for view in views:
                    current = self._views.get(view.instance_id) is view
                    out[view.instance_id] = view.cached_blocks(all_hashes[key]) * \
                        view.spec.block_size_tokens if current else 0
        return PromptMatch(out, tenant, all_hashes, complete=False, _keys=all_keys)

    def complete(self, match: PromptMatch, token_ids: npt.NDArray[np.uint32]) -> PromptMatch:
        """A :meth:`match_held` match with the whole prompt hashed (from where it stopped)
        and remembered in the chain memo, as :meth:`match` leaves it; a complete match as it
        is."""
        if match.complete:
            return match
        hashes: dict[_HashKey, list[VllmHash]] = {}
        for key, keys in match._keys.items():
            with self._lock:
                hasher = next((self._hasher(v, match.tenant) for v in self._views.values()
                               if _hash_key(v.spec) == key and v.hashes is not None), None)
            if hasher is None:
                continue  # its instances left meanwhile
            size = hasher.block_size_tokens
            n_blocks = token_ids.size // size
            full = list(keys)
            if len(full) < n_blocks:
                full += hasher.keys(token_ids[len(full) * size:],
                                    parent=full[-1] if full else None)
            if full:
                self.chains.remember((key, match.tenant), hasher, token_ids, full)
            hashes[key] = match._hashes[key] + hasher.convert(full[len(keys):])
        return PromptMatch(dict(match.cached_tokens), match.tenant, hashes)

    def _hashes(self, hasher: VllmBlockHashes, key: _HashKey, tenant: str,
                token_ids: TokenIds) -> list[VllmHash]:
        """The prompt's hashes: through :attr:`chains` for a uint32 array (what the RPC
        handlers pass), else hashed whole."""
        if isinstance(token_ids, np.ndarray) and token_ids.dtype == np.uint32 and \
                token_ids.ndim == 1 and token_ids.flags.c_contiguous:
            return hasher.convert(self.chains.keys((key, tenant), hasher, token_ids))
        return hasher.hashes(token_ids)

    def cached_tokens(self, token_ids: TokenIds, tenant: str = "",
                      instances: Iterable[str] | None = None) -> dict[str, int]:
        """:meth:`match`'s cached tokens per instance."""
        return self.match(token_ids, tenant, instances).cached_tokens

    def expect_routed(self, instance_id: str, token_ids: TokenIds, tenant: str = "",
                      match: PromptMatch | None = None) -> None:
        """The conductor routed this prompt to ``instance_id``: its last full block, unless the
        engine already holds it, should show up in the engine's events (mismatch check).
        ``match``: the prompt's :meth:`match` (same tenant), whose hashes are reused."""
        with self._lock:
            view = self._views.get(instance_id)
            if view is None or view.stats.mismatch:
                return
            hasher = self._hasher(view, tenant)
            if hasher is None:
                return
            key = _hash_key(view.spec)
        hashes = match.hashes(key, tenant) if match is not None else None
        if hashes is None:
            hashes = hasher.hashes(token_ids)
        if not hashes:
            return
        with self._lock:
            if self._views.get(instance_id) is view and not view.stats.mismatch and \
                    hashes[-1] not in view:
                view.expect(hashes[-1])

    def stats(self) -> list[EngineCacheStats]:
        with self._lock:
            return [EngineCacheStats(**v.stats.as_dict()) for _, v in sorted(self._views.items())]
