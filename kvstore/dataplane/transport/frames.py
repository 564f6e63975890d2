"""The kvtier data-plane frame: a fixed 64-byte header, then the key, then the payload.

::

    offset size field        meaning
    0      4    magic        b"KVTR"
    4      1    version      1
    5      1    opcode       Opcode
    6      2    flags        Flags
    8      2    status       Status (0 in requests)
    10     2    key_len      key bytes that follow the header (0..64; responses carry none)
    12     4    reserved     0
    16     8    request_id   chosen by the client, echoed in the response
    24     8    transfer_id  multi-part PUT reservation (assigned by the server on PUT_BEGIN)
    32     8    offset       first byte of the range this frame is about
    40     8    length       byte count of that range
    48     8    total_size   the whole value's size (requests: the size the client expects)
    56     8    payload_len  payload bytes that follow the key

All integers little-endian. *Framing never depends on meaning*: a receiver always reads exactly
``key_len`` then ``payload_len`` bytes after the header, so it can skip (drain) the payload of a
request it refuses and stay in step. A frame whose header is malformed, whose key is longer than
64 bytes, or whose ``payload_len``/``total_size`` exceeds the receiver's configured maximum is a
``ProtocolError``: the receiver answers with status ``PROTOCOL`` (best effort) and closes.

Error responses carry a short UTF-8 detail message as payload.

The header is a ``NamedTuple`` rather than a validating frozen dataclass on purpose: one is built
per frame on the hot path, ``Header._make(struct.unpack_from(...))`` costs a fraction of a
dataclass ``__init__``, and :func:`decode_header` does the validation instead.
"""

from __future__ import annotations

import enum
import struct
from typing import Any, NamedTuple

from kvstore.dataplane.tier import MAX_KEY_BYTES
from kvstore.errors import (
    CapacityError,
    ChunkBusy,
    ChunkCorrupt,
    ChunkExists,
    ChunkNotFound,
    DiskFull,
    InvalidArgument,
    KvtierError,
    PeerUnavailable,
    PermissionDenied,
    ProtocolError,
    SizeMismatch,
    StorageError,
    TierUnavailable,
    TransportError,
    Unauthenticated,
)

MAGIC = b"KVTR"
VERSION = 1
HEADER = struct.Struct("<4sBBHHHIQQQQQQ")
HEADER_BYTES = HEADER.size
assert HEADER_BYTES == 64, HEADER_BYTES

DEFAULT_MAX_VALUE_BYTES = 1 << 30
MAX_DETAIL_BYTES = 1024
"""Longest error detail a peer may send; longer ones are cut by the sender."""


class Opcode(enum.IntEnum):
    PING = 1
    PUT = 2
    """Whole value in one frame: offset 0, length == total_size == payload_len."""
    GET = 3
    """Whole value; request total_size is the size the client expects unless Flags.ANY_SIZE."""
    GET_RANGE = 4
    """[offset, offset+length) of a value of total_size (ANY_SIZE: any size, range clipped)."""
    EXISTS = 5
    """Response: status OK with total_size, or NOT_FOUND."""
    REMOVE = 6
    PUT_BEGIN = 7
    """Reserve total_size bytes for key; the response carries the transfer_id."""
    PUT_PART = 8
    """Bytes [offset, offset+length) of a reserved value; the part that completes it commits."""
    PUT_ABORT = 9
    """Drop a reservation (best effort: an abandoned one also expires)."""
    HELLO = 10
    """The session ticket (the payload, at most ``MAX_TICKET_BYTES``), as the first frame of a
    connection to a server that requires one; the response is OK, or ``UNAUTHENTICATED`` /
    ``PERMISSION_DENIED`` and the close. A server without an authorizer answers OK."""


class Flags(enum.IntFlag):
    NONE = 0
    ANY_SIZE = 1
    """GET/GET_RANGE request: do not check total_size; the response says the real size."""
    COMMITTED = 2
    """PUT_PART response: this part completed the value, which is now visible."""
    MORE = 4
    """Request: further pipelined requests follow at once. The server may hold the response back
    (``MSG_MORE``) so that a batch's responses share segments and wake the client once; the
    response to a request without it flushes them. The server reads the announced request
    without waiting for shutdown signals, so a client that never sends it has its connection
    treated as stalled (closed after ``io_timeout_s``, or cut at the end of a drain)."""


