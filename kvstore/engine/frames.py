"""The frames the gateway and the disaggregated workers speak over a plain socket.

One frame = 8-byte header ``>II`` (JSON length, payload length), the JSON object, then the
payload bytes (KV, little-endian in the model's dtype). One request per connection; the
connection closes after ``done`` or ``error``. An ``error`` frame (:func:`error_frame`) carries
the kvtier error class name and a message; the gateway raises it again.

Why not gRPC: a request is two or three frames with a payload of raw KV; a JSON header plus
bytes needs no generated code and has no 4 MiB message cap.
"""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any

from kvstore.errors import PeerUnavailable, ProtocolError

__all__ = ["MAX_HEADER_BYTES", "MAX_PAYLOAD_BYTES", "error_frame", "read_frame", "write_frame"]

_HEADER = struct.Struct(">II")
MAX_HEADER_BYTES = 16 << 20
MAX_PAYLOAD_BYTES = 1 << 30


async def read_frame(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes]:
    """One frame; PeerUnavailable when the peer closed, ProtocolError when it is malformed."""
    try:
        head = await reader.readexactly(_HEADER.size)
        json_len, payload_len = _HEADER.unpack(head)
        if json_len > MAX_HEADER_BYTES or payload_len > MAX_PAYLOAD_BYTES:
            raise ProtocolError(f"frame too large: {json_len} + {payload_len} bytes")
        doc = json.loads(await reader.readexactly(json_len))
        payload = await reader.readexactly(payload_len) if payload_len else b""
    except asyncio.IncompleteReadError as exc:
        raise PeerUnavailable("the peer closed the connection mid-frame") from exc
    except (ConnectionError, OSError) as exc:
        raise PeerUnavailable(f"connection lost: {exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"frame header is not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ProtocolError("frame header must be a JSON object")
    return doc, payload


async def write_frame(writer: asyncio.StreamWriter, doc: dict[str, Any],
                      payload: bytes | memoryview = b"") -> None:
    body = json.dumps(doc, separators=(",", ":")).encode()
    writer.write(_HEADER.pack(len(body), len(payload)))
    writer.write(body)
    if payload:
        writer.write(payload)
    try:
        await writer.drain()
    except (ConnectionError, OSError) as exc:
        raise PeerUnavailable(f"connection lost: {exc}") from exc


def error_frame(exc: BaseException) -> dict[str, Any]:
    return {"event": "error", "error": type(exc).__name__, "message": str(exc)}
