"""`rollout.backend: hf_graphed` — the HF engine with static shapes and a captured decode step, for devices where
vLLM is absent (a GPU without it, an Ascend NPU without vllm-ascend).

`HFRollout` launches every kernel of every decode step from Python (~20 per decoder layer, plus transformers'
per-call bookkeeping): at the 1.7B shape and batch 128 that host work, not the device, bounds the step. Here:

- **Static KV cache**: each full-attention layer holds keys/values for `capacity` slots (prompt + budget, rounded
  up to `round_to` so later calls reuse it), written in place at a slot index held in a device tensor
  (`index_copy_`); attention reads the whole buffer under a boolean mask (real prompt tokens and the slots written
  so far). transformers' `StaticCache` does the same but reads its write position from `cache_position`, which
  transformers 5.17–5.25 no longer pass to the cache; this layer ignores the caller's positions and reads ours.
- **One decode step captured as a device graph** (`runtime.device.capture_graph`: `torch.cuda.CUDAGraph`, torch_npu's
  `NPUGraph`): token, position, slot and mask live in fixed buffers, so a step is one `replay()`. Manual capture
  rather than `torch.compile(mode="reduce-overhead")`: capture costs one step (well under a second), compilation
  of a 28-layer model tens of seconds, and the graph is the same kernels as the eager step.
- **The mask is passed pre-built, 4-D** (transformers' mask builders return a 4-D mask as it is; from a 2-D one
  they would test it on the host: a sync, illegal while capturing). With sdpa, decode attention groups each
  key/value head's query heads as a short query block (`_gqa_decode_sdpa`) instead of transformers' `repeat_kv`
  copy of the whole cache per layer and step (sdpa's own `enable_gqa` is off once a mask is given); the same
  sums, grouped.
- **Sampling stays outside the graph** in `rollout.decode_loop`, the loop `HFRollout` runs: the same draws from the
  same `generator` (one `multinomial` over the batch per step), the same truncation, log-probs, stop ids and
  masks. So for the same seed the samples equal the eager engine's wherever the step's logits are equal: on CPU
  (float64 in the tests) they are; on a GPU the masked full-length attention and the grouped heads reduce in
  another order, bf16 logits differ in the last bits, and a sample can diverge after a near-tie (the device check
  measures the token agreement and the log-prob gap).
- `ignore_eos`: every row runs to `max_new_tokens` (no stop ids; the all-finished host sync is skipped too).

The graph reads the module's parameters by address: the optimizer updates them in place, so later rollouts sample
the new weights with no hand-over (0 bytes, like `HFRollout`). A parameter or buffer that moved (offloaded and
back, a dtype cast), another batch size, a longer budget or another autocast state rebuilds cache and graph on the
next `generate`. `sleep` / `close` free them (the colocated trainer gets the memory back). On cpu, or with
`capture=False`, the same step runs uncaptured. Models with sliding-window or linear-attention layers, or an
attention implementation other than sdpa / eager (flash-attention reads no boolean mask) are refused with
`rollout.backend` named; so is a module sharded by FSDP2 (its forward gathers parameters into fresh memory).
"""

from __future__ import annotations

import contextlib
import time
from typing import Sequence

import torch

from ..errors import PlacementError
from ..models import forward, is_fsdp, unwrap
from ..runtime import device as devlib
from . import HFRollout, decode_loop, position_ids

__all__ = ["GraphedRollout", "StaticDecoder", "graphed_sample"]

_FIX = "use rollout.backend=hf"


