"""An engine that prefills through a kvtier daemon: :class:`ReuseEngine`'s loop, over :class:`KVClient`.

For a prompt it

1. asks the daemon how many leading full blocks it holds (at least one token is always left to
   compute: the next token needs its logits),
2. starts loading them into a contiguous ``[layers, 2, kv_heads, tokens, head_dim]`` buffer and
   waits only until the chunks have *arrived* (the count decides what to compute),
3. runs the model on the rest with a hook before each decoder layer that waits until that
   layer's KV is in the buffer (:meth:`LoadHandle.wait_for_layer`), and a hook after each layer
   that hands the layer's new KV to a layer-by-layer save (:meth:`LayerwiseSave.save_layer`),
   so copies overlap the next layer's compute,
4. puts the new full blocks once every layer is in.

A failed or partial load (a daemon killed mid-load, a chunk evicted or dropped since the lookup)
degrades to computing more: the prefill uses only the blocks that arrived, and the result names
the blocks that failed. The model is any transformers causal LM with ``model.model.layers``
(Llama architecture); on a GPU the buffers live on the model's device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.client.handles import LayerwiseSave, LoadHandle
from kvstore.client.kv_client import KVClient
from kvstore.client.layouts import ContiguousKV, HFCacheKV
from kvstore.client.requests import RemoteFetch
from kvstore.client.results import LoadResult, SaveResult
from kvstore.errors import InvalidArgument

if TYPE_CHECKING:
    import concurrent.futures as cf

    import torch


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    past_key_values: Any
    last_logits: torch.Tensor
    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    matched_blocks: int
    """Blocks the lookup promised (loaded ones may be fewer)."""
    load: LoadResult | None
    save: SaveResult | None
    lookup_s: float
    compute_s: float
    """Forward pass, including waits for layers still loading."""


def layered_cache(buffer: torch.Tensor, tokens: int, handle: LoadHandle | None) -> Any:
    """A ``DynamicCache`` whose layer ``l`` is a view of ``buffer[l, :, :, :tokens]``.

    ``DynamicCache.update`` would copy (``torch.cat``) the not yet loaded buffer at once, so the
    layers are filled in directly: each holds a view, and the model reads it only inside layer
    ``l``'s attention, after the pre-hook installed by :func:`_hooks` waited for the load of
    that layer. transformers 5's ``DynamicLayer`` keeps ``keys``/``values`` tensors and an
    ``is_initialized`` flag; this is the one place that relies on those names.
    """
    from transformers.cache_utils import DynamicCache, DynamicLayer

    del handle  # the waiting happens in the model's pre-hooks
    cache = DynamicCache()
    cache.layers = []
    for layer in range(buffer.shape[0]):
        lay = DynamicLayer()  # type: ignore[no-untyped-call]
        lay.dtype, lay.device = buffer.dtype, buffer.device
        lay.keys = buffer[layer, 0, :, :tokens].unsqueeze(0)
        lay.values = buffer[layer, 1, :, :tokens].unsqueeze(0)
        lay.is_initialized = True
        cache.layers.append(lay)
    return cache


class RemoteEngine:
    """Greedy prefill/decode of one sequence at a time, reusing KV through a kvtier daemon."""

    def __init__(self, model: Any, client: KVClient, *, layerwise: bool = True) -> None:
        """``client.layout`` must describe ``model``'s KV. ``layerwise=False`` waits for the
        whole load before the forward and saves after it (the baseline to compare with)."""
        cfg = model.config
        lay = client.layout
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if (cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim) != (
                lay.num_layers, lay.num_kv_heads, lay.head_dim):
            raise InvalidArgument("the client's KV layout does not match the model")
        self.model = model
        self.client = client
        self.layout = lay
        self.layerwise = layerwise

    @property
    def _decoder_layers(self) -> list[Any]:
        return list(self.model.model.layers)

    def prefill(self, token_ids: list[int], *, reuse: bool = True,
                wait_for_save: bool = True, remote: RemoteFetch | None = None) -> RemotePrefill:
        """Prefill ``token_ids``; with ``reuse`` load the cached prefix and save the new blocks.

        ``remote`` (a conductor fetch plan): blocks the own daemon lacks are loaded from that
        other node up to ``remote.end_block``; the save then stores them in the own daemon too
        (from the engine's cache, after the forward), so the next request finds them locally.
        """
        import torch
        from transformers.cache_utils import DynamicCache

        if len(token_ids) < 1:
            raise InvalidArgument("a prompt needs at least one token")
        B = self.layout.block_tokens
        full_blocks = len(token_ids) // B
        reusable = min(full_blocks, (len(token_ids) - 1) // B) if reuse else 0
        device = next(self.model.parameters()).device

        t0 = time.perf_counter()
        matched = self.client.lookup(token_ids[:reusable * B]).blocks if reusable else 0
        if remote is not None and reusable:
            matched = max(matched, min(reusable, remote.end_block))
        handle: LoadHandle | None = None
        loaded = held_locally = 0
        if matched:
            buffer = torch.empty((self.layout.num_layers, 2, self.layout.num_kv_heads,
                                  matched * B, self.layout.head_dim), dtype=self.layout.dtype,
                                 device=device)
            handle = self.client.load(token_ids[:matched * B], ContiguousKV(buffer, self.layout),
                                      remote=remote, replicate=False)
            loaded = handle.transferred()
            held_locally = loaded - handle.transferred_remote()
            if not self.layerwise:
                handle.result()
            cache = layered_cache(buffer, loaded * B, handle) if loaded else DynamicCache()
        else:
            cache = DynamicCache()
        t1 = time.perf_counter()

        saver: LayerwiseSave | None = None
        if reuse and full_blocks > held_locally:
            saver = self.client.begin_save(token_ids, HFCacheKV(cache, self.layout),
                                           first_block=held_locally)
        hooks = self._hooks(handle if loaded else None, saver if self.layerwise else None)
        rest = torch.tensor([token_ids[loaded * B:]], dtype=torch.long, device=device)
        try:
            with torch.no_grad():
                out = self.model(input_ids=rest, past_key_values=cache, use_cache=True)
        finally:
            for h in hooks:
                h.remove()
        t2 = time.perf_counter()

        save_future: cf.Future[SaveResult] | None = None
        if saver is not None:
            if not self.layerwise:
                for layer in range(self.layout.num_layers):
                    saver.save_layer(layer)
            save_future = saver.finish()
        load_result = handle.result() if handle is not None else None
        save_result = save_future.result() if save_future is not None and wait_for_save else None
        return RemotePrefill(out.past_key_values, out.logits[0, -1], len(token_ids), loaded * B,
                             len(token_ids) - loaded * B, matched, load_result, save_result,
                             t1 - t0, t2 - t1)

    def _hooks(self, handle: LoadHandle | None, saver: LayerwiseSave | None) -> list[Any]:
        hooks = []
        for index, layer in enumerate(self._decoder_layers):
            if handle is not None:
                def wait(_module: Any, _args: Any, index: int = index) -> None:
                    assert handle is not None
                    handle.wait_for_layer(index)
                hooks.append(layer.register_forward_pre_hook(wait))
            if saver is not None:
                def save(_module: Any, _args: Any, _out: Any, index: int = index) -> None:
                    assert saver is not None
                    saver.save_layer(index)
                hooks.append(layer.register_forward_hook(save))
        return hooks

    def decode(self, prefill: RemotePrefill, max_new_tokens: int
               ) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy decoding after a prefill; returns the tokens and each step's logits."""
        return greedy_decode(self.model, prefill.past_key_values, prefill.last_logits,
                             max_new_tokens)


def greedy_decode(model: Any, past: Any, logits: torch.Tensor, max_new_tokens: int
                  ) -> tuple[list[int], list[torch.Tensor]]:
    import torch

    device = logits.device
    tokens: list[int] = []
    all_logits = [logits]
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(torch.argmax(logits))
            tokens.append(nxt)
            out = model(input_ids=torch.tensor([[nxt]], device=device), past_key_values=past,
                        use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
            all_logits.append(logits)
    return tokens, all_logits
