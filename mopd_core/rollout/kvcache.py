"""A preallocated KV cache for `rollout.sample`: transformers' `DynamicCache` grows every layer's keys and values
with `torch.cat` on each decoded token (a copy of the whole cache per token and layer: 17 % of the tiny recipe's
sampling time under torch.profiler). Here each full-attention layer writes the new token into a buffer sized for
the prompt plus the generation budget, and attention reads a view of the filled prefix — the same values, the same
shapes, so the samples and log-probs are bit-identical to the growing cache (tested in tests/unit/test_perf_paths).

Layers of another kind (sliding-window, linear attention, quantised) keep transformers' own behaviour.
"""

from __future__ import annotations

import torch

__all__ = ["PreallocLayer", "preallocated_cache"]


def _dynamic_classes():
    from transformers.cache_utils import DynamicCache, DynamicLayer

    return DynamicCache, DynamicLayer


class _Prealloc:
    """Mixed into `DynamicLayer` (created lazily so that importing this module does not import transformers)."""

    capacity: int

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.device = key_states.device
        self._kbuf = key_states.new_empty((B, H, self.capacity, D))
        self._vbuf = value_states.new_empty((B, value_states.shape[1], self.capacity, value_states.shape[-1]))
        self._len = 0
        self.keys, self.values = self._kbuf[:, :, :0], self._vbuf[:, :, :0]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self._len + key_states.shape[-2]
        if n > self.capacity:  # past the budget it was sized for: grow like DynamicCache (never on the sampler path)
            self._kbuf = torch.cat([self.keys, key_states], dim=-2)
            self._vbuf = torch.cat([self.values, value_states], dim=-2)
            self.capacity = n
        else:
            self._kbuf[:, :, self._len:n].copy_(key_states)
            self._vbuf[:, :, self._len:n].copy_(value_states)
        self._len = n
        self.keys, self.values = self._kbuf[:, :, :n], self._vbuf[:, :, :n]
        return self.keys, self.values

    def reset(self) -> None:
        self._len = 0
        super().reset()  # type: ignore[misc]


_LAYER_CLS: dict = {}


def PreallocLayer():  # noqa: N802 - a class factory: transformers is imported on first use
    """The preallocating subclass of transformers' `DynamicLayer`."""
    if "cls" not in _LAYER_CLS:
        _, dyn = _dynamic_classes()
        _LAYER_CLS["cls"] = type("PreallocLayer", (_Prealloc, dyn), {})
    return _LAYER_CLS["cls"]


def preallocated_cache(model, capacity: int):
    """A `DynamicCache` for `model` whose plain full-attention layers hold `capacity` positions preallocated (prompt
    width + max_new_tokens); None when the model's cache layers are of another kind only (the caller then lets the
    model build its own cache)."""
    cache_cls, dyn = _dynamic_classes()
    cfg = getattr(model, "config", None)  # lib: transformers models carry `config`; a bare nn.Module has none
    try:
        cache = cache_cls(config=cfg)
    except Exception:  # a config transformers cannot read layer types from: its own cache
        return None
    cls = PreallocLayer()
    swapped = 0
    for i, layer in enumerate(cache.layers):
        if type(layer) is dyn:
            cache.layers[i] = cls()
            cache.layers[i].capacity = int(capacity)
            swapped += 1
    return cache if swapped else None
