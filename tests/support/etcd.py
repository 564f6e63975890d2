"""pytest fixtures for a real etcd server (loaded by ``tests/conftest.py`` as a plugin).

* ``etcd_server`` (session): one shared :class:`~kvstore.membership.launcher.LocalEtcd` on ephemeral
  ports in a temporary directory. Tests must not stop, restart or pause it.
* ``private_etcd`` (function): a server of the test's own, for fault tests (restart,
  pause, kill). Costs about a second to start.
* ``aio`` (session): one ``asyncio.Runner`` for every test that talks to etcd. gRPC's
  asyncio layer binds to the event loop it first runs on; a fresh ``asyncio.run`` per
  test leaves it calling into closed loops ("Event loop is closed" errors in the log).
* ``etcd_layout`` (function): a :class:`~kvstore.membership.etcd.KeyLayout` with a prefix
  unique to the test, so tests sharing ``etcd_server`` never see each other's keys.
  Keys are not deleted afterwards: leased keys expire, the rest dies with the server.

Every fixture that needs the binary skips the test, with the reason, when etcd is not
installed.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.membership.etcd import KeyLayout
from kvstore.membership.launcher import LocalEtcd, find_etcd_binary

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def require_etcd() -> str:
    """The etcd binary's path, or skip the calling test with the reason."""
    binary = find_etcd_binary()
    if binary is None:
        pytest.skip(
            "etcd binary not found: install etcd-server (scripts/setup.sh does, as root) "
            "or set KVTIER_ETCD_BINARY"
        )
    return binary


@pytest.fixture(scope="session")
def aio() -> Iterator[asyncio.Runner]:
    """One event loop for the session: ``aio.run(coro)`` instead of ``asyncio.run(coro)``."""
    with asyncio.Runner() as runner:
        yield runner


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    """A shared etcd for the whole session; do not stop, restart or pause it."""
    require_etcd()
    server = LocalEtcd(work_dir=tmp_path_factory.mktemp("etcd-shared"), name="kvtier-test")
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def private_etcd(tmp_path: Path) -> Iterator[LocalEtcd]:
    """An etcd owned by one test, free to restart, pause or kill."""
    require_etcd()
    server = LocalEtcd(work_dir=tmp_path / "etcd", name="kvtier-private")
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def etcd_layout(request: pytest.FixtureRequest) -> KeyLayout:
    """A key prefix no other test uses: ``/kvtier-test/<test name>-<random>/``."""
    name = _UNSAFE.sub("-", request.node.name).strip("-")[:80] or "test"
    return KeyLayout(prefix=f"/kvtier-test/{name}-{uuid.uuid4().hex[:8]}/")


def run(aio: asyncio.Runner, scenario: Coroutine[Any, Any, None], timeout_s: float = 30.0) -> None:
    """Run one asyncio scenario on the session's loop with an overall deadline."""

    async def bounded() -> None:
        async with asyncio.timeout(timeout_s):
            await scenario

    aio.run(bounded())
