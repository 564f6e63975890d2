"""Which scheduler instances the engine records in etcd make, colocated engines included.

An engine record (:class:`~kvstore.membership.engines.EngineRecord`) has one role, prefill or
decode. A ``vllm serve`` that runs both phases of its requests (the usual deployment: one
instance, no KV moving between phases) registers **two records that name the same
``http_url``**, model and node: a prefill record (its id is the instance's id, and it carries
the KV events the conductor follows) and a decode record with its own id (e.g. ``v0.decode``)
carrying ``kv_capacity_tokens``. :func:`plan_instances` pairs them into one colocated
instance under the prefill record's id (:meth:`~conductor.scheduler.Scheduler.
add_colocated_instance`), so decisions name that id for both phases.

Why two records and not one id in both roles: the etcd watch reports a record that leaves by
its instance id only, so two keys of one id could not be told apart when one goes; and
pairing on the HTTP address needs no change to the record's schema (a third role would: old
readers would skip such records as malformed). The same server is the same engine: that is
what ``http_url`` identifies. Records without an ``http_url`` (kvtier's reference workers)
are never paired.

:class:`InstanceBook` keeps a scheduler's instances equal to :func:`plan_instances`' answer; the
conductor and the front door's in-process router (kvstore/frontdoor/local.py) share it, so both
place the same records the same way. No I/O.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping, Set
from dataclasses import dataclass

from conductor.scheduler import DecodeInstance, PrefillInstance, Scheduler
from kvstore.errors import InvalidArgument
from kvstore.membership.engines import EngineRecord, EngineRole

log = logging.getLogger(__name__)

__all__ = ["InstanceBook", "InstanceKind", "PlannedInstance", "plan_instances"]


class InstanceKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


@dataclass(frozen=True, slots=True)
class PlannedInstance:
    """One scheduler instance and the engine records it stands for."""

    instance_id: str
    kind: InstanceKind
    node_id: str
    model: str
    kv_capacity_tokens: int
    """Decode KV room (0 for a prefill-only instance)."""
    records: tuple[str, ...]
    """The engine records' instance ids (two for a colocated instance: prefill, decode)."""


def plan_instances(records: Mapping[str, EngineRecord], live_nodes: Set[str]
                   ) -> dict[str, PlannedInstance]:
    """The scheduler instances of ``records`` (by their record instance id) whose node is in
    ``live_nodes``, by scheduler instance id. A prefill record and a decode record with the
    same ``http_url``, model and node become one colocated instance named like the prefill
    record; any other group sharing an ``http_url`` (two prefill records, a different model
    or node) is left unpaired, with a warning, each record its own instance."""
    live = {i: rec for i, rec in records.items() if rec.node_id in live_nodes}
    by_url: dict[str, list[EngineRecord]] = {}
    for rec in live.values():
        if rec.http_url is not None:
            by_url.setdefault(rec.http_url, []).append(rec)
    paired: dict[str, PlannedInstance] = {}
    used: set[str] = set()
    for url, group in sorted(by_url.items()):
        if len(group) < 2:
            continue
        prefill = [r for r in group if r.role is EngineRole.PREFILL]
        decode = [r for r in group if r.role is EngineRole.DECODE]
        if (len(group) != 2 or len(prefill) != 1 or len(decode) != 1
                or prefill[0].model != decode[0].model or prefill[0].node_id != decode[0].node_id):
            log.warning("engine records %s share http_url %s but are not one prefill and one "
                        "decode record of one model on one node: not treated as colocated",
                        ", ".join(sorted(r.instance_id for r in group)), url)
            continue
        p, d = prefill[0], decode[0]
        paired[p.instance_id] = PlannedInstance(p.instance_id, InstanceKind.COLOCATED, p.node_id,
                                                p.model, d.kv_capacity_tokens,
                                                (p.instance_id, d.instance_id))
        used.update((p.instance_id, d.instance_id))
    planned: dict[str, PlannedInstance] = {}
    for instance_id, rec in sorted(live.items()):
        if instance_id in used:
            continue
        kind = InstanceKind.PREFILL if rec.role is EngineRole.PREFILL else InstanceKind.DECODE
        planned[instance_id] = PlannedInstance(
            instance_id, kind, rec.node_id, rec.model,
            rec.kv_capacity_tokens if kind is InstanceKind.DECODE else 0, (instance_id,))
    planned.update(paired)  # record ids are unique, and a pair's are in ``used``
    return planned


class InstanceBook:
    """The scheduler instances placed from engine records, and the records each stands for.

    :meth:`sync` makes ``scheduler``'s instances :func:`plan_instances`' answer for the records
    now: an instance whose plan or whose records changed is removed and added again, a record
    the scheduler refuses (:class:`~kvstore.errors.InvalidArgument`) is left out with a
    warning. Not thread-safe: the caller serializes (the conductor holds its lock)."""

    __slots__ = ("alias", "placed", "scheduled")

    def __init__(self) -> None:
        self.placed: dict[str, PlannedInstance] = {}
        """Scheduler instance id -> its plan."""
        self.scheduled: dict[str, EngineRecord] = {}
        """Record id -> the record as it was when its instance was placed."""
        self.alias: dict[str, str] = {}
        """Record id -> the scheduler instance it stands in."""

    def sync(self, scheduler: Scheduler, records: Mapping[str, EngineRecord],
             live_nodes: Set[str]) -> None:
        wanted = plan_instances(records, live_nodes)
        for instance_id, planned in list(self.placed.items()):
            if wanted.get(instance_id) != planned or any(
                    self.scheduled.get(r) != records.get(r) for r in planned.records):
                scheduler.remove_instance(instance_id)
                del self.placed[instance_id]
                for r in planned.records:
                    self.scheduled.pop(r, None)
                    self.alias.pop(r, None)
        for instance_id, planned in wanted.items():
            if instance_id in self.placed:
                continue
            try:
                if planned.kind is InstanceKind.PREFILL:
                    scheduler.add_prefill_instance(
                        PrefillInstance(instance_id, planned.node_id, planned.model))
                elif planned.kind is InstanceKind.DECODE:
                    scheduler.add_decode_instance(DecodeInstance(
                        instance_id, planned.node_id, planned.model, planned.kv_capacity_tokens))
                else:
                    scheduler.add_colocated_instance(
                        PrefillInstance(instance_id, planned.node_id, planned.model),
                        planned.kv_capacity_tokens)
            except InvalidArgument as exc:
                log.warning("engine %s not schedulable: %s", instance_id, exc)
                continue
            self.placed[instance_id] = planned
            for r in planned.records:
                self.scheduled[r] = records[r]
                self.alias[r] = instance_id

    def scheduler_instance(self, record_id: str) -> str:
        """The scheduler instance an engine record stands in (a colocated pair's decode
        record is its prefill record's instance); the id itself when unknown."""
        return self.alias.get(record_id, record_id)
