"""A standalone TCP server over an in-memory backend (tests, benchmarks, a quick peer by hand):
``python -m kvstore.dataplane.transport`` or ``python -m kvstore.dataplane.transport.tcp``."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from kvstore.dataplane.transport.frames import DEFAULT_MAX_VALUE_BYTES
from kvstore.dataplane.transport.tcp.server import TcpServer, TcpServerConfig
from kvstore.errors import InvalidArgument


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvstore.dataplane.transport``: serve an in-memory backend.

    Prints ``LISTENING <host> <port>`` once bound, then serves until SIGTERM/SIGINT (or, with
    ``--exit-on-stdin-eof``, until its parent closes stdin), draining in-flight transfers. A test
    and benchmark harness, not the store daemon: it reads flags only, no config tree.
    """
    from kvstore.dataplane.transport.memory_backend import MemoryBackend

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--max-value-bytes", type=int, default=DEFAULT_MAX_VALUE_BYTES)
    parser.add_argument("--capacity-bytes", type=int, default=None)
    parser.add_argument("--socket-buffer-bytes", type=int, default=None)
    parser.add_argument("--io-timeout-s", type=float, default=30.0)
    parser.add_argument("--reservation-ttl-s", type=float, default=30.0)
    parser.add_argument("--drain-timeout-s", type=float, default=5.0)
    parser.add_argument("--exit-on-stdin-eof", action="store_true")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = TcpServerConfig(
            host=args.host, port=args.port, max_value_bytes=args.max_value_bytes,
            socket_buffer_bytes=args.socket_buffer_bytes, io_timeout_s=args.io_timeout_s,
            reservation_ttl_s=args.reservation_ttl_s, drain_timeout_s=args.drain_timeout_s)
    except InvalidArgument as exc:
        parser.error(str(exc))
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if args.exit_on_stdin_eof:
        def watch_stdin() -> None:
            # A raw fd read: a daemon thread blocked in the buffered reader would hold its lock
            # and abort interpreter shutdown.
            while os.read(sys.stdin.fileno(), 4096):
                pass
            stop.set()

        threading.Thread(target=watch_stdin, name="stdin-watch", daemon=True).start()
    server = TcpServer(MemoryBackend(capacity_bytes=args.capacity_bytes), config)
    endpoint = server.start()
    print(f"LISTENING {endpoint.host} {endpoint.port}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.close()
    return 0
