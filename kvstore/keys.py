"""Prefix keys: the chunk keys under which kvtier stores KV-cache blocks.

Token ids are cut into blocks of ``block_size_tokens``; only *full* blocks get
a key (a trailing partial block has none). A block's key hashes its parent's
key, its own tokens and optional extra keys (LoRA name, multimodal hashes...),
so a key names the whole prefix up to and including its block: two requests
share a key exactly when they share every token before it.

Keys never depend on a random seed, ``PYTHONHASHSEED`` or the host: the same
tokens give the same keys in every process on every machine.

Namespace
    :meth:`Namespace.key_prefix` is 16 bytes hashed from the model's
    :class:`KVFingerprint` (model name, KV dtype, layers, KV heads, head dim,
    block size, tensor-parallel shard) and a tenant. It is the first block's
    parent in ``XXH3_128`` mode and the first 16 bytes of every key in
    ``SHA256_CBOR`` mode, so KV bytes of two models, or of two shards of one
    model, are never confused, and tenants never share a chunk.

Modes (:class:`HashMode`)
    ``XXH3_128`` (default)
        Key = ``xxh3_128(parent || u32le(n_tokens) || tokens as u32le ||
        u32le(len(extra)) || extra)`` where ``extra`` is the canonical CBOR of
        the block's extra-key tuple (empty when there is none). 16 bytes.
    ``SHA256_CBOR``
        vLLM v1 compatibility: the chain is vLLM's prefix-caching block hash
        bit for bit (``sha256(cbor2.dumps((parent, tuple(tokens), extra_keys),
        canonical=True))`` seeded with ``NONE_HASH = sha256_cbor(seed)`` where
        ``seed`` is the vLLM process's ``PYTHONHASHSEED`` string, passed here
        explicitly as ``vllm_hash_seed``). vLLM's hash has no model in it, so
        the store key is ``namespace.key_prefix() || vllm_hash`` (48 bytes):
        the model namespace stays outside the vLLM hash, and a non-empty
        tenant also enters the vLLM hash as its ``cache_salt`` (the key
        ``("cache_salt", tenant)`` appended to the first block's extra keys, as vLLM
        0.32 tags it; hence every later block through the chain). See
        ``docs/keys.md``.

Thread safety
    A :class:`BlockHasher` is immutable after construction; any thread may use
    it concurrently.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NewType, cast

import cbor2
import numpy as np
import numpy.typing as npt
import xxhash

from kvstore.errors import InvalidArgument

__all__ = [
    "MAX_BLOCK_SIZE_TOKENS",
    "MAX_TOKEN_ID",
    "BlockHasher",
    "BlockTokensHash",
    "ExtraKeys",
    "HashMode",
    "KVDtype",
    "KVFingerprint",
    "Namespace",
    "PrefixKey",
    "VllmBlockHash",
]

PrefixKey = NewType("PrefixKey", bytes)
"""Chained key of one full block: names the whole prefix up to and including it.

This is what the store uses as a :data:`kvstore.dataplane.tier.ChunkKey`
(16 bytes in ``XXH3_128`` mode, 48 in ``SHA256_CBOR`` mode)."""

BlockTokensHash = NewType("BlockTokensHash", bytes)
"""xxh3_128 of one block's own tokens, without parent or namespace (16 bytes).

Equal for the same tokens at any position in any sequence: use it to compare
block *contents*, never as a chunk key."""

VllmBlockHash = NewType("VllmBlockHash", bytes)
"""vLLM v1's prefix-caching ``BlockHash`` (32 bytes, ``sha256_cbor`` mode)."""

ExtraKeys = tuple[Any, ...]
"""Per-block extra keys: a tuple of CBOR-encodable values (str, int, bytes, tuples)."""

MAX_TOKEN_ID = 2**32 - 1
"""Token ids are encoded as unsigned 32-bit integers."""

MAX_BLOCK_SIZE_TOKENS = 1 << 20

_PREFIX_BYTES = 16
_VLLM_HASH_BYTES = 32
_NAMESPACE_TAG = "kvtier.namespace"
_NAMESPACE_VERSION = 1