class Status(enum.IntEnum):
    OK = 0
    NOT_FOUND = 1
    EXISTS = 2
    BUSY = 3
    SIZE_MISMATCH = 4
    CAPACITY = 5
    DISK_FULL = 6
    CORRUPT = 7
    STORAGE = 8
    UNAVAILABLE = 9
    BAD_REQUEST = 10
    PROTOCOL = 11
    UNKNOWN_TRANSFER = 12
    """The reservation expired, was aborted, or never existed."""
    SHUTTING_DOWN = 13
    INTERNAL = 14
    UNAUTHENTICATED = 15
    """No session ticket, or one that does not verify (forged, stale, expired)."""
    PERMISSION_DENIED = 16


# int -> member tables: a dict lookup is several times cheaper than calling the Enum class.
_OPCODES: dict[int, Opcode] = {int(op): op for op in Opcode}
_STATUSES: dict[int, Status] = {int(s): s for s in Status}
_ALL_FLAGS = int(Flags.ANY_SIZE | Flags.COMMITTED | Flags.MORE)
_ANY_SIZE = int(Flags.ANY_SIZE)
"""With it, a request's ``length`` is only a cap (the answer is clipped to the stored value,
which is never larger than the maximum), so it is not checked against ``max_value_bytes``:
``TcpClient.get`` asks for up to ``stripe_threshold_bytes`` of a value of any size, also from a
server whose maximum is smaller."""


class Header(NamedTuple):
    """One decoded frame header (see the module docstring for each field)."""

    opcode: Opcode
    flags: int
    status: Status
    key_len: int
    request_id: int
    transfer_id: int
    offset: int
    length: int
    total_size: int
    payload_len: int


def pack_header(
    buf: bytearray,
    opcode: Opcode,
    *,
    flags: int = 0,
    status: Status = Status.OK,
    key_len: int = 0,
    request_id: int = 0,
    transfer_id: int = 0,
    offset: int = 0,
    length: int = 0,
    total_size: int = 0,
    payload_len: int = 0,
    at: int = 0,
) -> bytearray:
    """Write a header into ``buf[at:at + HEADER_BYTES]`` (buffers are reused per connection, so
    the hot path allocates nothing) and return ``buf``."""
    try:
        HEADER.pack_into(buf, at, MAGIC, VERSION, opcode, flags, status, key_len, 0, request_id,
                         transfer_id, offset, length, total_size, payload_len)
    except struct.error as exc:
        raise InvalidArgument(f"frame field out of range: {exc}") from exc
    return buf


def decode_header(buf: bytes | bytearray | memoryview, max_value_bytes: int, at: int = 0
                  ) -> Header:
    """Parse and validate the header at ``buf[at:at + HEADER_BYTES]``. Raises ProtocolError for
    anything malformed or oversized.

    Hot path (one call per frame on each side): one ``unpack_from`` and one combined test; the
    diagnosis of a bad header is left to :func:`_header_error`, off the hot path.
    """
    fields = _UNPACK_FROM(buf, at)
    (magic, version, opcode, flags, status, key_len, reserved, request_id, transfer_id, offset,
     length, total_size, payload_len) = fields
    op = _OPCODES.get(opcode)
    st = _STATUSES.get(status)
    if (op is None or st is None or magic != MAGIC or version != VERSION
            or flags & ~_ALL_FLAGS or reserved or key_len > MAX_KEY_BYTES
            or total_size > max_value_bytes
            or (offset + length > max_value_bytes and not flags & _ANY_SIZE)
            or (payload_len > max_value_bytes and payload_len > MAX_DETAIL_BYTES)):
        raise _header_error(fields, max_value_bytes)
    return _new_header(Header, (op, flags, st, key_len, request_id, transfer_id, offset, length,
                                total_size, payload_len))


_UNPACK_FROM = HEADER.unpack_from
_new_header = tuple.__new__  # Header._make without its classmethod and iterable checks


