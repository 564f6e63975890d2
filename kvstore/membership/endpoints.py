"""etcd endpoints as text: one ``host:port`` or a list of a cluster's members.

Everything in kvtier that reaches etcd (daemon, conductor, engines, the CLI) takes its
endpoints in one of these spellings, all meaning the same list::

    127.0.0.1:2379                               one member
    http://10.0.0.1:2379,http://10.0.0.2:2379    several, comma-separated (flags, environment)
    [10.0.0.1:2379, 10.0.0.2:2379]               several, a YAML list (config file)

Each member is ``host:port``, ``http://host:port`` or ``https://host:port``; one list does not
mix ``http://`` with ``https://`` (TLS is a property of the client, not of one member: a bare
``host:port`` takes the list's), and no member appears twice. The client talks to one member at a time and fails over to the next
(docs/etcd-failover.md). Pure parsing: nothing here imports an etcd library, so the config
loader can validate endpoints without one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import InvalidArgument

__all__ = ["EtcdEndpoint", "parse_etcd_endpoint", "parse_etcd_endpoints", "parse_host_port"]

_SCHEMES = ("", "http", "https")


def parse_host_port(address: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` for IPv6) into host and port. Raises InvalidArgument."""
    if not isinstance(address, str):
        raise InvalidArgument(f"address must be a 'host:port' string, got {type(address).__name__}")
    host, sep, port_text = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise InvalidArgument(f"address must be 'host:port' with port 1-65535, got {address!r}")
    return host, int(port_text)


@dataclass(frozen=True, slots=True)
class EtcdEndpoint:
    """One etcd member's client URL, parsed. ``scheme`` is ``""`` (plain ``host:port``),
    ``"http"`` or ``"https"``; ``str()`` gives back the text it was parsed from."""

    scheme: str
    host: str
    port: int
    text: str

    def __post_init__(self) -> None:
        if self.scheme not in _SCHEMES:
            raise InvalidArgument(f"etcd endpoint scheme must be http or https, got "
                                  f"{self.scheme!r}")

    def __str__(self) -> str:
        return self.text


def parse_etcd_endpoint(text: str) -> EtcdEndpoint:
    """``host:port``, ``http://host:port`` or ``https://host:port`` (a trailing ``/`` is
    allowed). Raises InvalidArgument."""
    if not isinstance(text, str):
        raise InvalidArgument(f"an etcd endpoint must be text, got {type(text).__name__}")
    text = text.strip()
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "", text
    if scheme not in _SCHEMES:
        raise InvalidArgument(f"etcd endpoint must be host:port, http://host:port or "
                              f"https://host:port, got {text!r}")
    try:
        host, port = parse_host_port(rest.rstrip("/"))
    except InvalidArgument:
        raise InvalidArgument(f"etcd endpoint must be host:port, http://host:port or "
                              f"https://host:port, got {text!r}") from None
    return EtcdEndpoint(scheme, host, port, text)


def parse_etcd_endpoints(value: str | Sequence[str]) -> tuple[EtcdEndpoint, ...]:
    """The members named by ``value``: comma-separated text or a sequence of texts (each of
    which may itself be comma-separated), in order. Raises InvalidArgument when the list is
    empty, a member is malformed or repeated, or the members mix http:// with https://."""
    items: list[str] = []
    for part in [value] if isinstance(value, str) else list(value):
        if not isinstance(part, str):
            raise InvalidArgument(f"an etcd endpoint must be text, got {part!r}")
        items.extend(item.strip() for item in part.split(","))
    if not items or items == [""]:
        raise InvalidArgument("no etcd endpoint given")
    if "" in items:
        raise InvalidArgument(f"empty etcd endpoint in {value!r} (a stray comma?)")
    endpoints = tuple(parse_etcd_endpoint(item) for item in items)
    seen: set[tuple[str, int]] = set()
    for endpoint in endpoints:
        if (endpoint.host, endpoint.port) in seen:
            raise InvalidArgument(f"etcd endpoint {endpoint.host}:{endpoint.port} is listed "
                                  "twice")
        seen.add((endpoint.host, endpoint.port))
    schemes = {e.scheme for e in endpoints if e.scheme}
    if len(schemes) > 1:
        raise InvalidArgument(f"etcd endpoints mix http:// with https:// ({value!r}): all "
                              "members of one cluster are reached the same way")
    return endpoints