class KVDtype(enum.Enum):
    """Element type of the cached K/V tensors (torch's names)."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT8_E4M3FN = "float8_e4m3fn"
    FLOAT8_E5M2 = "float8_e5m2"

    @property
    def itemsize_bytes(self) -> int:
        return _ITEMSIZE_BYTES[self]

    @classmethod
    def from_torch(cls, dtype: object) -> KVDtype:
        """The member for a ``torch.dtype`` (e.g. ``torch.bfloat16``); torch is not imported."""
        name = str(dtype).removeprefix("torch.")
        try:
            return cls(name)
        except ValueError as exc:
            raise InvalidArgument(f"no KV dtype for {dtype!r}") from exc


_ITEMSIZE_BYTES = {
    KVDtype.FLOAT32: 4,
    KVDtype.FLOAT16: 2,
    KVDtype.BFLOAT16: 2,
    KVDtype.FLOAT8_E4M3FN: 1,
    KVDtype.FLOAT8_E5M2: 1,
}


class HashMode(enum.Enum):
    """How block keys are computed. See the module docstring for the exact encodings."""

    XXH3_128 = "xxh3_128"
    SHA256_CBOR = "sha256_cbor"


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidArgument(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class KVFingerprint:
    """Everything that makes two models' KV bytes for the same tokens differ.

    ``model`` names the weights (e.g. ``"meta-llama/Llama-3.1-8B@<revision>"``): two
    fine-tunes of one architecture have the same shape but different KV values.
    ``num_kv_heads`` counts the heads stored in one chunk, i.e. per tensor-parallel
    shard; ``tp_rank``/``tp_size`` keep the shards of one model apart.
    """

    model: str
    dtype: KVDtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size_tokens: int = 256
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise InvalidArgument(f"model must be a non-empty str, got {self.model!r}")
        if not isinstance(self.dtype, KVDtype):
            raise InvalidArgument(f"dtype must be a KVDtype, got {self.dtype!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size_tokens", "tp_size"):
            _check_positive_int(name, getattr(self, name))
        if self.block_size_tokens > MAX_BLOCK_SIZE_TOKENS:
            raise InvalidArgument(
                f"block_size_tokens must be <= {MAX_BLOCK_SIZE_TOKENS}, got {self.block_size_tokens}")
        if (not isinstance(self.tp_rank, int) or isinstance(self.tp_rank, bool)
                or not 0 <= self.tp_rank < self.tp_size):
            raise InvalidArgument(f"tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank!r}")


@dataclass(frozen=True, slots=True)
class Namespace:
    """A model fingerprint plus a tenant. Keys of different namespaces never collide.

    ``tenant`` is any string; ``""`` is the shared default tenant. In
    ``SHA256_CBOR`` mode a non-empty tenant is also vLLM's ``cache_salt``.
    """

    fingerprint: KVFingerprint
    tenant: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.fingerprint, KVFingerprint):
            raise InvalidArgument(f"fingerprint must be a KVFingerprint, got {self.fingerprint!r}")
        if not isinstance(self.tenant, str):
            raise InvalidArgument(f"tenant must be a str, got {type(self.tenant).__name__}")

    def key_prefix(self) -> bytes:
        """16 bytes identifying this namespace: xxh3_128 of its canonical CBOR encoding.

        The root parent of every chain in ``XXH3_128`` mode and the first 16 bytes
        of every key in ``SHA256_CBOR`` mode. Changing the encoding here changes
        every key: bump ``_NAMESPACE_VERSION`` and the golden vectors together.
        """
        fp = self.fingerprint
        fields = [_NAMESPACE_TAG, _NAMESPACE_VERSION, fp.model, fp.dtype.value, fp.num_layers,
                  fp.num_kv_heads, fp.head_dim, fp.block_size_tokens, fp.tp_rank, fp.tp_size,
                  self.tenant]
        return xxhash.xxh3_128_digest(cbor2.dumps(fields, canonical=True))


def _sha256_cbor(obj: object) -> bytes:
    """vLLM's ``sha256_cbor``: sha256 over ``cbor2.dumps(obj, canonical=True)``."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _cbor_head(major: int, value: int) -> bytes:
    """Canonical (shortest) CBOR head for ``major`` type with argument ``value``."""
    if value < 24:
        return bytes([major << 5 | value])
    if value < 1 << 8:
        return bytes([major << 5 | 24, value])
    if value < 1 << 16:
        return bytes([major << 5 | 25]) + value.to_bytes(2, "big")
    if value < 1 << 32:
        return bytes([major << 5 | 26]) + value.to_bytes(4, "big")
    return bytes([major << 5 | 27]) + value.to_bytes(8, "big")


