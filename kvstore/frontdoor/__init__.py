"""The front door: the OpenAI-compatible HTTP endpoint clients point at, in front of ``vllm
serve`` instances (docs/frontdoor.md). It tokenizes each prompt as vLLM will, asks a router
(round robin, or the conductor) for a backend, and proxies the request, streaming included;
in P/D mode it prefills on one backend and decodes on another (``PdRouter``).

It uses the client box (the conductor's client) and membership, never the node, and never
imports vLLM: it only speaks HTTP to it. :mod:`kvstore.frontdoor.local` embeds the conductor's
scheduling library (never its process: server, service) to decide routes in process
(docs/routing.md); it is not imported here, so a round-robin front door loads none of it.
"""

from kvstore.frontdoor.router import (
    Backend,
    BackendPool,
    ConductorRouter,
    PdPair,
    PdRouter,
    Rejection,
    RoundRobinRouter,
    Router,
    RouteRequest,
)
from kvstore.frontdoor.server import FrontDoor
from kvstore.frontdoor.tokenizer import PromptTokenizer

__all__ = ["Backend", "BackendPool", "ConductorRouter", "FrontDoor", "PdPair", "PdRouter",
           "PromptTokenizer", "Rejection", "RoundRobinRouter", "RouteRequest", "Router"]
