"""Helpers of the front-door tests: a :class:`~kvstore.frontdoor.FrontDoor` served from an event
loop on a thread of its own (the tests speak blocking HTTP to it), and small HTTP clients."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvstore.cluster.vllm_instance import REPO
from kvstore.frontdoor import FrontDoor
from kvstore.frontdoor.server import READY_PREFIX


class DoorThread:
    """``make()`` builds the FrontDoor on the thread's loop (so loop-bound clients, such as the
    conductor's gRPC channel, bind to it); :meth:`start` serves it, :meth:`close` stops it."""

    def __init__(self, make: Callable[[], FrontDoor]) -> None:
        self._make = make
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="frontdoor")
        self.door: FrontDoor | None = None

    def call(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def start(self) -> FrontDoor:
        self._thread.start()

        async def up() -> FrontDoor:
            door = self._make()
            await door.start()
            return door

        self.door = self.call(up())
        return self.door

    @property
    def url(self) -> str:
        assert self.door is not None
        return self.door.url

    def close(self) -> None:
        if self.door is not None:
            self.call(self.door.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()


def connection(base_url: str, timeout_s: float = 180.0) -> http.client.HTTPConnection:
    parts = urlsplit(base_url)
    return http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port,
                                      timeout=timeout_s)


def request(base_url: str, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
            timeout_s: float = 180.0) -> tuple[int, dict[str, str], Any]:
    """One request; (status, lower-cased headers, the JSON answer or its text)."""
    conn = connection(base_url, timeout_s)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        payload = resp.read()
        headers = {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()
    try:
        return resp.status, headers, json.loads(payload)
    except ValueError:
        return resp.status, headers, payload.decode(errors="replace")


def sse_events(base_url: str, path: str, body: dict[str, Any], timeout_s: float = 180.0
               ) -> tuple[int, dict[str, str], list[str]]:
    """A streaming request read to its end: the ``data:`` payloads in order."""
    conn = connection(base_url, timeout_s)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        headers = {k.lower(): v for k, v in resp.getheaders()}
        events = [line[len(b"data: "):].decode().strip()
                  for line in resp.read().split(b"\n") if line.startswith(b"data: ")]
    finally:
        conn.close()
    return resp.status, headers, events


@contextlib.contextmanager
def frontdoor_command(args: list[str], log_path: Path) -> Iterator[dict[str, Any]]:
    """Run ``kvtier frontdoor ARGS --port 0`` as a child; yield its ready line's document (the
    URL, backends and router it serves); on leaving it must stop cleanly (exit 0)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = str(REPO)
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli.main", "frontdoor", *args,
                                 "--port", "0"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=log, text=True)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith(READY_PREFIX), log_path.read_text()
            yield json.loads(line[len(READY_PREFIX):])
        finally:
            proc.terminate()
            assert proc.wait(30) == 0