def _header_error(fields: tuple[Any, ...], max_value_bytes: int) -> ProtocolError:
    """Why a header :func:`decode_header` refused is bad (the first reason found)."""
    (magic, version, opcode, flags, status, key_len, reserved, _request_id, _transfer_id, offset,
     length, total_size, payload_len) = fields
    if magic != MAGIC:
        return ProtocolError(f"bad frame magic {bytes(magic)!r}")
    if version != VERSION:
        return ProtocolError(f"unsupported frame version {version} (this side speaks {VERSION})")
    if opcode not in _OPCODES:
        return ProtocolError(f"unknown opcode {opcode}")
    if status not in _STATUSES:
        return ProtocolError(f"unknown status {status}")
    if flags & ~_ALL_FLAGS or reserved:
        return ProtocolError(f"unknown flags {flags:#x} or reserved bits {reserved:#x} set")
    if key_len > MAX_KEY_BYTES:
        return ProtocolError(f"key of {key_len} bytes exceeds the {MAX_KEY_BYTES}-byte maximum")
    if offset + length > max_value_bytes and not flags & _ANY_SIZE and \
            total_size <= max_value_bytes and \
            payload_len <= max(max_value_bytes, MAX_DETAIL_BYTES):
        return ProtocolError(f"range [{offset}, {offset + length}) exceeds the "
                             f"{max_value_bytes}-byte maximum")
    return ProtocolError(
        f"frame of {payload_len} payload bytes (value {total_size} bytes) exceeds the "
        f"{max_value_bytes}-byte maximum")


# --- status <-> error translation (the boundary between the wire and kvstore.errors) --------------

# Most specific class first: DiskFull before CapacityError, SizeMismatch before InvalidArgument.
_STATUS_FOR_ERROR: tuple[tuple[type[KvtierError], Status], ...] = (
    (ChunkNotFound, Status.NOT_FOUND),
    (ChunkExists, Status.EXISTS),
    (ChunkBusy, Status.BUSY),
    (SizeMismatch, Status.SIZE_MISMATCH),
    (DiskFull, Status.DISK_FULL),
    (CapacityError, Status.CAPACITY),
    (ChunkCorrupt, Status.CORRUPT),
    (StorageError, Status.STORAGE),
    (TierUnavailable, Status.UNAVAILABLE),
    (InvalidArgument, Status.BAD_REQUEST),
    (ProtocolError, Status.PROTOCOL),
    (Unauthenticated, Status.UNAUTHENTICATED),
    (PermissionDenied, Status.PERMISSION_DENIED),
)


def status_for_error(exc: KvtierError) -> Status:
    """The wire status for an error a backend raised (INTERNAL for anything unexpected)."""
    for cls, status in _STATUS_FOR_ERROR:
        if isinstance(exc, cls):
            return status
    return Status.INTERNAL


def error_for_status(header: Header, key: bytes, detail: str, *, expected_size: int = -1
                     ) -> KvtierError:
    """The client-side error for a non-OK response. ``detail`` is the peer's message."""
    status = header.status
    msg = f"peer: {detail}" if detail else f"peer answered {status.name}"
    if status is Status.NOT_FOUND:
        return ChunkNotFound(key, "the peer")
    if status is Status.EXISTS:
        return ChunkExists(msg)
    if status is Status.BUSY:
        return ChunkBusy(msg)
    if status is Status.SIZE_MISMATCH:
        return SizeMismatch(f"chunk {key.hex()} has another size than the buffer",
                            expected=header.total_size, actual=expected_size)
    if status is Status.DISK_FULL:
        return DiskFull(msg)
    if status is Status.CAPACITY:
        return CapacityError(msg)
    if status is Status.CORRUPT:
        return ChunkCorrupt(msg)
    if status is Status.STORAGE:
        return StorageError(msg)
    if status is Status.UNAVAILABLE:
        return TierUnavailable(msg)
    if status is Status.BAD_REQUEST:
        return InvalidArgument(msg)
    if status is Status.PROTOCOL:
        return ProtocolError(msg)
    if status is Status.UNAUTHENTICATED:
        return Unauthenticated(msg)
    if status is Status.PERMISSION_DENIED:
        return PermissionDenied(msg)
    if status is Status.SHUTTING_DOWN:
        return PeerUnavailable(msg)
    if status is Status.UNKNOWN_TRANSFER:
        return TransportError(f"multi-part put of {key.hex()} was dropped by the peer ({msg})")
    return TransportError(msg)
