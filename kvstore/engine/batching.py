"""Continuous-batching decode over sequences with ragged KV: :class:`DecodeBatch`.

Shared by the colocated engine (:mod:`kvstore.engine.colocated`) and the disaggregated decode
worker (:mod:`kvstore.engine.worker.decode`): both let sequences join the running batch between two
steps, advance every member by one greedy token per step with one forward, and let finished
ones leave.

**How a ragged batch runs on a model without varlen attention.** Hugging Face's Llama has no
ragged (varlen) attention kernel, so the batch keeps one left-padded KV cache: row ``i`` holds
member ``i``'s KV after ``pad_i`` zero columns. A step passes a 2-D attention mask that hides
each row's padding (and covers the token being decoded) and each member's own position id
(its length), and the model appends every member's new key/value at the same column, so the
layout stays valid from step to step. Only a join or a leave rebuilds the padded cache (one
copy of the members' KV); a lone unpadded member decodes with no mask at all, exactly as one
request alone. Greedy tokens equal those of a single-request reference token for token
(``tests/engine/test_batching.py``, ``tests/engine/test_colocated.py``, and the decode worker
through the gateway in ``tests/engine/test_cluster.py``).

**Cost.** Measured on the bench model (6 layers, hidden 512; five sequences of 400-800 tokens,
one torch thread, load ~2): five one-sequence steps 119 ms, a batched step that re-padded every
member each step (this module's first version) 58 ms, of which the padding copy was 31 ms; a
step on the kept padded cache 27 ms. transformers' ``DynamicCache`` still concatenates each
layer's KV per step (a copy of the batch's KV); a preallocated cache would remove that too.

Not thread-safe: one model, one thread.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from kvstore.errors import InvalidArgument, InvariantViolation

__all__ = ["DecodeBatch"]


class DecodeBatch:
    """Sequences decoding together on one left-padded batch KV cache kept across steps.

    ``join(key, cache)`` adds a sequence with its one-sequence cache (the KV of every token
    before its last one); ``step({key: last token})`` runs one forward over every member and
    returns each member's greedy next token; ``leave(key)`` drops a finished one. While the
    members stay the same, every step appends one token at the same column for all of them, so
    the padded layout stays valid and a step costs the forward alone; a join or a leave rebuilds
    the batch cache once (one copy of the members' KV, timed in :attr:`pad_s`). The joined
    cache belongs to the batch from then on (the batch may adopt its tensors).
    """

    def __init__(self, model: Any) -> None:
        """Record the model; no cache exists until the first join."""
        self.model = model
        self._keys: list[Hashable] = []
        self._pads: list[int] = []
        """Left padding columns of each row of the batch cache."""
        self._cache: Any = None
        self._joining: dict[Hashable, Any] = {}
        self._leaving: set[Hashable] = set()
        self.pad_s = 0.0
        """Seconds spent rebuilding the batch cache (joins and leaves), since construction."""

    def __len__(self) -> int:
        return len(self._keys) + len(self._joining) - len(self._leaving)

    @property
    def members(self) -> list[Hashable]:
        """The members as of the next step (joined, not left)."""
        return [k for k in self._keys if k not in self._leaving] + list(self._joining)

    def __contains__(self, key: Hashable) -> bool:
        return (key in self._joining or key in self._keys) and key not in self._leaving

    def join(self, key: Hashable, cache: Any) -> None:
        """Add a sequence (its cache must be non-empty). InvalidArgument if ``key`` is a member."""
        if key in self:
            raise InvalidArgument(f"{key!r} is already in the batch")
        if cache.get_seq_length() < 1:
            raise InvalidArgument("a joining sequence needs at least one token of KV")
        self._leaving.discard(key)
        self._joining[key] = cache

    def leave(self, key: Hashable) -> None:
        """Drop a member; InvalidArgument if it is not one."""
        if key not in self:
            raise InvalidArgument(f"{key!r} is not in the batch")
        if self._joining.pop(key, None) is None:
            self._leaving.add(key)

    def step(self, last_tokens: Mapping[Hashable, int]) -> dict[Hashable, int]:
        """One greedy token for every member; ``last_tokens`` names each member's last token
        exactly (InvalidArgument otherwise)."""
        import torch

        self._apply_changes()
        if not self._keys or set(last_tokens) != set(self._keys) or \
                len(last_tokens) != len(self._keys):
            raise InvalidArgument("last_tokens must name every member of a non-empty batch")
        device = self._cache.layers[0].keys.device
        ids = torch.tensor([[last_tokens[k]] for k in self._keys], dtype=torch.long,
                           device=device)
        kwargs: dict[str, Any] = {}
        if any(self._pads):  # only a single, unpadded row decodes without mask and positions
            longest = self._cache.get_seq_length()
            mask = torch.ones((len(self._keys), longest + 1), dtype=torch.long, device=device)
            for i, pad in enumerate(self._pads):
                mask[i, :pad] = 0
            kwargs["attention_mask"] = mask
            kwargs["position_ids"] = torch.tensor([[longest - pad] for pad in self._pads],
                                                  dtype=torch.long, device=device)
        with torch.no_grad():
            out = self.model(input_ids=ids, past_key_values=self._cache, use_cache=True,
                             logits_to_keep=1, **kwargs)
        if out.past_key_values is not self._cache:
            # transformers updates a DynamicCache in place; the batch relies on it.
            raise InvariantViolation("the model returned a new cache instead of updating it")
        nxt = torch.argmax(out.logits[:, -1], dim=-1).tolist()
        return {k: int(t) for k, t in zip(self._keys, nxt, strict=True)}

    def _apply_changes(self) -> None:
        """Rebuild the batch cache for the joins and leaves since the last step."""
        if not self._joining and not self._leaving:
            return
        start = time.perf_counter()
        rows: list[tuple[Hashable, Any, int]] = []  # key, cache holding the row, row index
        for i, key in enumerate(self._keys):
            if key not in self._leaving:
                rows.append((key, self._cache, i))
        rows += [(key, cache, 0) for key, cache in self._joining.items()]
        self._joining.clear()
        self._leaving.clear()
        if not rows:
            self._keys, self._pads, self._cache = [], [], None
            self.pad_s += time.perf_counter() - start
            return
        if len(rows) == 1:
            key, cache, row = rows[0]
            if cache is self._cache:  # the last member of a batch: its row alone, unpadded
                cache = _rows_cache(cache, [(row, self._pads[row])])
            self._keys, self._pads, self._cache = [key], [0], cache  # a joiner's is adopted
            self.pad_s += time.perf_counter() - start
            return
        spans = [(cache, row, self._pads[row] if cache is self._cache else 0)
                 for _key, cache, row in rows]
        lengths = [c.get_seq_length() - pad for c, _row, pad in spans]
        longest = max(lengths)
        self._cache = _padded_cache(spans, lengths, longest)
        self._keys = [key for key, _c, _r in rows]
        self._pads = [longest - n for n in lengths]
        self.pad_s += time.perf_counter() - start


def _padded_cache(spans: Sequence[tuple[Any, int, int]], lengths: Sequence[int],
                  longest: int) -> Any:
    """A batch cache whose row ``i`` is row ``spans[i][1]`` of cache ``spans[i][0]`` without its
    ``spans[i][2]`` leading padding columns, left-padded with zeros to ``longest``."""
    from transformers.cache_utils import DynamicCache

    batch = DynamicCache()
    first = spans[0][0]
    for layer_idx in range(len(first.layers)):
        kv = []
        for name in ("keys", "values"):
            ref = getattr(first.layers[layer_idx], name)
            t = ref.new_zeros((len(spans), ref.shape[1], longest, ref.shape[3]))
            for i, ((cache, row, pad), n) in enumerate(zip(spans, lengths, strict=True)):
                t[i, :, longest - n:] = getattr(cache.layers[layer_idx], name)[row, :, pad:]
            kv.append(t)
        batch.update(kv[0], kv[1], layer_idx)
    return batch


def _rows_cache(cache: Any, rows: Sequence[tuple[int, int]]) -> Any:
    """A cache of the given (row, leading padding) rows of ``cache``, padding dropped."""
    lengths = [cache.get_seq_length() - pad for _row, pad in rows]
    return _padded_cache([(cache, row, pad) for row, pad in rows], lengths, max(lengths))
