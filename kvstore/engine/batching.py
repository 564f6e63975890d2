"""One batched greedy decode step over sequences with ragged KV caches.

Shared by the colocated engine (:mod:`kvstore.engine.colocated`) and the disaggregated decode
worker (:mod:`kvstore.engine.worker`): both keep one one-sequence transformers ``DynamicCache``
per sequence and advance every running sequence by one token per step with
:func:`batched_decode_step`.

**How a ragged batch runs on a model without varlen attention.** Hugging Face's Llama has no
ragged (varlen) attention kernel, so a step over ``n > 1`` sequences left-pads their caches to
the longest one, passes a 2-D attention mask that hides the padding (and covers the token being
decoded) and each sequence's own position id (its length), runs one forward of batch ``n`` and
appends each sequence's new key/value (the last position) to its own cache. One sequence
decodes on its cache directly. Greedy tokens equal those of a single-request reference token
for token (``tests/engine/test_colocated.py``, ``tests/engine/test_batching.py``, and the
decode worker through the gateway in ``tests/engine/test_cluster.py``).

**Cost.** The padded batch copies the running sequences' KV once per step (O(batch x context)
bytes), and appending the new K/V to each sequence's cache is a ``torch.cat`` per sequence and
layer. Measured on the bench model (docs/engines.md): padding is 5-7 ms of a ~20 ms step at
batch ~2.5 and ~500-token contexts. A preallocated per-sequence KV buffer or a paged cache
would remove the copies; not done.

Contract: ``caches[i]`` holds exactly the KV of every token of sequence ``i`` before its last
token ``last_tokens[i]`` (whose KV is not in the cache yet). After the step each cache holds one
more token (the KV of ``last_tokens[i]``), updated in place, and the returned token is the
greedy next token. Caches live on the model's device. Not thread-safe: one model, one thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.errors import InvalidArgument, InvariantViolation

if TYPE_CHECKING:
    import torch

__all__ = ["DecodeStep", "batched_decode_step", "pad_caches"]


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """What one step produced: the next token of each sequence, in order, and the seconds
    spent building the padded batch cache (0 for a batch of one)."""

    tokens: list[int]
    pad_s: float


def batched_decode_step(model: Any, caches: Sequence[Any], last_tokens: Sequence[int]
                        ) -> DecodeStep:
    """One greedy token for each sequence (see the module docstring for the contract).

    Raises InvalidArgument when ``caches`` and ``last_tokens`` differ in length or are empty.
    """
    import torch

    n = len(caches)
    if n == 0 or n != len(last_tokens):
        raise InvalidArgument(f"{n} caches for {len(last_tokens)} tokens (need >= 1, equal)")
    device = caches[0].layers[0].keys.device
    if n == 1:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([[last_tokens[0]]], dtype=torch.long,
                                               device=device),
                        past_key_values=caches[0], use_cache=True, logits_to_keep=1)
        if out.past_key_values is not caches[0]:
            # transformers updates a DynamicCache in place; callers rely on it.
            raise InvariantViolation("the model returned a new cache instead of updating it")
        return DecodeStep([int(torch.argmax(out.logits[0, -1]))], 0.0)
    pad_start = time.perf_counter()
    padded, mask, positions = pad_caches(caches)
    pad_s = time.perf_counter() - pad_start
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[t] for t in last_tokens], dtype=torch.long,
                                           device=device),
                    attention_mask=mask, position_ids=positions,
                    past_key_values=padded, use_cache=True, logits_to_keep=1)
    nxt = torch.argmax(out.logits[:, -1], dim=-1).tolist()
    for i, cache in enumerate(caches):
        for layer_idx, layer in enumerate(out.past_key_values.layers):
            cache.update(layer.keys[i: i + 1, :, -1:], layer.values[i: i + 1, :, -1:],
                         layer_idx)
    return DecodeStep([int(t) for t in nxt], pad_s)


def pad_caches(caches: Sequence[Any]) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """Left-pad one-sequence caches into one batch cache; returns it, the 2-D attention mask
    (padding hidden, one more column for the token being decoded) and the position ids (each
    sequence's own length)."""
    import torch
    from transformers.cache_utils import DynamicCache

    lengths = [c.get_seq_length() for c in caches]
    longest = max(lengths)
    device = caches[0].layers[0].keys.device
    batch = DynamicCache()
    for layer_idx, first in enumerate(caches[0].layers):
        kv = []
        for name in ("keys", "values"):
            ref = getattr(first, name)
            t = ref.new_zeros((len(caches), ref.shape[1], longest, ref.shape[3]))
            for i, (cache, n) in enumerate(zip(caches, lengths, strict=True)):
                t[i, :, longest - n:] = getattr(cache.layers[layer_idx], name)[0]
            kv.append(t)
        batch.update(kv[0], kv[1], layer_idx)
    mask = torch.zeros((len(caches), longest + 1), dtype=torch.long, device=device)
    for i, n in enumerate(lengths):
        mask[i, longest - n:] = 1
    positions = torch.tensor([[n] for n in lengths], dtype=torch.long, device=device)
    return batch, mask, positions
