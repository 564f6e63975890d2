"""A single-process engine that prefills through the tiered cache: reused prefixes skip prefill.

This is the smallest honest form of what kvtier is for. For a prompt it

1. computes the chained keys of its full blocks,
2. loads the longest cached prefix from the tiers (at least one token is always left to compute,
   since the next token needs its logits),
3. prefills only the rest on top of the loaded KV, and
4. saves the KV of every new full block back into the cache.

A failed or partial load (a corrupt chunk, a chunk evicted between lookup and load) degrades to
recomputing more, never to wrong output: ``load_prefix`` reports how many blocks it really loaded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.client.kvlayout import KVLayout
from kvstore.errors import InvalidArgument
from kvstore.keys import BlockHasher, HashMode, KVDtype, KVFingerprint, Namespace
from kvstore.node.cache import TieredCache

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class PrefillResult:
    past_key_values: Any
    last_logits: torch.Tensor
    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    saved_blocks: int
    load_s: float
    compute_s: float
    save_s: float
    loaded_from: dict[str, int]
    """Blocks loaded per tier name."""


class ReuseEngine:
    """Greedy prefill/decode of one sequence at a time with KV reuse through a TieredCache."""

    def __init__(self, model: Any, cache: TieredCache, *, block_tokens: int = 256,
                 model_name: str = "kvtier-reference-llama", tenant: str = "") -> None:
        self.model = model
        self.cache = cache
        self.layout = KVLayout.for_model(model, block_tokens)
        fingerprint = KVFingerprint(
            model=model_name, dtype=KVDtype.from_torch(self.layout.dtype),
            num_layers=self.layout.num_layers, num_kv_heads=self.layout.num_kv_heads,
            head_dim=self.layout.head_dim, block_size_tokens=block_tokens)
        self.hasher = BlockHasher(Namespace(fingerprint, tenant), mode=HashMode.XXH3_128)

    def prefill(self, token_ids: list[int], *, reuse: bool = True) -> PrefillResult:
        import torch

        if len(token_ids) < 1:
            raise InvalidArgument("a prompt needs at least one token")
        B = self.layout.block_tokens
        keys = self.hasher.hash_blocks(token_ids)
        # Leave at least one token to compute: its logits give the next token.
        reusable = min(len(keys), (len(token_ids) - 1) // B) if reuse else 0

        t0 = time.perf_counter()
        loaded = 0
        loaded_from: dict[str, int] = {}
        past = None
        if reusable:
            match = self.cache.lookup(keys[:reusable])
            if match.length:
                for tier, n in match.by_tier().items():
                    loaded_from[tier.value] = n
                buf = self.layout.empty_chunks(match.length)
                loaded = self.cache.load_prefix(keys[: match.length], list(buf))
                if loaded:
                    past = self.layout.unpack(buf[:loaded])
                if loaded < match.length:  # partial: count only what arrived
                    loaded_from = {"partial": loaded}
        t1 = time.perf_counter()

        rest = torch.tensor([token_ids[loaded * B:]], dtype=torch.long)
        with torch.no_grad():
            out = self.model(input_ids=rest, past_key_values=past, use_cache=True)
        t2 = time.perf_counter()

        saved = 0
        if reuse and len(keys) > loaded:
            chunks = self.layout.pack(out.past_key_values, loaded, len(keys) - loaded)
            saved = self.cache.put_chain(keys[loaded:], list(chunks),
                                         parent=keys[loaded - 1] if loaded else None)
        t3 = time.perf_counter()
        return PrefillResult(out.past_key_values, out.logits[0, -1], len(token_ids), loaded * B,
                             len(token_ids) - loaded * B, saved, t1 - t0, t2 - t1, t3 - t2,
                             loaded_from)

    def decode(self, prefill: PrefillResult, max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy decoding after a prefill; returns the tokens and each step's logits."""
        import torch

        past = prefill.past_key_values
        logits = prefill.last_logits
        tokens: list[int] = []
        all_logits = [logits]
        with torch.no_grad():
            for _ in range(max_new_tokens):
                nxt = int(torch.argmax(logits))
                tokens.append(nxt)
                out = self.model(input_ids=torch.tensor([[nxt]]), past_key_values=past,
                                 use_cache=True)
                past, logits = out.past_key_values, out.logits[0, -1]
                all_logits.append(logits)
        return tokens, all_logits
