"""Checks a recorded history of a fault run against kvtier's invariants (docs/chaos.md).

Pure: no processes, no clock, no I/O. The fault suite (``bench/chaos.py``) records one
:class:`Record` per request its load generator made, plus the faults it injected, the daemon
restarts and the membership changes it observed, into a :class:`History`; :func:`check` returns
every broken invariant as a :class:`Violation` (an empty list: the run was clean) and
:func:`fault_stats` the per-fault counts the report prints.

Values are a deterministic function of key and version (:func:`chunk_value`), so a read is
checked byte for byte from its digest alone, with no copy of what was written.

Invariants (one :class:`Invariant` each)

* **no wrong read**: a get that returned bytes (``Result.OK``) returned exactly
  ``chunk_value(key, version, size)`` of some put of that key *to the same node* that was
  acknowledged or still undecided (in flight or failed: a put that timed out may have been
  applied) and that started before the get ended. A node serving bytes it was never sent is a
  wrong read too.
* **nothing durable lost**: a put acknowledged as durable before its node was killed is
  readable on that node after the restart: a get of it there, started after the node came
  back, that finds nothing (``Result.ABSENT``) is a loss. Durable puts with no such get are
  counted as unverified (:func:`durable_unverified`), not as losses. Chunks the run damaged
  on purpose (:attr:`History.damaged`: bytes flipped in a segment file) are exempt: they must
  be dropped, never returned (a wrong read). So is a chunk the store said it removed
  (:attr:`History.removed`: its REMOVED event, seen after the put started and at most
  ``removal_slack_s`` after the get ended, for the event's way to the observer: evicted at
  the tier's budget, or removed by a client): a daemon reports only what it held, so a chunk
  it lost in a crash never has one.
* **no placement after lease expiry**: no ``SCHEDULE`` record names a node, with its start
  more than ``placement_grace_s`` after the node's lease expired and more than that before it
  registered again (:class:`LeaseGap`: as one watch saw it; a scheduler watching through
  another etcd member may see each change a little earlier).
* **one leader per epoch**: ``LEASE`` records (a conductor acting as leader in an epoch) name
  at most one node per epoch.
* **no stale leader** (fencing): no ``LEASE`` record of an epoch starts after a record of a
  later epoch started (a leader that was paused while another took over must not act again in
  its old term).
* **progress**: at least one request started during each fault window was answered; with
  ``max_stall_s``, also no span longer than that inside the window without an answer (a
  stalled node must not stall the requests that do not need it).
* **bounded waits** (with ``request_timeout_s``): no put or get took longer than the
  client's configured timeout plus one second.

Engine requests (``Op.ENGINE``: a prompt served by a real engine that saves its KV to and
loads it from the daemons) are checked too:

* an engine request that answered (``Result.OK``) returned greedy tokens whose digest
  (:func:`tokens_digest`) equals the no-cache output of the same prompt
  (:attr:`History.engine_expected`, computed by the same model without a store): anything else
  is a wrong read (``Invariant.WRONG_READ``), as wrong KV loaded from the store would give;
* with ``engine_timeout_s``, one that took longer than that plus one second is a bounded-wait
  violation (``Invariant.OVER_TIMEOUT``) and counts as failed (:func:`engine_stats`);
* progress: when engine requests were under way in a fault window (:func:`engine_stats`: also
  the ones in flight at its start), at least one of them completed (the engines degrade to
  recomputing where the store cannot serve them).

Times are seconds on one monotonic clock (``time.monotonic()`` is shared by every process
of one machine, network namespaces included).
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import InvalidArgument

__all__ = ["Fault", "FaultStats", "History", "Invariant", "LeaseGap", "Op", "Record", "Removal",
           "Restart", "Result", "Violation", "check", "chunk_value", "digest", "durable_unverified",
           "engine_requests_during", "engine_reuse", "engine_stats", "expected_digest", "fault_stats", "longest_stall",
           "tokens_digest"]


class Op(enum.Enum):
    PUT = "put"
    GET = "get"
    LEASE = "lease"
    """A conductor acting as leader in ``epoch`` from ``start_s`` to ``end_s``."""
    SCHEDULE = "schedule"
    """A decision to send work (a put) to ``node``, made at ``start_s``."""
    ENGINE = "engine"
    """A prompt (``key``: its id in :attr:`History.engine_expected`) served by the engine on
    ``node``: ``digest`` of its greedy tokens (:func:`tokens_digest`), ``prompt_tokens``, and
    ``reused_tokens`` of it loaded from kvtier instead of computed."""


class Result(enum.Enum):
    OK = "ok"
    ERR = "err"
    ABSENT = "absent"
    """A get that found no chunk (a miss, not an error)."""


class Invariant(enum.Enum):
    WRONG_READ = "wrong_read"
    DURABLE_LOST = "durable_lost"
    PLACEMENT_AFTER_EXPIRY = "placement_after_expiry"
    TWO_LEADERS = "two_leaders"
    STALE_LEADER = "stale_leader"
    NO_PROGRESS = "no_progress"
    OVER_TIMEOUT = "over_timeout"

TIMEOUT_SLACK_S = 1.0
"""A request may end this long after its timeout (the issue's "timeout plus one second")."""


def chunk_value(key: str, version: int, size_bytes: int) -> bytes:
    """The bytes a put of ``key`` at ``version`` writes: SHAKE-256 of ``key || version``
    expanded to ``size_bytes`` (incompressible, and different for every key and version)."""
    if size_bytes <= 0:
        raise InvalidArgument(f"size_bytes must be > 0, got {size_bytes}")
    return hashlib.shake_256(f"{key}\x00{version}".encode()).digest(size_bytes)


def digest(data: bytes | bytearray | memoryview) -> str:
    """What a record keeps of the bytes a get returned."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def expected_digest(key: str, version: int, size_bytes: int) -> str:
    return digest(chunk_value(key, version, size_bytes))


def tokens_digest(tokens: Sequence[int]) -> str:
    """What an engine record keeps of the token ids a request returned."""
    if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in tokens):
        raise InvalidArgument(f"token ids must be ints >= 0, got {list(tokens)!r}")
    return digest(",".join(str(t) for t in tokens).encode())


@dataclass(frozen=True, slots=True)
class Record:
    """One request of the load. ``end_s`` None: it never returned (in flight at the end).
    ``digest``: of the bytes a get returned (``Result.OK`` gets only). ``durable``: a put the
    store acknowledged as persisted (to NVMe). ``epoch``: of a ``LEASE`` record."""

    op: Op
    key: str
    node: str
    start_s: float
    end_s: float | None
    result: Result
    version: int = 0
    size_bytes: int = 0
    digest: str | None = None
    durable: bool = False
    epoch: int = 0
    error: str = ""
    prompt_tokens: int = 0
    reused_tokens: int = 0
    """``ENGINE`` records: the prompt's length, and how much of it the engine loaded from
    kvtier instead of computing."""

    def __post_init__(self) -> None:
        if not isinstance(self.op, Op) or not isinstance(self.result, Result):
            raise InvalidArgument(f"op and result must be Op and Result, got {self.op!r}, "
                                  f"{self.result!r}")
        if not math.isfinite(self.start_s) or (
                self.end_s is not None and not self.end_s >= self.start_s):
            raise InvalidArgument(f"record times must be finite with end_s >= start_s, got "
                                  f"{self.start_s}, {self.end_s}")
        if self.op is Op.GET and self.result is Result.OK and self.digest is None:
            raise InvalidArgument(f"an OK get of {self.key!r} needs the digest of its bytes")
        if self.op is Op.PUT and self.size_bytes <= 0:
            raise InvalidArgument(f"a put of {self.key!r} needs size_bytes > 0")
        if self.durable and not (self.op is Op.PUT and self.result is Result.OK):
            raise InvalidArgument("only an acknowledged (OK) put can be durable")
        if self.op is Op.ENGINE and self.result is Result.OK and self.digest is None:
            raise InvalidArgument(f"an OK engine request of {self.key!r} needs the digest of "
                                  "its tokens")
        if not 0 <= self.reused_tokens <= max(self.prompt_tokens, 0):
            raise InvalidArgument(f"reused_tokens must be in [0, prompt_tokens], got "
                                  f"{self.reused_tokens} of {self.prompt_tokens}")

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op.value, "key": self.key, "node": self.node, "start_s": self.start_s,
                "end_s": self.end_s, "result": self.result.value, "version": self.version,
                "size_bytes": self.size_bytes, "digest": self.digest, "durable": self.durable,
                "epoch": self.epoch, "error": self.error, "prompt_tokens": self.prompt_tokens,
                "reused_tokens": self.reused_tokens}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Record:
        try:
            return cls(op=Op(d["op"]), key=str(d["key"]), node=str(d["node"]),
                       start_s=float(d["start_s"]),
                       end_s=None if d.get("end_s") is None else float(d["end_s"]),
                       result=Result(d["result"]), version=int(d.get("version", 0)),
                       size_bytes=int(d.get("size_bytes", 0)), digest=d.get("digest"),
                       durable=bool(d.get("durable", False)), epoch=int(d.get("epoch", 0)),
                       error=str(d.get("error", "")),
                       prompt_tokens=int(d.get("prompt_tokens", 0)),
                       reused_tokens=int(d.get("reused_tokens", 0)))
        except (KeyError, ValueError, TypeError) as exc:
            raise InvalidArgument(f"not a history record: {d!r} ({exc})") from exc


@dataclass(frozen=True, slots=True)
class Fault:
    """A fault ``name`` on ``node``, injected at ``start_s`` and removed at ``end_s``."""

    name: str
    node: str
    start_s: float
    end_s: float

    def __post_init__(self) -> None:
        if not self.end_s >= self.start_s:
            raise InvalidArgument(f"fault {self.name}: end_s {self.end_s} < start_s "
                                  f"{self.start_s}")


@dataclass(frozen=True, slots=True)
class Restart:
    """``node``'s daemon died at ``down_s`` (killed) and served again from ``up_s``."""

    node: str
    down_s: float
    up_s: float


@dataclass(frozen=True, slots=True)
class LeaseGap:
    """``node``'s membership lease expired at ``expired_s`` (its key left etcd) and it
    registered again at ``renewed_s`` (None: not before the end)."""

    node: str
    expired_s: float
    renewed_s: float | None = None


@dataclass(frozen=True, slots=True)
class Removal:
    """``node`` reported ``key`` removed (its REMOVED event; gone from every tier), as the
    load received it at ``at_s`` (the removal itself was earlier)."""

    node: str
    key: str
    at_s: float


@dataclass
class History:
    records: list[Record] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    restarts: list[Restart] = field(default_factory=list)
    lease_gaps: list[LeaseGap] = field(default_factory=list)
    damaged: list[tuple[str, str]] = field(default_factory=list)
    """(node, key) of chunks whose stored bytes the run corrupted."""
    removed: list[Removal] = field(default_factory=list)
    """REMOVED events the daemons reported (evictions at the budget, removals)."""
    engine_expected: dict[str, str] = field(default_factory=dict)
    """Prompt id -> :func:`tokens_digest` of its greedy output without any store (the
    reference every ``ENGINE`` record of that prompt must equal)."""


@dataclass(frozen=True, slots=True)
class Violation:
    invariant: Invariant
    message: str
    record: Record | None = None


def check(history: History, *, placement_grace_s: float = 0.5, require_progress: bool = True,
          max_stall_s: float | None = None, request_timeout_s: float | None = None,
          removal_slack_s: float = 2.0, engine_timeout_s: float | None = None
          ) -> list[Violation]:
    """Every broken invariant of ``history`` (see the module docstring); [] when clean."""
    for name, value in (("placement_grace_s", placement_grace_s), ("max_stall_s", max_stall_s),
                        ("request_timeout_s", request_timeout_s),
                        ("removal_slack_s", removal_slack_s),
                        ("engine_timeout_s", engine_timeout_s)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise InvalidArgument(f"{name} must be finite and >= 0, got {value}")
    out = _wrong_reads(history.records)
    out += _wrong_outputs(history)
    out += _durable_lost(history, removal_slack_s)
    out += _placements_after_expiry(history.records, history.lease_gaps, placement_grace_s)
    out += _two_leaders(history.records)
    out += _stale_leaders(history.records)
    if require_progress:
        out += _no_progress(history, max_stall_s)
        out += _no_engine_progress(history, engine_timeout_s)
    if request_timeout_s is not None:
        out += _over_timeout(history.records, request_timeout_s)
    if engine_timeout_s is not None:
        out += _engine_over_timeout(history.records, engine_timeout_s)
    return out


def _puts_by_key_node(records: Iterable[Record]) -> dict[tuple[str, str], list[Record]]:
    puts: dict[tuple[str, str], list[Record]] = defaultdict(list)
    for r in records:
        if r.op is Op.PUT:
            puts[(r.key, r.node)].append(r)
    return puts


def _wrong_reads(records: Sequence[Record]) -> list[Violation]:
    puts = _puts_by_key_node(records)
    out = []
    for r in records:
        if r.op is not Op.GET or r.result is not Result.OK:
            continue
        end = math.inf if r.end_s is None else r.end_s
        # A put that failed may still have been applied (the answer was lost): a candidate.
        candidates = {expected_digest(p.key, p.version, p.size_bytes)
                      for p in puts.get((r.key, r.node), ()) if p.start_s <= end}
        if r.digest not in candidates:
            why = "no put of it reached that node" if not candidates else \
                f"matches none of {len(candidates)} version(s) put there"
            out.append(Violation(Invariant.WRONG_READ,
                                 f"get of {r.key!r} on {r.node} at {r.start_s:.3f} returned "
                                 f"bytes (digest {r.digest}) that {why}", r))
    return out


def _wrong_outputs(history: History) -> list[Violation]:
    """Engine answers whose tokens differ from the prompt's no-cache output (or whose prompt
    has no reference: nothing vouches for them)."""
    out = []
    for r in history.records:
        if r.op is not Op.ENGINE or r.result is not Result.OK:
            continue
        expected = history.engine_expected.get(r.key)
        if expected is None:
            out.append(Violation(Invariant.WRONG_READ, f"engine request of prompt {r.key!r} on "
                                 f"{r.node} at {r.start_s:.3f} has no no-cache output to "
                                 "compare with", r))
        elif r.digest != expected:
            out.append(Violation(Invariant.WRONG_READ, f"engine request of prompt {r.key!r} on "
                                 f"{r.node} at {r.start_s:.3f} returned tokens (digest "
                                 f"{r.digest}) that differ from its no-cache output "
                                 f"({expected}); {r.reused_tokens} of {r.prompt_tokens} prompt "
                                 "tokens were loaded from kvtier", r))
    return out


def _durable_before(history: History, restart: Restart) -> dict[str, float]:
    """Keys acknowledged durable on the restarted node before its kill, and when their
    put started."""
    damaged = {key for node, key in history.damaged if node == restart.node}
    return {r.key: r.start_s for r in history.records
            if r.durable and r.node == restart.node and r.end_s is not None
            and r.end_s <= restart.down_s and r.key not in damaged}


def _removals(history: History) -> dict[tuple[str, str], list[float]]:
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for removal in history.removed:
        out[(removal.node, removal.key)].append(removal.at_s)
    return out


def _removed_between(removals: dict[tuple[str, str], list[float]], node: str, key: str,
                     since_s: float, until_s: float) -> bool:
    """Did ``node`` report ``key`` removed after ``since_s`` (its put started) and before
    ``until_s`` (the get that found it absent ended, plus the slack)?"""
    return any(since_s <= at <= until_s for at in removals.get((node, key), ()))


def _durable_lost(history: History, removal_slack_s: float) -> list[Violation]:
    out = []
    removals = _removals(history)
    for restart in history.restarts:
        durable = _durable_before(history, restart)
        for r in history.records:
            if (r.op is Op.GET and r.node == restart.node and r.key in durable
                    and r.start_s >= restart.up_s and r.result is Result.ABSENT
                    and not _removed_between(removals, r.node, r.key, durable[r.key],
                                             math.inf if r.end_s is None
                                             else r.end_s + removal_slack_s)):
                out.append(Violation(Invariant.DURABLE_LOST,
                                     f"{r.key!r} was acknowledged durable on {r.node} before "
                                     f"the kill at {restart.down_s:.3f}, and a get at "
                                     f"{r.start_s:.3f} after the restart found nothing", r))
    return out


def durable_unverified(history: History) -> int:
    """Durable puts acknowledged before a kill that no later get on their node read back OK
    or found absent (neither kept nor shown lost)."""
    count = 0
    for restart in history.restarts:
        durable = set(_durable_before(history, restart))
        seen = {r.key for r in history.records
                if r.op is Op.GET and r.node == restart.node and r.start_s >= restart.up_s
                and r.result in (Result.OK, Result.ABSENT)}
        count += len(durable - seen)
    return count


def _placements_after_expiry(records: Sequence[Record], gaps: Sequence[LeaseGap],
                             grace_s: float) -> list[Violation]:
    out = []
    for gap in gaps:
        # The grace on both ends: the watch that saw the gap is one observer; a scheduler
        # watching another etcd member may see the node leave or come back a little earlier.
        until = math.inf if gap.renewed_s is None else gap.renewed_s - grace_s
        for r in records:
            if (r.op is Op.SCHEDULE and r.result is Result.OK and r.node == gap.node
                    and gap.expired_s + grace_s < r.start_s < until):
                out.append(Violation(Invariant.PLACEMENT_AFTER_EXPIRY,
                                     f"work for {r.key!r} placed on {r.node} at "
                                     f"{r.start_s:.3f}, {r.start_s - gap.expired_s:.3f} s after "
                                     f"its lease expired", r))
    return out


def _two_leaders(records: Sequence[Record]) -> list[Violation]:
    leaders: dict[int, set[str]] = defaultdict(set)
    for r in records:
        if r.op is Op.LEASE and r.result is Result.OK:
            leaders[r.epoch].add(r.node)
    return [Violation(Invariant.TWO_LEADERS,
                      f"epoch {epoch} had {len(nodes)} leaders: {', '.join(sorted(nodes))}")
            for epoch, nodes in sorted(leaders.items()) if len(nodes) > 1]


def _stale_leaders(records: Sequence[Record]) -> list[Violation]:
    acts = sorted((r for r in records if r.op is Op.LEASE and r.result is Result.OK),
                  key=lambda r: r.start_s)
    out = []
    newest: Record | None = None  # the act of the highest epoch seen so far, by start time
    for r in acts:
        if newest is not None and r.epoch < newest.epoch and r.start_s > newest.start_s:
            out.append(Violation(Invariant.STALE_LEADER,
                                 f"{r.node} acted as leader of epoch {r.epoch} at "
                                 f"{r.start_s:.3f}, after {newest.node} led epoch "
                                 f"{newest.epoch} from {newest.start_s:.3f}", r))
        if newest is None or r.epoch > newest.epoch:
            newest = r
    return out


def _no_progress(history: History, max_stall_s: float | None) -> list[Violation]:
    out = []
    for fault in history.faults:
        stats = _window_stats(history.records, fault)
        if stats.completed == 0:
            out.append(Violation(Invariant.NO_PROGRESS,
                                 f"fault {fault.name} on {fault.node}: none of {stats.attempted} "
                                 f"requests started in [{fault.start_s:.3f}, {fault.end_s:.3f}] "
                                 f"completed"))
            continue
        if max_stall_s is None:
            continue
        stall, at = longest_stall(history.records, fault)
        if stall > max_stall_s:
            out.append(Violation(Invariant.NO_PROGRESS,
                                 f"fault {fault.name} on {fault.node}: no request answered for "
                                 f"{stall:.3f} s from {at:.3f} (at most {max_stall_s} s)"))
    return out


def _no_engine_progress(history: History, engine_timeout_s: float | None) -> list[Violation]:
    out = []
    for fault in history.faults:
        stats = engine_stats(history.records, fault, engine_timeout_s)
        if stats.attempted and not stats.completed:
            out.append(Violation(Invariant.NO_PROGRESS,
                                 f"fault {fault.name} on {fault.node}: none of "
                                 f"{stats.attempted} engine requests under way in "
                                 f"[{fault.start_s:.3f}, {fault.end_s:.3f}] completed"))
    return out


def longest_stall(records: Sequence[Record], fault: Fault) -> tuple[float, float]:
    """The longest span inside ``fault``'s window in which no put or get was answered, and
    when it began."""
    answers = sorted(r.end_s for r in records
                     if r.op in (Op.PUT, Op.GET) and r.end_s is not None
                     and r.result is not Result.ERR and fault.start_s <= r.end_s <= fault.end_s)
    marks = [fault.start_s, *answers, fault.end_s]
    return max((b - a, a) for a, b in itertools.pairwise(marks))


def _over_timeout(records: Sequence[Record], timeout_s: float) -> list[Violation]:
    return [Violation(Invariant.OVER_TIMEOUT,
                      f"{r.op.value} of {r.key!r} on {r.node} at {r.start_s:.3f} took "
                      f"{r.end_s - r.start_s:.3f} s (timeout {timeout_s} s + "
                      f"{TIMEOUT_SLACK_S} s)", r)
            for r in records if r.op in (Op.PUT, Op.GET) and r.end_s is not None
            and r.end_s - r.start_s > timeout_s + TIMEOUT_SLACK_S]


def _engine_over_timeout(records: Sequence[Record], timeout_s: float) -> list[Violation]:
    return [Violation(Invariant.OVER_TIMEOUT,
                      f"engine request of prompt {r.key!r} on {r.node} at {r.start_s:.3f} "
                      f"took {r.end_s - r.start_s:.3f} s (timeout {timeout_s} s + "
                      f"{TIMEOUT_SLACK_S} s)", r)
            for r in records if r.op is Op.ENGINE and r.end_s is not None
            and r.end_s - r.start_s > timeout_s + TIMEOUT_SLACK_S]


@dataclass(frozen=True, slots=True)
class FaultStats:
    """Data requests (puts and gets) started inside one fault window."""

    fault: str
    attempted: int
    completed: int
    """Returned: OK, or a get that found nothing (an answer, not a failure)."""
    failed: int
    """Returned an error, or never returned."""


def _window_stats(records: Sequence[Record], fault: Fault) -> FaultStats:
    inside = [r for r in records if r.op in (Op.PUT, Op.GET)
              and fault.start_s <= r.start_s <= fault.end_s]
    completed = sum(1 for r in inside if r.end_s is not None and r.result is not Result.ERR)
    return FaultStats(fault.name, len(inside), completed, len(inside) - completed)


def fault_stats(history: History) -> list[FaultStats]:
    return [_window_stats(history.records, f) for f in history.faults]


def engine_stats(records: Sequence[Record], fault: Fault,
                 timeout_s: float | None = None) -> FaultStats:
    """Engine requests under way during ``fault``'s window: started inside it, or in flight
    when it began (the request the fault caught is the one that waits longest). Failed: an
    error, no answer, or (with ``timeout_s``) an answer later than the timeout plus one
    second."""
    inside = engine_requests_during(records, fault)
    limit = math.inf if timeout_s is None else timeout_s + TIMEOUT_SLACK_S
    completed = sum(1 for r in inside if r.end_s is not None and r.result is Result.OK
                    and r.end_s - r.start_s <= limit)
    return FaultStats(fault.name, len(inside), completed, len(inside) - completed)


def engine_requests_during(records: Sequence[Record], fault: Fault) -> list[Record]:
    """Engine records started in ``fault``'s window or in flight at its start."""
    return [r for r in records if r.op is Op.ENGINE and r.start_s <= fault.end_s
            and (r.end_s is None or r.end_s >= fault.start_s)]


def engine_reuse(records: Sequence[Record], since_s: float = -math.inf,
                 until_s: float = math.inf) -> float | None:
    """The share of prompt tokens the engines loaded from kvtier (not computed), over the
    engine requests answered that started in ``[since_s, until_s)``; None: there were none."""
    done = [r for r in records if r.op is Op.ENGINE and r.result is Result.OK
            and since_s <= r.start_s < until_s]
    prompt = sum(r.prompt_tokens for r in done)
    return sum(r.reused_tokens for r in done) / prompt if prompt else None
