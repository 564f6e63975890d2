"""A start-up check that instances that should share KV agree on vLLM's block hash.

kvtier's keys are vLLM's block hashes behind a namespace of the model. Two instances of one
model with another block size, another ``prefix_caching_hash_algo`` or another hash seed
(``PYTHONHASHSEED``, from which vLLM derives ``NONE_HASH``) compute different keys for the same
tokens: 0% hits between them, and nothing fails. So the scheduler half keeps a **manifest** in
the daemon under a key derived from the model's identity *without* those three (model and
revision, KV dtype, layers, KV heads, head size, TP size; no tenant): its block size, hash
algorithm and ``NONE_HASH`` (a hash of the seed, never the seed). At start it reads the
manifest first: where it differs, an ERROR names each difference and who wrote the manifest,
and the caller counts it (``config_mismatch``); where there is none, it writes its own.

The first writer wins (chunks are immutable, and a later instance must not hide the
difference from the next one); a manifest evicted from the daemon is written again by the next
instance that starts. The check is advisory: kvtier serves either way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from dataclasses import asdict, dataclass

from kvstore.client.store_client import StoreClient
from kvstore.errors import ChunkExists, ChunkNotFound, KvtierError
from kvstore.integrations.vllm.spec import ConnectorSpec

log = logging.getLogger(__name__)

__all__ = ["MANIFEST_KEY_PREFIX", "Manifest", "check_manifest", "manifest_key"]

MANIFEST_KEY_PREFIX = b"kvtier:vllm-manifest:"
_VERSION = 1


@dataclass(frozen=True, slots=True)
class Manifest:
    """What must agree between instances of one model for their keys to meet."""

    block_tokens: int
    hash_algo: str
    none_hash_hex: str
    model: str = ""
    written_by: str = ""
    """Host and pid of the writer (for the error message; not compared)."""

    @classmethod
    def of(cls, spec: ConnectorSpec, vllm_hash_seed: str) -> Manifest:
        return cls(spec.block_tokens, spec.hash_algo, none_hash(spec.hash_algo,
                                                                vllm_hash_seed).hex(),
                   spec.model, f"{socket.gethostname()} pid {os.getpid()}")

    def to_bytes(self) -> bytes:
        return json.dumps({"version": _VERSION, **asdict(self)}, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray) -> Manifest:
        """Raises ValueError for bytes that are not a manifest of this version."""
        try:
            obj = json.loads(bytes(data))
            if obj.pop("version") != _VERSION:
                raise ValueError(f"manifest version {obj!r}")
            return cls(int(obj["block_tokens"]), str(obj["hash_algo"]),
                       str(obj["none_hash_hex"]), str(obj.get("model", "")),
                       str(obj.get("written_by", "")))
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a kvtier manifest: {exc}") from exc

    def differences(self, other: Manifest) -> list[str]:
        """What differs between this instance's manifest and ``other`` (empty: they agree)."""
        out = []
        if self.block_tokens != other.block_tokens:
            out.append(f"block size {self.block_tokens} here, {other.block_tokens} there")
        if self.hash_algo != other.hash_algo:
            out.append(f"prefix_caching_hash_algo {self.hash_algo!r} here, "
                       f"{other.hash_algo!r} there")
        elif self.none_hash_hex != other.none_hash_hex:
            out.append(f"vLLM's hash seed (PYTHONHASHSEED): NONE_HASH "
                       f"{self.none_hash_hex[:16]}... here, {other.none_hash_hex[:16]}... "
                       "there")
        return out


def none_hash(hash_algo: str, vllm_hash_seed: str) -> bytes:
    """vLLM's ``NONE_HASH`` for ``hash_algo`` and the seed (as ``init_none_hash`` makes it)."""
    from vllm.utils.hashing import get_hash_fn_by_name

    return bytes(get_hash_fn_by_name(hash_algo)(vllm_hash_seed))


def manifest_key(spec: ConnectorSpec) -> bytes:
    """The manifest's key: the model's identity without block size, hash algorithm or seed."""
    identity = json.dumps([spec.model, str(spec.dtype), spec.num_layers, spec.num_kv_heads,
                           spec.head_dim, spec.tp_size])
    return MANIFEST_KEY_PREFIX + hashlib.sha256(identity.encode()).digest()[:24]


def check_manifest(store: StoreClient, spec: ConnectorSpec, vllm_hash_seed: str
                   ) -> list[str] | None:
    """Compare with (or record) the model's manifest in ``store``'s daemon. Returns the
    differences (logged as an ERROR), ``[]`` when they agree or this one is the first, None when
    the daemon could not be asked (KvtierError: logged, try again later)."""
    mine = Manifest.of(spec, vllm_hash_seed)
    key = manifest_key(spec)
    try:
        try:
            theirs = Manifest.from_bytes(store.get(key))
        except ChunkNotFound:
            try:
                store.put(key, mine.to_bytes())
                log.info("kvtier connector: recorded the manifest of %r (block %d tokens, hash "
                         "%s)", spec.model, spec.block_tokens, spec.hash_algo)
                return []
            except ChunkExists:  # another instance wrote it just now
                theirs = Manifest.from_bytes(store.get(key))
    except KvtierError as exc:
        log.warning("kvtier connector: could not check the manifest of %r: %s: %s", spec.model,
                    type(exc).__name__, exc)
        return None
    except ValueError as exc:
        log.error("kvtier connector: the manifest of %r in the daemon is unreadable (%s): "
                  "not checked", spec.model, exc)
        return []
    diffs = mine.differences(theirs)
    if diffs:
        log.error("kvtier connector: another instance of %r (%s) uses a different %s: the two "
                  "compute different keys for the same tokens and will never share KV (0%% "
                  "hits between them). Make every instance that should share agree.",
                  spec.model, theirs.written_by or "unknown", "; ".join(diffs))
    return diffs
