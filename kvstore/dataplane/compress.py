"""Optional per-tier compression of chunks: none (the default), lz4, zstd, with byte shuffle.

Why off by default: raw fp16/bf16 KV barely compresses. lz4 finds nothing (ratio
1.00 on fp16); zstd-1 gains ~15-20 % only after a *byte shuffle* (all low bytes,
then all high bytes: the high bytes hold sign and exponent, which repeat a lot).
It costs ~0.3-1 GB/s of CPU per core against ~10-20 GB/s for a memcpy, so it only
pays where capacity is worth far more than bandwidth. docs/dram-arena.md has the
measurements.

Contract of a :class:`Codec`:

* ``compress(src)`` returns the compressed bytes, or ``None`` when they would not
  be at least ``spec.min_saving`` smaller than ``src`` (the caller then stores the
  raw bytes: incompressible chunks cost one failed attempt, never extra space).
* ``decompress_into(src, dst)`` fills ``dst`` (exactly the logical size) or raises
  :class:`~kvstore.errors.ChunkCorrupt`: every frame carries a content checksum
  (lz4 frame / zstd frame checksums), so flipped bits are detected, not returned.
* Both are thread-safe (zstd contexts are per thread; lz4 frame calls are stateless).
* Each call allocates its output (the bindings have no compress-into API): one extra
  copy at memcpy speed next to a codec running ~20x slower, measured and accepted.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvstore.errors import ChunkCorrupt, InvalidArgument


class CodecKind(enum.Enum):
    """Compression algorithm of a stored chunk."""

    NONE = "none"
    LZ4 = "lz4"
    ZSTD = "zstd"


@dataclass(frozen=True, slots=True)
class CodecSpec:
    """How a tier compresses. ``shuffle_bytes``: element size to byte-shuffle by (2 for fp16)."""

    kind: CodecKind = CodecKind.NONE
    level: int = 1
    shuffle_bytes: int = 0
    min_saving: float = 0.03
    """Store compressed only when it saves at least this fraction of the chunk."""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, CodecKind):
            raise InvalidArgument(f"codec kind must be a CodecKind, not {self.kind!r}")
        if self.shuffle_bytes not in (0, 2, 4, 8):
            raise InvalidArgument(
                f"shuffle_bytes must be 0, 1, 2, 4 or 8, got {self.shuffle_bytes}"
            )
        if not 0.0 <= self.min_saving < 1.0:
            raise InvalidArgument(f"min_saving must be in [0, 1), got {self.min_saving}")
        if self.kind is CodecKind.ZSTD and not 1 <= self.level <= 22:
            raise InvalidArgument(f"zstd level must be 1..22, got {self.level}")
        if self.kind is CodecKind.LZ4 and not 0 <= self.level <= 16:
            raise InvalidArgument(f"lz4 level must be 0..16, got {self.level}")


class Codec(Protocol):
    """A compression algorithm bound to its settings. See the module docstring."""

    @property
    def spec(self) -> CodecSpec: ...

    def compress(self, src: memoryview) -> bytes | None: ...

    def decompress_into(self, src: memoryview, dst: memoryview) -> None: ...


def make_codec(spec: CodecSpec) -> Codec | None:
    """The codec for ``spec``; ``None`` for ``CodecKind.NONE`` (store raw)."""
    if spec.kind is CodecKind.NONE:
        return None
    if spec.kind is CodecKind.LZ4:
        return _Lz4Codec(spec)
    return _ZstdCodec(spec)


# --- byte shuffle -----------------------------------------------------------------------------


_UINT_BY_BYTES = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def shuffle(src: memoryview, element_bytes: int) -> np.ndarray:
    """Group byte ``i`` of every element together: ``[a0 b0 a1 b1] -> [a0 a1 b0 b1]``.

    A trailing partial element is appended unchanged. Returns a new uint8 array.
    Done with shifts on the element viewed as an unsigned int (contiguous, vectorised:
    ~13 GB/s for fp16 here) rather than a strided transpose (~3 GB/s; its inverse ~0.4).
    Byte ``i`` is the ``i``-th least significant (memory order on little-endian hosts).
    """
    flat = np.frombuffer(src, dtype=np.uint8)
    count = flat.size // element_bytes
    whole = count * element_bytes
    out = np.empty(flat.size, dtype=np.uint8)
    if count:
        elements = flat[:whole].view(_UINT_BY_BYTES[element_bytes])
        for i in range(element_bytes):
            np.right_shift(elements, 8 * i, out=out[i * count : (i + 1) * count], casting="unsafe")
    out[whole:] = flat[whole:]
    return out


def unshuffle_into(shuffled: Any, dst: memoryview, element_bytes: int) -> None:
    """Inverse of :func:`shuffle`, writing straight into ``dst`` (same length)."""
    flat = np.frombuffer(shuffled, dtype=np.uint8)
    out = np.frombuffer(dst, dtype=np.uint8)
    count = flat.size // element_bytes
    whole = count * element_bytes
    if count:
        uint = _UINT_BY_BYTES[element_bytes]
        elements = out[:whole].view(uint)
        np.copyto(elements, flat[:count], casting="unsafe")
        part = np.empty(count, dtype=uint)
        for i in range(1, element_bytes):
            np.left_shift(flat[i * count : (i + 1) * count], 8 * i, out=part, dtype=uint)
            np.bitwise_or(elements, part, out=elements)
    out[whole:] = flat[whole:]


# --- codecs -----------------------------------------------------------------------------------


class _BaseCodec:
    _decode_errors: tuple[type[BaseException], ...] = ()
    """What the library raises for a malformed frame (translated to ChunkCorrupt)."""

    def __init__(self, spec: CodecSpec) -> None:
        self._spec = spec
        self._shuffle = spec.shuffle_bytes > 0

    @property
    def spec(self) -> CodecSpec:
        return self._spec

    def _encode(self, data: Any) -> bytes:
        raise NotImplementedError

    def _decode(self, src: memoryview, size_bytes: int) -> bytes:
        """Decompress; raise the library's error on a bad frame (translated by the caller)."""
        raise NotImplementedError

    def compress(self, src: memoryview) -> bytes | None:
        data: Any = shuffle(src, self._spec.shuffle_bytes) if self._shuffle else src
        packed = self._encode(data)
        if len(packed) > src.nbytes * (1.0 - self._spec.min_saving):
            return None
        return packed

    def decompress_into(self, src: memoryview, dst: memoryview) -> None:
        try:
            raw = self._decode(src, dst.nbytes)
        except self._decode_errors as exc:
            raise ChunkCorrupt(f"{self._spec.kind.value} frame failed to decode: {exc}") from exc
        if len(raw) != dst.nbytes:
            raise ChunkCorrupt(
                f"{self._spec.kind.value} frame decoded to {len(raw)} bytes, expected {dst.nbytes}"
            )
        if self._shuffle:
            unshuffle_into(raw, dst, self._spec.shuffle_bytes)
        else:
            dst[:] = raw