class _SlotWriter:
    """Mixed into transformers' `DynamicLayer` (built lazily, so importing this module does not import
    transformers): `capacity` slots preallocated (zeros: unwritten slots are masked, and 0·NaN would not be 0),
    written at `slots` (a device tensor the decoder owns), the whole buffer returned."""

    capacity: int
    slots: torch.Tensor
    seen: int = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> None:
        B, H, _, D = key_states.shape
        self.device = key_states.device
        self.keys = key_states.new_zeros((B, H, self.capacity, D))
        self.values = value_states.new_zeros((B, value_states.shape[1], self.capacity, value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys.index_copy_(2, self.slots, key_states)
        self.values.index_copy_(2, self.slots, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.seen


_LAYER: dict = {}


def _slot_cache(model, capacity: int):
    """A transformers `DynamicCache` for `model` whose layers are slot writers; None when a layer is of another
    kind (sliding window, linear attention)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if "cls" not in _LAYER:
        _LAYER["cls"] = type("SlotLayer", (_SlotWriter, DynamicLayer), {})
    cache = DynamicCache(config=unwrap(model).config)
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    cache.layers = [_LAYER["cls"]() for _ in cache.layers]
    for layer in cache.layers:
        layer.capacity = capacity
    return cache


def _gqa_decode_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """sdpa for one decoded token with grouped key/value heads: query head h uses key/value head h // G (as
    transformers' `repeat_kv` pairs them), so the G query heads of a key/value head become a G-row query block
    against that head's cache — no copy of the cache. Other shapes go to transformers' sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, Hq, q, D = query.shape
    Hkv = key.shape[1]
    if q != 1 or Hq == Hkv:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(B, Hkv, Hq // Hkv, D), key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(B, Hq, 1, D).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _decode_attention(impl: str):
    """While a decode step runs (and is captured), the model's sdpa is `_gqa_decode_sdpa`."""
    if impl != "sdpa":
        yield
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS["sdpa"] = _gqa_decode_sdpa  # the instance's local mapping; the global one stays
    try:
        yield
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]


def _model_ptrs(model) -> tuple:
    """Where every parameter and buffer lives: a captured graph reads them there."""
    m = unwrap(model)
    return tuple(t.data_ptr() for t in list(m.parameters()) + list(m.buffers()))


def _autocast_state(kind: str) -> tuple:
    """A graph captured under autocast casts the weights inside it: its state is part of the graph's identity."""
    return torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)


class StaticDecoder:
    """Static buffers for batch `B` and `capacity` cache slots: `prefill` (eager) fills the cache from a
    left-padded prompt and returns its last logits; `step(tokens)` decodes one token per row — the captured graph's
    replay where `capture`, else the same step run eagerly."""

    def __init__(self, model, batch: int, capacity: int, device, capture: bool):
        impl = unwrap(model).config._attn_implementation or "eager"
        if impl not in ("sdpa", "eager"):
            raise PlacementError(f"rollout.backend=hf_graphed needs attn_implementation sdpa or eager, not "
                                 f"'{impl}' — {_FIX}, or load the model with sdpa")
        cache = _slot_cache(model, capacity)
        if cache is None:
            raise PlacementError("rollout.backend=hf_graphed supports full-attention models only (this one has "
                                 f"sliding-window or linear-attention layers) — {_FIX}")
        self.model, self.cache, self.impl, self.capture = model, cache, impl, capture
        self.kind = devlib.kind_of(device)
        self.B, self.L = batch, capacity
        self.key = (batch, capacity, _model_ptrs(model), _autocast_state(self.kind))
        self.tok = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.pos = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.slot = torch.zeros((1,), dtype=torch.long, device=device)
        self.key_ok = torch.zeros((batch, capacity), dtype=torch.bool, device=device)
        self.ar = torch.arange(capacity, device=device)
        self.graph = self.out = None
        self.capture_s = 0.0

    def fits(self, model, batch: int, need: int) -> bool:
        """Can this decoder serve `batch` rows of `need` slots with `model` as it is now?"""
        return (batch == self.B and need <= self.L and model is self.model
                and self.key[2:] == (_model_ptrs(model), _autocast_state(self.kind)))

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """The `[B,1,q,L]` mask in the attention implementation's form: bool for sdpa, additive for eager."""
        if self.impl == "sdpa":
            return allowed[:, None]
        dt = torch.get_autocast_dtype(self.kind) if torch.is_autocast_enabled(self.kind) else next(
            unwrap(self.model).parameters()).dtype
        return torch.zeros(allowed.shape, dtype=dt, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dt).min)[:, None]

    def _set_slots(self, slots: torch.Tensor, seen: int) -> None:
        for layer in self.cache.layers:
            layer.slots, layer.seen = slots, seen

    def prefill(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        P = prompt_ids.shape[1]
        self.key_ok.fill_(True)
        self.key_ok[:, :P] = prompt_mask.bool()
        q = torch.arange(P, device=prompt_ids.device)
        # causal over the real prompt tokens; each position also sees itself, so a padding row is never empty
        allowed = (self.key_ok[:, None, :] & (self.ar[None, None, :] <= q[None, :, None])) | (
            self.ar[None, None, :] == q[None, :, None])
        pos = position_ids(prompt_mask)
        self._set_slots(q, 0)
        logits, _ = forward(self.model, prompt_ids, self._mask(allowed), pos, cache=self.cache,
                            use_cache=True, logits_to_keep=1)
        self.pos.copy_(pos[:, -1:] + 1)
        self.slot.fill_(P)
        self._set_slots(self.slot, P)
        return logits[:, -1]

    def _step(self) -> torch.Tensor:
        """One decoded token per row from the static buffers: what the graph holds."""
        allowed = (self.key_ok & (self.ar <= self.slot))[:, None, :]
        with _decode_attention(self.impl):
            logits, _ = forward(self.model, self.tok, self._mask(allowed), self.pos,
                                cache=self.cache, use_cache=True)
        return logits[:, -1]

    def step(self, tok: torch.Tensor) -> torch.Tensor:
        self.tok.copy_(tok[:, None])
        if not self.capture:
            out = self._step()
        else:
            if self.graph is None:
                t0 = time.perf_counter()
                self.graph, self.out = devlib.capture_graph(self.kind, self._step)
                self.capture_s = time.perf_counter() - t0
            self.graph.replay()
            out = self.out
        self.pos += 1
        self.slot += 1
        return out


@torch.no_grad()
def graphed_sample(decoder: StaticDecoder, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
                   max_new_tokens: int, eos_id: int | Sequence[int], pad_id: int, temperature: float = 1.0,
                   top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, greedy: bool = False,
                   generator: torch.Generator | None = None, top_logprobs=None):
    """`rollout.sample` through a `StaticDecoder` (its batch and capacity must fit the prompts + budget)."""
    logits = decoder.prefill(prompt_ids, prompt_mask)
    return decode_loop(logits, decoder.step, max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                       temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, greedy=greedy,
                       generator=generator, top_logprobs=top_logprobs)


class GraphedRollout(HFRollout):
    """`rollout.backend: hf_graphed` — `HFRollout` (prompts, stop ids, batch layout, identity hand-over) with
    the static cache and captured decode step of `StaticDecoder`. `capture`: None = where the device has graphs
    (`runtime.device.graphs_supported`); `round_to`: cache slots are rounded up to a multiple of it so calls with
    slightly different prompt widths reuse one cache and graph; `ignore_eos`: completions run to the budget."""

    def __init__(self, model, tokenizer, device, max_prompt_tokens: int | None = None, *, chat=None,
                 formatter=None, ignore_eos: bool = False, capture: bool | None = None, round_to: int = 64):
        super().__init__(model, tokenizer, device, max_prompt_tokens, chat=chat, formatter=formatter)
        if is_fsdp(model):
            raise PlacementError("rollout.backend=hf_graphed cannot capture an FSDP2-sharded module (its forward "
                                 f"gathers the parameters into new memory every call) — {_FIX}")
        kind = devlib.kind_of(device)
        self.capture = devlib.graphs_supported(kind) if capture is None else bool(capture)
        self.ignore_eos, self.round_to = bool(ignore_eos), int(round_to)
        self.decoder: StaticDecoder | None = None
        self.builds = 0  # decoders built (a capture each where capture is on): the reuse is visible

    def _decoder(self, batch: int, need: int) -> StaticDecoder:
        if self.decoder is None or not self.decoder.fits(self.model, batch, need):
            self.release()
            cap = -(-need // self.round_to) * self.round_to
            self.decoder = StaticDecoder(self.model, batch, cap, self.device, self.capture)
            self.builds += 1
        return self.decoder

    def _sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, **kw):
        if self.ignore_eos:
            kw["eos_id"] = ()
        dec = self._decoder(prompt_ids.shape[0], prompt_ids.shape[1] + kw["max_new_tokens"])
        return graphed_sample(dec, prompt_ids, prompt_mask, **kw)

    def release(self) -> None:
        """Free the cache and the graph (rebuilt by the next `generate`)."""
        if self.decoder is not None:
            self.decoder = None
            devlib.empty_cache(devlib.kind_of(self.device))

    def sleep(self, level: int | None = None) -> None:
        """Give the KV cache and the graph's memory back to the trainer."""
        self.release()

    def close(self) -> None:
        self.release()
