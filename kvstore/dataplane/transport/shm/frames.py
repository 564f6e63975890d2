"""The same-host lease channel's frames, shared by its server (:mod:`.server`) and client
(:mod:`.channel`, :mod:`.client`).

Errors in its replies travel by class name, as on every kvtier wire (:mod:`kvstore.wire`).

The lease channel
    A Unix stream socket in the abstract namespace (``@kvtier-...``, so nothing is left on disk
    after a ``kill -9``), served by :class:`~.server.ShmServer`. Same-host clients use it
    instead of gRPC for the shared-memory data plane because a round trip costs ~30 µs here
    instead of ~400 µs, and because its leases are tied to the connection: when the client
    process dies, the kernel closes the socket and the daemon ends its leases at once.

    Request: a 24-byte header :data:`REQUEST` (op, flags, key count, body length, argument,
    TTL in seconds), then the body: each key as one length byte and the key bytes. Reply: a
    16-byte header :data:`REPLY` (status, range count, detail length, lease id), then
    ``count`` ranges of :data:`RANGE` (arena offset, size), then the detail text (for an error:
    ``"<ErrorClass>\\n<message>"``). A PUT request's body carries the value after its keys.
    Requests on one connection are served in order; a request with :data:`FLAG_NO_REPLY`
    (RELEASE, READS) gets no reply, so a leased get costs one round trip. Gets of chunks the
    read index publishes cost none (:mod:`kvstore.dataplane.read_index`): the client reports
    them afterwards with READS.
"""

from __future__ import annotations

import enum
import struct

from kvstore import errors

# --- the lease channel ---------------------------------------------------------------------------


class ChannelOp(enum.IntEnum):
    ACQUIRE_READ = 1
    """keys -> lease id and one range per leased key. FLAG_PREFIX: the longest cached prefix."""
    RELEASE = 2
    """argument = lease id. Usually sent with FLAG_NO_REPLY."""
    RESERVE = 3
    """keys = [key, parent (empty: none)], argument = size -> lease id and one range."""
    COMMIT = 4
    """argument = lease id."""
    ABORT = 5
    """argument = lease id."""
    PING = 6
    PUT = 7
    """keys = [key, parent (empty: none)], argument = value size; the value follows the keys
    in the body. For small values: one round trip instead of RESERVE + COMMIT."""
    READS = 8
    """keys a client copied lease-free through the read index (a key may repeat), reported
    in batches, usually with FLAG_NO_REPLY: the daemon counts them as hits and refreshes
    their recency for eviction."""
    PUT_MANY = 9
    """keys = root chunks; the body's tail (``argument`` bytes) is one u64 size per key, then
    the values back to back. Stored in order; the reply's detail is one byte per key (0:
    stored, 1: already stored). Another refusal is an error reply, after the earlier values
    were stored."""
    RESERVE_MANY = 10
    """keys = root chunks; tail = one u64 size per key -> one RANGE per key as (arena offset,
    lease id), lease id 0 where the key is already stored. All or nothing otherwise."""
    COMMIT_MANY = 11
    """no keys; tail = u64 lease ids -> every one is committed; the first failure (if any) is
    the error reply."""
    SIZE_OF = 12
    """keys -> one RANGE per key: (1, size) when it is committed, (0, 0) when not."""
    REMOVE = 13
    """keys = [key] -> lease id 1 when it was removed, 0 when it was not held. ChunkBusy while
    it is leased."""


FLAG_PREFIX = 1
FLAG_NO_REPLY = 2

STATUS_OK = 0
STATUS_ERROR = 1
STATUS_CLOSING = 2
"""An error reply after which the server closes the connection (a malformed frame, a frame
that came too slowly, the connection limit): the client raises the error and drops the
connection."""

REQUEST = struct.Struct("<BBHIQd")
"""op, flags, key count, body bytes, argument (size or lease id), TTL seconds (0: default)."""
REPLY = struct.Struct("<BxHIQ")
"""status, range count, detail bytes, lease id."""
RANGE = struct.Struct("<QQ")
"""arena offset, size in bytes."""
TAIL_OPS = frozenset({7, 9, 10, 11})
"""Ops whose body ends with ``argument`` bytes that are not keys (values, sizes, lease ids)."""
MAX_BODY_BYTES = 1 << 20
MAX_KEYS = 4096
INLINE_PUT_MAX_BYTES = 64 << 10
"""Values up to this size travel inside a PUT request; larger ones are RESERVEd and copied."""


def pack_keys(keys: list[bytes]) -> bytes:
    """The request body: each key as a length byte and its bytes (a key may be empty)."""
    parts = bytearray()
    for key in keys:
        if len(key) > 255:
            raise errors.InvalidArgument(f"key of {len(key)} bytes is too long")
        parts.append(len(key))
        parts += key
    return bytes(parts)


def unpack_keys(body: bytes | memoryview, count: int) -> list[bytes]:
    """Inverse of :func:`pack_keys`. Raises ProtocolError on a malformed body."""
    keys: list[bytes] = []
    pos = 0
    view = memoryview(body)
    for _ in range(count):
        if pos >= len(view):
            raise errors.ProtocolError("lease channel body ends before its keys do")
        n = view[pos]
        keys.append(bytes(view[pos + 1:pos + 1 + n]))
        pos += 1 + n
    if pos != len(view):
        raise errors.ProtocolError(f"lease channel body has {len(view) - pos} stray bytes")
    return keys