class _Lz4Codec(_BaseCodec):
    def __init__(self, spec: CodecSpec) -> None:
        super().__init__(spec)
        import lz4.frame

        self._frame = lz4.frame
        self._decode_errors = (RuntimeError,)  # lz4 raises RuntimeError for bad frames

    def _encode(self, data: Any) -> bytes:
        out: bytes = self._frame.compress(
            data, compression_level=self._spec.level, content_checksum=True, store_size=True
        )
        return out

    def _decode(self, src: memoryview, size_bytes: int) -> bytes:
        out: bytes = self._frame.decompress(src)
        return out


class _ZstdCodec(_BaseCodec):
    def __init__(self, spec: CodecSpec) -> None:
        super().__init__(spec)
        import zstandard

        self._zstd = zstandard
        self._decode_errors = (zstandard.ZstdError,)
        # zstd contexts must not be shared between threads: one pair per thread.
        self._local = threading.local()

    def _contexts(self) -> tuple[Any, Any]:
        pair: tuple[Any, Any] | None = getattr(self._local, "pair", None)
        if pair is None:
            pair = (
                self._zstd.ZstdCompressor(level=self._spec.level, write_checksum=True),
                self._zstd.ZstdDecompressor(),
            )
            self._local.pair = pair
        return pair

    def _encode(self, data: Any) -> bytes:
        out: bytes = self._contexts()[0].compress(data)
        return out

    def _decode(self, src: memoryview, size_bytes: int) -> bytes:
        out: bytes = self._contexts()[1].decompress(src, max_output_size=size_bytes)
        return out