def _cbor_u16_tables() -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.bool_]]:
    """Every id below 2**16 as canonical CBOR padded to 3 bytes (head, then the argument's
    bytes), and which of the 3 bytes its encoding uses: 192 KiB each."""
    v = np.arange(1 << 16, dtype=np.uint32)
    small, byte = v < 24, v < 256
    table = np.empty((1 << 16, 3), dtype=np.uint8)
    table[:, 0] = np.where(small, v, np.where(byte, 0x18, 0x19))
    table[:, 1] = np.where(byte, v, v >> 8)
    table[:, 2] = v & 0xFF
    used = np.empty((1 << 16, 3), dtype=bool)
    used[:, 0] = True
    used[:, 1] = ~small
    used[:, 2] = ~byte
    return table, used


_CBOR_U16, _CBOR_U16_USED = _cbor_u16_tables()


def _cbor_uints(tokens: npt.NDArray[np.uint32], block_size: int
                ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
    """Canonical CBOR of each token as an unsigned int, concatenated; plus block offsets.

    Byte-identical to ``b"".join(cbor2.dumps(int(t), canonical=True) for t in tokens)``
    but done in a few numpy passes instead of one Python call per token. ``len(tokens)``
    must be a multiple of ``block_size``; ``offsets[i]`` is where block ``i`` starts
    (``len + 1`` entries).

    Ids below 2**16 (every id of a vocabulary up to 65,536, the usual case) take rows of
    two 65,536-entry tables (:func:`_cbor_u16_tables`): 4 numpy calls, measured 2.5-4x
    faster than the general path from 1 to 128 blocks of 32 tokens (1 block: 16-24 -> 5 us,
    128: 96-155 -> 37-42 us, at load ~10), the sizes a routing decision hashes. Otherwise every token is first
    written as 5 bytes (head + big-endian u32), then the bytes its shortest form does not use
    are masked out; column writes and a per-block row sum there measured about 3x faster
    than per-token lookup tables of u32 width and a per-token cumsum.
    """
    n = tokens.size
    if n and int(tokens.max()) < 1 << 16:
        used = _CBOR_U16_USED.take(tokens, axis=0)
        encoded = _CBOR_U16.take(tokens, axis=0)[used]
        offsets = np.zeros(n // block_size + 1, dtype=np.int64)
        np.cumsum(used.reshape(-1, block_size * 3).sum(axis=1, dtype=np.int64),
                  out=offsets[1:])
        return encoded, offsets
    ge24, ge2to8, ge2to16 = tokens >= 24, tokens >= 1 << 8, tokens >= 1 << 16
    lengths = np.ones(n, dtype=np.uint32)
    lengths += ge24
    lengths += ge2to8
    lengths += ge2to16.view(np.uint8) * np.uint8(2)
    wide = np.empty((n, 5), dtype=np.uint8)
    wide[:, 1:] = tokens.astype(">u4").view(np.uint8).reshape(n, 4)
    # Head byte: 0x18/0x19/0x1a for a 1/2/4-byte argument; below 24, the value itself.
    head = ge2to8.view(np.uint8) + ge2to16.view(np.uint8) + np.uint8(0x18)
    np.copyto(head, tokens.astype(np.uint8), where=~ge24)
    wide[:, 0] = head
    keep = np.empty((n, 5), dtype=bool)
    keep[:, 0] = True
    keep[:, 1] = ge2to16
    keep[:, 2] = ge2to16
    keep[:, 3] = ge2to8
    keep[:, 4] = ge24
    offsets = np.zeros(n // block_size + 1, dtype=np.int64)
    np.cumsum(lengths.reshape(-1, block_size).sum(axis=1, dtype=np.int64), out=offsets[1:])
    return wide[keep], offsets


def _as_token_array(token_ids: object) -> npt.NDArray[np.uint32]:
    """Validate token ids and return them as a contiguous little-endian uint32 array.

    Accepts a list, tuple or range of ints, a 1-D integer numpy array or a 1-D
    integer torch tensor. No copy when given a contiguous ``<u4`` array.
    """
    if isinstance(token_ids, np.ndarray):
        arr: np.ndarray[Any, Any] = token_ids
    elif type(token_ids).__module__.split(".")[0] == "torch":
        tensor: Any = token_ids
        arr = tensor.detach().cpu().numpy()
    elif isinstance(token_ids, list | tuple | range):
        if len(token_ids) == 0:
            return np.empty(0, dtype="<u4")
        try:
            arr = np.asarray(token_ids)
        except (OverflowError, ValueError, TypeError) as exc:
            raise InvalidArgument(f"token ids must be ints: {exc}") from exc
    else:
        raise InvalidArgument(
            f"token ids must be a list, tuple, numpy array or torch tensor, not {type(token_ids).__name__}")
    if arr.ndim != 1:
        raise InvalidArgument(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and arr.dtype != np.uint32:  # (a uint32 is in range: no two passes over it)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > MAX_TOKEN_ID:
            raise InvalidArgument(f"token ids must be in [0, {MAX_TOKEN_ID}], got min {lo} max {hi}")
    return np.ascontiguousarray(arr, dtype="<u4")


def _encode_extra(extra: ExtraKeys | None) -> bytes | None:
    if extra is None:
        return None
    if not isinstance(extra, tuple):
        raise InvalidArgument(f"extra keys of a block must be a tuple or None, not {type(extra).__name__}")
    try:
        return cbor2.dumps(extra, canonical=True)
    except cbor2.CBOREncodeError as exc:
        raise InvalidArgument(f"extra keys are not CBOR-encodable: {exc}") from exc


class BlockHasher:
    """Computes the prefix keys of token sequences in one namespace and mode.

    Construction only validates and precomputes a few constant bytes.
    """

    __slots__ = ("_block_size", "_count_le", "_mode", "_namespace", "_prefix", "_root",
                 "_tenant_salt", "_vllm_array_head")

    def __init__(self, namespace: Namespace, *, mode: HashMode = HashMode.XXH3_128,
                 block_size_tokens: int | None = None, vllm_hash_seed: str | None = None) -> None:
        """``block_size_tokens``, when given, must equal the fingerprint's (a guard
        against a caller's stale copy). ``vllm_hash_seed`` is required in, and only
        allowed in, ``SHA256_CBOR`` mode: the ``PYTHONHASHSEED`` string of the vLLM
        processes whose hashes must be matched (vLLM hashes are random otherwise).
        """
        if not isinstance(namespace, Namespace):
            raise InvalidArgument(f"namespace must be a Namespace, got {namespace!r}")
        if not isinstance(mode, HashMode):
            raise InvalidArgument(f"mode must be a HashMode, got {mode!r}")
        block = namespace.fingerprint.block_size_tokens
        if block_size_tokens is not None and block_size_tokens != block:
            raise InvalidArgument(
                f"block_size_tokens={block_size_tokens!r} differs from the fingerprint's {block}")
        self._namespace = namespace
        self._mode = mode
        self._block_size = block
        self._prefix = namespace.key_prefix()
        self._count_le = struct.pack("<I", block)
        self._vllm_array_head = _cbor_head(4, block)
        self._tenant_salt = namespace.tenant
        if mode is HashMode.SHA256_CBOR:
            if not isinstance(vllm_hash_seed, str):
                raise InvalidArgument("SHA256_CBOR mode needs vllm_hash_seed: the vLLM "
                                      "processes' PYTHONHASHSEED string")
            # vLLM's init_none_hash: NONE_HASH = sha256_cbor(os.getenv("PYTHONHASHSEED")).
            self._root = _sha256_cbor(vllm_hash_seed)
        else:
            if vllm_hash_seed is not None:
                raise InvalidArgument("vllm_hash_seed only applies to HashMode.SHA256_CBOR")
            self._root = self._prefix

    @property
    def namespace(self) -> Namespace:
        return self._namespace

    @property
    def mode(self) -> HashMode:
        return self._mode

    @property
    def block_size_tokens(self) -> int:
        return self._block_size

    @property
    def key_size_bytes(self) -> int:
        """Length of every key this hasher returns (16 or 48)."""
        return _PREFIX_BYTES if self._mode is HashMode.XXH3_128 else _PREFIX_BYTES + _VLLM_HASH_BYTES

    def num_full_blocks(self, num_tokens: int) -> int:
        """How many keys ``num_tokens`` tokens get (the trailing partial block gets none)."""
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise InvalidArgument(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        return num_tokens // self._block_size

    def hash_blocks(self, token_ids: object, parent: PrefixKey | None = None,
                    extra_keys: Sequence[ExtraKeys | None] | None = None) -> list[PrefixKey]:
        """Keys of the full blocks of ``token_ids``, in order.

        ``parent`` is the key of the block just before ``token_ids[0]`` (None: the
        tokens start a sequence). ``hash_blocks(t[k*B:], parent=keys[k-1])`` equals
        ``hash_blocks(t)[k:]``. ``extra_keys``, when given, has one entry (a tuple,
        or None) per full block. In ``SHA256_CBOR`` mode a non-empty tenant is
        appended to the first block's extra keys when ``parent`` is None, exactly as
        vLLM appends ``cache_salt`` (after LoRA and multimodal keys), as the tagged key
        ``("cache_salt", tenant)``; the caller's extra keys are vLLM's own (tagged) keys.

        Raises InvalidArgument for bad token ids, a parent of the wrong length or
        (in ``SHA256_CBOR`` mode) of another namespace, or mismatched extra keys.
        """
        tokens = _as_token_array(token_ids)
        n_blocks = tokens.size // self._block_size
        extras = self._block_extras(n_blocks, parent is None, extra_keys)
        if n_blocks == 0:
            return []
        tokens = tokens[: n_blocks * self._block_size]
        if self._mode is HashMode.XXH3_128:
            return self._chain_xxh3(tokens, self._parent_xxh3(parent), extras)
        return self._chain_sha256_cbor(tokens, self._parent_vllm(parent), extras)

    def block_token_hashes(self, token_ids: object) -> list[BlockTokensHash]:
        """xxh3_128 of each full block's own token bytes (u32le), same in both modes."""
        tokens = _as_token_array(token_ids)
        n_bytes = self._block_size * 4
        view = tokens[: tokens.size // self._block_size * self._block_size].data.cast("B")
        digest = xxhash.xxh3_128_digest
        return [BlockTokensHash(digest(view[i : i + n_bytes])) for i in range(0, len(view), n_bytes)]

    def key_from_vllm_hash(self, block_hash: bytes) -> PrefixKey:
        """The store key of a block whose vLLM hash an engine already computed.

        Lets a vLLM connector skip rehashing: ``key_from_vllm_hash(request.block_hashes[i])``
        equals ``hash_blocks(...)[i]`` when vLLM used ``sha256_cbor``, this seed and
        ``cache_salt == tenant``. ``SHA256_CBOR`` mode only.
        """
        self._require_compat("key_from_vllm_hash")
        if not isinstance(block_hash, bytes) or len(block_hash) != _VLLM_HASH_BYTES:
            raise InvalidArgument(f"a vLLM sha256_cbor block hash is {_VLLM_HASH_BYTES} bytes")
        return PrefixKey(self._prefix + block_hash)

    def vllm_block_hash(self, key: PrefixKey) -> VllmBlockHash:
        """The vLLM block hash inside a ``SHA256_CBOR`` key of this namespace."""
        self._require_compat("vllm_block_hash")
        return self._parent_vllm(key)

    # -- internals -----------------------------------------------------------------

    def _require_compat(self, what: str) -> None:
        if self._mode is not HashMode.SHA256_CBOR:
            raise InvalidArgument(f"{what} needs HashMode.SHA256_CBOR, this hasher is {self._mode.value}")

    def _parent_xxh3(self, parent: PrefixKey | None) -> bytes:
        if parent is None:
            return self._root
        if not isinstance(parent, bytes) or len(parent) != _PREFIX_BYTES:
            raise InvalidArgument(f"parent must be a {_PREFIX_BYTES}-byte xxh3_128 prefix key")
        return parent

    def _parent_vllm(self, key: PrefixKey | None) -> VllmBlockHash:
        if key is None:
            return VllmBlockHash(self._root)
        if (not isinstance(key, bytes) or len(key) != _PREFIX_BYTES + _VLLM_HASH_BYTES
                or key[:_PREFIX_BYTES] != self._prefix):
            raise InvalidArgument("key is not a sha256_cbor prefix key of this namespace")
        return VllmBlockHash(key[_PREFIX_BYTES:])

    def _block_extras(self, n_blocks: int, starts_sequence: bool,
                      extra_keys: Sequence[ExtraKeys | None] | None) -> list[bytes | None] | None:
        """Encoded extra keys per block, or None when no block has any."""
        if extra_keys is not None:
            if isinstance(extra_keys, tuple | str | bytes) or not isinstance(extra_keys, Sequence):
                raise InvalidArgument("extra_keys must be a list with one tuple (or None) per full block")
            if len(extra_keys) != n_blocks:
                raise InvalidArgument(
                    f"extra_keys has {len(extra_keys)} entries for {n_blocks} full blocks")
        salt = (self._mode is HashMode.SHA256_CBOR and starts_sequence and self._tenant_salt
                and n_blocks > 0)
        if extra_keys is None and not salt:
            return None
        per_block: list[ExtraKeys | None] = list(extra_keys) if extra_keys is not None else [None] * n_blocks
        if salt:
            # vLLM (0.32, kv_cache_utils.generate_block_hash_extra_keys): extra_keys =
            # lora + mm + [("cache_salt", salt)] (first block only) + prompt_embeds.
            per_block[0] = (*(per_block[0] or ()), ("cache_salt", self._tenant_salt))
        return [_encode_extra(e) for e in per_block]

    # The two chain loops below run once per block (8,192 times for 128k tokens in
    # blocks of 16), so each iteration is one join and one one-shot digest over
    # zero-copy memoryview slices: measured faster than streaming hash objects with
    # several update() calls, or than per-iteration NewType calls (the lists are cast
    # to list[PrefixKey] once instead; a NewType is the identity at runtime).

    def _chain_xxh3(self, tokens: npt.NDArray[np.uint32], parent: bytes,
                    extras: list[bytes | None] | None) -> list[PrefixKey]:
        view = tokens.data.cast("B")  # zero-copy: tokens are contiguous <u4
        n_bytes = self._block_size * 4
        count_le = self._count_le
        digest = xxhash.xxh3_128_digest
        join = b"".join
        keys: list[bytes] = []
        append = keys.append
        if extras is None:
            no_extra = b"\x00\x00\x00\x00"  # u32le(0): no extra-key bytes
            for start in range(0, len(view), n_bytes):
                parent = digest(join((parent, count_le, view[start : start + n_bytes], no_extra)))
                append(parent)
        else:
            tails = [struct.pack("<I", len(e or b"")) + (e or b"") for e in extras]
            for i, start in enumerate(range(0, len(view), n_bytes)):
                parent = digest(join((parent, count_le, view[start : start + n_bytes], tails[i])))
                append(parent)
        return cast("list[PrefixKey]", keys)

    def _chain_sha256_cbor(self, tokens: npt.NDArray[np.uint32], parent: bytes,
                           extras: list[bytes | None] | None) -> list[PrefixKey]:
        # vLLM hashes cbor2.dumps((parent, tuple(tokens), extra_keys), canonical=True):
        # a 3-array, a 32-byte byte string, an array of uints, then the extra keys
        # (CBOR null when None). The tokens' CBOR is built for all blocks at once.
        encoded, offsets = _cbor_uints(tokens, self._block_size)
        view = encoded.data
        bounds: list[int] = offsets.tolist()
        head = b"\x83" + _cbor_head(2, _VLLM_HASH_BYTES)  # array(3), bytes(32)
        array_head = self._vllm_array_head
        null = b"\xf6"
        tails = [null] * (len(bounds) - 1) if extras is None else [e or null for e in extras]
        prefix = self._prefix
        sha256 = hashlib.sha256
        join = b"".join
        keys: list[bytes] = []
        append = keys.append
        for i, tail in enumerate(tails):
            parent = sha256(join((head, parent, array_head, view[bounds[i] : bounds[i + 1]],
                                  tail))).digest()
            append(prefix + parent)
        return cast("list[PrefixKey]", keys)
