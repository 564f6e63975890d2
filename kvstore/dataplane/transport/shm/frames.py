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
    """keys = root chunks (FLAG_PARENTS: [key, parent (empty: none)] per item); the body's tail
    (``argument`` bytes) is one u64 size per item, then the values back to back. Stored in
    order, so an item may name an earlier item of the request as its parent. The reply's detail
    is one byte per item (:data:`ITEM_STORED`, :data:`ITEM_EXISTS`; FLAG_PARENTS also
    :data:`ITEM_FAILED`, and then the first failure as ``"<ErrorClass>\\n<message>"`` after the
    status bytes). Without FLAG_PARENTS another refusal is an error reply, after the earlier
    values were stored."""
    RESERVE_MANY = 10
    """keys as PUT_MANY's; tail = one u64 size per item -> one RANGE per item as (arena offset,
    lease id), lease id 0 where the item is not reserved. Without FLAG_PARENTS: all or nothing,
    0 only where the key is already stored. FLAG_PARENTS: per item, the detail as PUT_MANY's
    (``ITEM_STORED``: reserved). An item's parent may be an open reservation of the same
    connection (an earlier item of this or an earlier request): its parent is then checked when
    it is committed."""
    COMMIT_MANY = 11
    """no keys; tail = u64 lease ids -> each is committed, in order (a parent's before its
    child's). Without FLAG_PARENTS the first failure (if any) is the error reply; with it the
    detail is one status byte per id (``ITEM_STORED``: committed, ``ITEM_FAILED``) and then the
    first failure. A reservation whose parent is not cached when it comes to be committed (the
    parent's reservation failed or was aborted) is aborted and fails."""
    SIZE_OF = 12
    """keys -> one RANGE per key: (1, size) when it is committed, (0, 0) when not."""
    REMOVE = 13
    """keys = [key] -> lease id 1 when it was removed, 0 when it was not held. ChunkBusy while
    it is leased."""
    HELLO = 14
    """no keys; tail (``argument`` bytes) = a session ticket. The first request of every
    connection to a server that requires tickets (anything else first gets a closing
    ``Unauthenticated``); later, a renewal (usually with FLAG_NO_REPLY: a refused ticket gets a
    closing reply either way). A server without tickets answers it OK."""


FLAG_PREFIX = 1
FLAG_NO_REPLY = 2
FLAG_PARENTS = 4
"""PUT_MANY, RESERVE_MANY: the keys are [key, parent] pairs and the outcome is per item;
COMMIT_MANY: the outcome is per lease id (detail: one status byte each, then the first failure).
"""

ITEM_STORED = 0
ITEM_EXISTS = 1
"""The key was already stored: nothing was written for it (not a failure)."""
ITEM_FAILED = 2
"""Refused (capacity, an uncached parent, too many leases...): the first such error follows
the status bytes."""

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
TAIL_OPS = frozenset({7, 9, 10, 11, 14})
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
    # One copy of the (small) key section, then bytes slices: cheaper than a memoryview slice
    # and a bytes() per key (a batch request's keys are unpacked on every request).
    data = bytes(body)
    end = len(data)
    for _ in range(count):
        if pos >= end:
            raise errors.ProtocolError("lease channel body ends before its keys do")
        n = data[pos]
        keys.append(data[pos + 1:pos + 1 + n])
        pos += 1 + n
    if pos != end:
        raise errors.ProtocolError(f"lease channel body has {end - pos} stray bytes")
    return keys


def key_parent_pairs(keys: list[bytes], parents: list[bytes | None]) -> list[bytes]:
    """The [key, parent (empty: none)] pairs of a FLAG_PARENTS request."""
    out: list[bytes] = []
    for key, parent in zip(keys, parents, strict=True):
        out.append(key)
        out.append(parent or b"")
    return out


def item_error(detail: bytes, count: int) -> errors.KvtierError | None:
    """The first failure a per-item reply carries after its ``count`` status bytes, or None."""
    if len(detail) <= count:
        return None
    name, _, message = detail[count:].decode(errors="replace").partition("\n")
    return errors.error_from_name(name, message)
