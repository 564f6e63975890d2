"""Which store keys a prompt's token ids make for a model: the key scheme its engine records name.

A prompt given as token ids is matched against the daemons' tiers by its chained block keys
(:class:`~kvstore.keys.BlockHasher`), which the conductor must compute as the engines' own
clients compute them when they store and load:

* kvtier's reference workers: kvtier's own chain (``xxh3_128``) behind the namespace of the
  record's KV fingerprint;
* a vLLM engine with kvtier's connector (its record has ``vllm_kv_events`` with
  ``hash_algo="sha256_cbor"`` and a KV fingerprint): vLLM's own ``sha256_cbor`` block hashes,
  seeded with the record's ``hash_seed``, behind the namespace, the request's tenant (its
  ``cache_salt``) as the salt (kvstore.integrations.vllm).

A :class:`KeyScheme` is that choice for one record. One request carries one key chain (the
scheduler matches it against every node), so the engines of one model must agree on it:
:func:`store_hasher` refuses a model whose records name different schemes (reference workers
and connector engines under one model name, or two fingerprints), with an error naming them,
rather than price one kind of engine with the other's keys (which would match nothing, or
worse, another layout's blocks). Serve such engines under different model names.

The conductor (``conductor.server.Conductor.hasher``) and the front door's in-process router
(kvstore/frontdoor/local.py) both take their hasher from here, so they hash alike. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvstore.errors import InvalidArgument
from kvstore.keys import BlockHasher, HashMode, KVFingerprint, Namespace
from kvstore.membership.engines import EngineRecord

__all__ = ["KeyScheme", "key_scheme", "store_hasher"]


@dataclass(frozen=True, slots=True)
class KeyScheme:
    """How an engine's client makes store keys: the fingerprint's namespace, the hash mode and
    (``sha256_cbor`` only) vLLM's hash seed."""

    fingerprint: KVFingerprint
    mode: HashMode
    vllm_hash_seed: str | None = None

    def hasher(self, tenant: str) -> BlockHasher:
        if self.mode is HashMode.SHA256_CBOR:
            return BlockHasher(Namespace(self.fingerprint, tenant), mode=self.mode,
                               vllm_hash_seed=self.vllm_hash_seed)
        return BlockHasher(Namespace(self.fingerprint, tenant))

    def describe(self) -> str:
        seed = f", seed {self.vllm_hash_seed!r}" if self.vllm_hash_seed is not None else ""
        fp = self.fingerprint
        return (f"{self.mode.value} keys of {fp.model} {fp.dtype.value} {fp.num_layers} layers "
                f"x {fp.num_kv_heads} heads x {fp.head_dim}, tp {fp.tp_rank}/{fp.tp_size}, "
                f"{fp.block_size_tokens}-token blocks{seed}")


def key_scheme(record: EngineRecord) -> KeyScheme | None:
    """The scheme of ``record``'s store keys (None: it published no KV fingerprint)."""
    fingerprint = record.kv_fingerprint
    if fingerprint is None:
        return None
    events = record.vllm_kv_events
    if events is not None and events.hash_algo == HashMode.SHA256_CBOR.value:
        return KeyScheme(fingerprint, HashMode.SHA256_CBOR, events.hash_seed)
    return KeyScheme(fingerprint, HashMode.XXH3_128)


def store_hasher(records: Iterable[tuple[str, EngineRecord]], model: str, tenant: str,
                 block_size_tokens: int) -> BlockHasher | None:
    """The hasher of ``model``'s store keys for ``tenant``, from its engine records
    ``(instance id, record)``; None when none of them published a KV fingerprint. Raises
    InvalidArgument when they name different schemes, or blocks of another size than
    ``block_size_tokens`` (what the scheduler counts in)."""
    schemes: dict[KeyScheme, list[str]] = {}
    for instance_id, record in records:
        if record.model != model:
            continue
        scheme = key_scheme(record)
        if scheme is not None:
            schemes.setdefault(scheme, []).append(instance_id)
    if not schemes:
        return None
    if len(schemes) > 1:
        named = "; ".join(f"{', '.join(sorted(ids))}: {scheme.describe()}"
                          for scheme, ids in sorted(schemes.items(), key=lambda s: min(s[1])))
        raise InvalidArgument(
            f"the engines of model {model!r} make their store keys differently ({named}): one "
            "request's keys cannot be priced on all of them; register them under different "
            "model names, or send chained keys")
    (scheme,) = schemes
    if scheme.fingerprint.block_size_tokens != block_size_tokens:
        raise InvalidArgument(
            f"model {model!r} uses blocks of {scheme.fingerprint.block_size_tokens} tokens; "
            f"this scheduler counts blocks of {block_size_tokens}")
    return scheme.hasher(tenant)
