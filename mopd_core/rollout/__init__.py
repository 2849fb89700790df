"""Rollout: the batch layout shared by sampling, teacher scoring and training, plus the generation engines.

Layout of a `RolloutBatch` (B sequences): prompts left-padded to P, completions right-padded to T:

    input_ids = [pad pad p0 p1 p2 | c0 c1 <eos> pad]      attention = [0 0 1 1 1 | 1 1 1 0]
                 ^ prompt_ids (B,P)   ^ completion_ids (B,T), completion_mask marks c0..<eos>

The log-prob of completion token t comes from the logits at position P-1+t; every scorer (behaviour policy,
trainer, local teacher) goes through `score_completions`, so their numbers are comparable by construction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..errors import DataError
from ..algorithms.logprobs import LogitTransform, logits_scores, token_logprobs
from ..models import forward, generation_config, last_hidden_state, logit_transform, unwrap
from ..models.chat import prompt_of, formatter_for, preview

log = logging.getLogger("mopd")


@dataclass
class CompletionScores:
    logp: torch.Tensor                        # [B,T] log-prob of each completion token, 0 where masked
    entropy: torch.Tensor | None = None       # [B,T] detached
    topk_ids: torch.Tensor | None = None      # [B,T,k]
    topk_logp: torch.Tensor | None = None     # [B,T,k] detached
    support_logp: torch.Tensor | None = None  # [B,T,S] log-probs of `support_ids` (with gradient)
    hidden: torch.Tensor | None = None        # [N,H] final hidden states of the N real completion positions, row-major

    def fields(self) -> tuple[torch.Tensor | None, ...]:
        return self.logp, self.entropy, self.topk_ids, self.topk_logp, self.support_logp, self.hidden


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor        # [B,P] left-padded
    prompt_mask: torch.Tensor       # [B,P]
    completion_ids: torch.Tensor    # [B,T] right-padded with pad id
    completion_mask: torch.Tensor   # [B,T] 1 for sampled tokens up to and including EOS
    behaviour_logp: torch.Tensor    # [B,T] log π_old(y_t) at the sampling temperature, 0 where masked
    examples: list[Any] = field(default_factory=list)  # one Example per row (prompt, teacher_id, answer…)
    texts: list[str] = field(default_factory=list)     # decoded completions (no special tokens)
    # the sampler's own top-k of the untruncated tempered log-softmax at each position, `[B,T,k]` ids and log-probs
    # (vLLM's `logprobs=k`), when the engine was asked for them (`generate(top_logprobs=k)`); None otherwise
    top_ids: torch.Tensor | None = None
    top_logp: torch.Tensor | None = None

    def top_logprobs(self, k: int) -> CompletionScores | None:
        """The sampler's top-`k` as the scores a no-grad scoring pass would give (`topk_ids`, `topk_logp`, and
        the behaviour log-probs as `logp`); None when the engine recorded no top-k or another k."""
        if self.top_ids is None or self.top_ids.shape[-1] != k:
            return None
        return CompletionScores(self.behaviour_logp, topk_ids=self.top_ids, topk_logp=self.top_logp)

    def _top(self, f) -> dict[str, torch.Tensor | None]:
        return {"top_ids": None if self.top_ids is None else f(self.top_ids),
                "top_logp": None if self.top_logp is None else f(self.top_logp)}

    @property
    def size(self) -> int:
        return self.prompt_ids.shape[0]

    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    def select(self, rows: torch.Tensor | Sequence[int]) -> "RolloutBatch":
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.prompt_ids.device)
        il = idx.tolist()
        return RolloutBatch(self.prompt_ids[idx], self.prompt_mask[idx], self.completion_ids[idx],
                            self.completion_mask[idx], self.behaviour_logp[idx],
                            [self.examples[i] for i in il] if self.examples else [],
                            [self.texts[i] for i in il] if self.texts else [], **self._top(lambda x: x[idx]))

    def to(self, device) -> "RolloutBatch":
        return RolloutBatch(self.prompt_ids.to(device), self.prompt_mask.to(device),
                            self.completion_ids.to(device), self.completion_mask.to(device),
                            self.behaviour_logp.to(device), self.examples, self.texts,
                            **self._top(lambda x: x.to(device)))

    def tensors(self, device="cpu") -> "RolloutBatch":
        """The tensors only, on `device`: what crosses a process boundary (to a Ray worker) — scoring and the
        update read nothing else, and the examples' Python objects would be pickled for nothing."""
        return RolloutBatch(self.prompt_ids.to(device), self.prompt_mask.to(device),
                            self.completion_ids.to(device), self.completion_mask.to(device),
                            self.behaviour_logp.to(device), **self._top(lambda x: x.to(device)))


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding (a left-padded row must see the same positions as an unpadded one)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


_BLOCK_MASK_WARN = 2**28  # elements of a block-diagonal mask (bool: 256 MiB) past which packing warns


@dataclass
class PackedRows:
    """Rows of a batch back to back without padding (`train.packing`): what one forward over them reads."""

    input_ids: torch.Tensor             # [1,L] each row's real prompt then completion tokens, row after row
    position_ids: torch.Tensor          # [1,L] restarting at 0 in every row
    attention_mask: torch.Tensor | None  # [1,1,L,L] block-diagonal causal (bool); None: the kernel reads the rows
    #                                      from position_ids (flash_attention_2's varlen path)
    predict_at: torch.Tensor            # [N] the position whose output predicts each real completion token, in
    #                                     the order of `completion_mask.bool()` (row-major)


def pack_rows(batch: RolloutBatch, block_mask: bool = True) -> PackedRows:
    """Pack `batch` (left-padded prompts, right-padded completions; the completion mask a prefix of each row)
    into one sequence of its real tokens. `block_mask`: build the [L,L] block-diagonal causal mask that sdpa and
    eager attention need (quadratic in L: fine on CPU and short rows); with flash_attention_2 pass False."""
    ids, pos, at = [], [], []
    off = 0
    for i in range(batch.size):
        p = batch.prompt_ids[i][batch.prompt_mask[i].bool()]
        c = batch.completion_ids[i][batch.completion_mask[i].bool()]
        n = p.numel() + c.numel()
        ids.append(torch.cat([p, c]))
        pos.append(torch.arange(n, device=p.device))
        at.append(off + p.numel() - 1 + torch.arange(c.numel(), device=p.device))  # token t ← position p-1+t
        off += n
    input_ids, position = torch.cat(ids)[None], torch.cat(pos)[None]
    mask = None
    if block_mask:
        if off * off > _BLOCK_MASK_WARN:
            log.warning("train.packing: a %d-token micro-batch needs a %d×%d attention mask with this model's "
                        "attention (%.2g GiB; sdpa may also fall back to its unfused kernel) — use "
                        "attn_implementation=flash_attention_2 (varlen, no mask) or a smaller "
                        "train.max_tokens_per_micro_batch", off, off, off, off * off / 2**30)
        seg = torch.repeat_interleave(torch.arange(len(ids), device=input_ids.device),
                                      torch.tensor([x.numel() for x in ids], device=input_ids.device))
        L = seg.numel()
        causal = torch.ones(L, L, dtype=torch.bool, device=input_ids.device).tril()
        mask = ((seg[:, None] == seg[None, :]) & causal)[None, None]
    return PackedRows(input_ids, position, mask, torch.cat(at))


def score_completions(model, batch: RolloutBatch, temperature: float = 1.0, *, impl: str = "chunked",
                      entropy: bool = False, top_k: int = 0, support_ids: torch.Tensor | None = None,
                      micro_batch_size: int | None = None, packed: bool = False,
                      hidden: bool = False) -> CompletionScores:
    """Every scorer's log-probs of the completion tokens under `model` (trainer, local teachers, eval): per
    token the log-prob (gradients flow outside `no_grad`), optionally the detached entropy, a top-k (under
    `no_grad`) and the log-probs of `support_ids [B,T,S]`. `impl="chunked"` projects only the real completion
    positions' final hidden states through `lm_head` in tiles (`algorithms.logprobs`: no `[T,V]` tensor, also in
    backward); `"full"` is the model's own logits and a `log_softmax` over `[B,T,V]` (the path before chunking).
    `packed`: one forward over the rows' real tokens back to back (`pack_rows`: positions restart per row, a
    block-diagonal mask, or flash-attention's varlen path when the model uses it), no padding computed; the
    same numbers as the padded forward up to float rounding (tested). `hidden`: also the final hidden states of the
    real completion positions `[N,H]` (row-major, as `completion_mask` lists them; chunked path only) — what a
    full-vocabulary divergence projects through both models' heads (`algorithms.full_vocab_divergence`)."""
    if hidden and impl != "chunked":
        raise ValueError("hidden states come from the chunked path: use impl='chunked'")
    B, T = batch.completion_ids.shape
    step = micro_batch_size or B
    parts = []
    for s in range(0, B, step):
        sub = batch.select(range(s, min(B, s + step))) if step < B else batch
        sup = support_ids[s:s + step] if support_ids is not None else None
        parts.append(_score_rows(model, sub, temperature, impl, entropy, top_k, sup, packed, hidden))
    if len(parts) == 1:
        return parts[0]
    return CompletionScores(*(None if col[0] is None else torch.cat(col) for col in zip(*(p.fields() for p in parts))))


def _score_rows(model, sub: RolloutBatch, temperature, impl, entropy, top_k, support_ids,
                packed: bool = False, want_hidden: bool = False) -> CompletionScores:
    T = sub.completion_ids.shape[1]
    ids, am = sub.input_ids(), sub.attention_mask()
    mask = sub.completion_mask.bool()
    kw = dict(entropy=entropy, top_k=top_k)
    if packed:
        return _score_packed(model, sub, mask, temperature, impl, support_ids, kw, want_hidden)
    if impl == "full":
        logits, _ = forward(model, ids, am, position_ids(am), logits_to_keep=T + 1)
        # position P-1+t predicts completion token t
        sc = logits_scores(logits[:, :-1], sub.completion_ids, temperature, support_ids=support_ids, **kw)
        # padded positions were computed too; zero them like the chunked path, which never computes them
        return CompletionScores(*(None if x is None else torch.where(_trail(mask, x.dim() - 2), x, 0) for x in
                                  (sc.logp, sc.entropy, sc.topk_ids, sc.topk_logp, sc.support_logp)))
    hidden = last_hidden_state(model, ids, am, position_ids(am))[:, -T - 1:-1][mask]  # [N,H]: real tokens only
    head = unwrap(model).get_output_embeddings()
    softcap, scale = logit_transform(model)
    sc = token_logprobs(hidden, head.weight, sub.completion_ids[mask], LogitTransform(temperature, softcap, scale),
                        bias=head.bias, impl=impl, support_ids=None if support_ids is None else support_ids[mask],
                        **kw)
    # masked_scatter keeps the result connected to the graph even when no position is real
    return CompletionScores(*(None if x is None else x.new_zeros(mask.shape + x.shape[1:]).masked_scatter(
        _trail(mask, x.dim() - 1), x) for x in (sc.logp, sc.entropy, sc.topk_ids, sc.topk_logp, sc.support_logp)),
        hidden=hidden if want_hidden else None)


def _score_packed(model, sub: RolloutBatch, mask, temperature, impl, support_ids, kw,
                  want_hidden: bool = False) -> CompletionScores:
    flash = unwrap(model).config._attn_implementation == "flash_attention_2"
    pk = pack_rows(sub, block_mask=not flash)
    targets = sub.completion_ids[mask]
    sup = None if support_ids is None else support_ids[mask]
    if impl == "full":
        logits, _ = forward(model, pk.input_ids, pk.attention_mask, pk.position_ids)
        sc = logits_scores(logits[:, pk.predict_at], targets[None], temperature,
                           support_ids=None if sup is None else sup[None], **kw)
        flat = [None if x is None else x[0] for x in (sc.logp, sc.entropy, sc.topk_ids, sc.topk_logp,
                                                      sc.support_logp)]
    else:
        hidden = last_hidden_state(model, pk.input_ids, pk.attention_mask, pk.position_ids)[0, pk.predict_at]
        head = unwrap(model).get_output_embeddings()
        softcap, scale = logit_transform(model)
        sc = token_logprobs(hidden, head.weight, targets, LogitTransform(temperature, softcap, scale),
                            bias=head.bias, impl=impl, support_ids=sup, **kw)
        flat = [sc.logp, sc.entropy, sc.topk_ids, sc.topk_logp, sc.support_logp]
    return CompletionScores(*(None if x is None else x.new_zeros(mask.shape + x.shape[1:]).masked_scatter(
        _trail(mask, x.dim() - 1), x) for x in flat), hidden=hidden if want_hidden and impl != "full" else None)


def _trail(mask: torch.Tensor, n: int) -> torch.Tensor:
    """`mask` with `n` trailing singleton dims (to broadcast over top-k / support columns)."""
    return mask.reshape(mask.shape + (1,) * n)


def completion_logprobs(model, batch: RolloutBatch, temperature: float = 1.0, *, impl: str = "chunked",
                        micro_batch_size: int | None = None, packed: bool = False) -> torch.Tensor:
    """`[B,T]` log-probs of the completion tokens (0 where masked): `score_completions(...).logp`."""
    return score_completions(model, batch, temperature, impl=impl, micro_batch_size=micro_batch_size,
                             packed=packed).logp


def prompt_ids(tokenizer, prompts: Sequence[Any], formatter=None, chat=None) -> list[list[int]]:
    """The token ids of each prompt as every engine feeds them — the one tokenisation rule
    (`models.chat.PromptFormatter`; the pre-flight length check of the data uses it too). `prompts`: Examples, raw
    strings or chat messages; `formatter` (shares its cache) or `chat` (the `data.chat` section) say how they are
    rendered; neither = raw strings, `add_special_tokens=True`, as before chat formatting existed."""
    if not len(prompts):
        return []
    return formatter_for(tokenizer, formatter if formatter is not None else chat).batch_ids(list(prompts))


def encode_prompts(tokenizer, prompts: Sequence[Any], device, max_prompt_tokens: int | None = None, formatter=None,
                   chat=None):
    """Left-pad tokenised prompts (`prompt_ids`) into `[B,P]` ids and mask."""
    enc = prompt_ids(tokenizer, prompts, formatter, chat)
    if max_prompt_tokens is not None:
        for p, e in zip(prompts, enc):
            if len(e) > max_prompt_tokens:
                raise DataError(f"prompt of {len(e)} tokens exceeds data.max_prompt_tokens={max_prompt_tokens}:"
                                f" {preview(prompt_of(p))!r}… — raise data.max_prompt_tokens or shorten "
                                "the prompt")
    P = max(len(e) for e in enc)
    pad = tokenizer.pad_token_id
    ids = torch.full((len(enc), P), pad, dtype=torch.long)
    mask = torch.zeros((len(enc), P), dtype=torch.long)
    for i, e in enumerate(enc):
        if e:
            ids[i, P - len(e):] = torch.tensor(e)
            mask[i, P - len(e):] = 1
    return ids.to(device), mask.to(device)


def assemble_completions(tokenizer, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                         rows: Sequence[tuple[Sequence[int], Sequence[float]]], examples: Sequence[Any],
                         device) -> RolloutBatch:
    """The `RolloutBatch` of completions sampled elsewhere (a vLLM engine or server): `rows` = each example's
    (sampled token ids, their behaviour log-probs), right-padded with the pad id (mask 0, log-prob 0); texts
    decoded without special tokens."""
    B = len(rows)
    T = max(1, max((len(t) for t, _ in rows), default=0))
    c_ids = torch.full((B, T), tokenizer.pad_token_id, dtype=torch.long)
    c_mask = torch.zeros((B, T), dtype=torch.long)
    c_lp = torch.zeros((B, T), dtype=torch.float32)
    for i, (toks, lps) in enumerate(rows):
        n = len(toks)
        if n:
            c_ids[i, :n] = torch.tensor(list(toks))
            c_mask[i, :n] = 1
            c_lp[i, :n] = torch.tensor(list(lps), dtype=torch.float32)
    texts = tokenizer.batch_decode([list(t) for t, _ in rows], skip_special_tokens=True)
    return RolloutBatch(prompt_ids.to(device), prompt_mask.to(device), c_ids.to(device), c_mask.to(device),
                        c_lp.to(device), list(examples), texts)


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_p, order = probs.sort(dim=-1, descending=True)
    drop = sorted_p.cumsum(-1) - sorted_p > top_p  # keep the smallest prefix with mass ≥ top_p
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_p)


def sampling_mask(logits: torch.Tensor, *, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> torch.Tensor:
    """Which tokens sampling may pick (bool, the shape of `logits`, already divided by the temperature), in vLLM's
    order: min_p (drop p < min_p · p_max), then top_k (the k largest; ties at the k-th kept), then top_p (the
    smallest prefix, by descending probability of what is left, renormalised, with mass ≥ top_p). The most
    likely token is always kept. Defaults keep every token."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        keep &= probs >= min_p * probs.amax(-1, keepdim=True)
    if 0 < top_k < logits.shape[-1]:
        kth = logits.masked_fill(~keep, float("-inf")).topk(top_k, dim=-1).values[..., -1:]
        keep &= logits >= kth
    if top_p < 1.0:
        probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
        keep &= _top_p_filter(probs, top_p) > 0
    return keep


@torch.no_grad()
def sample(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
           eos_id: int | Sequence[int], pad_id: int, temperature: float = 1.0, top_p: float = 1.0,
           top_k: int = 0, min_p: float = 0.0, greedy: bool = False, generator: torch.Generator | None = None,
           kv_cache: str = "preallocated", top_logprobs: "TopLogprobs | None" = None):
    """Batched sampling with a KV cache. Returns completion ids `[B,T]`, mask `[B,T]`, behaviour log-probs `[B,T]`.
    A row stops after any of the stop ids `eos_id` (one id or several: EOS and the chat template's end-of-turn
    token), which stays inside its mask.

    Behaviour log-probs are those of the distribution each token was drawn from — vLLM's
    `logprobs_mode="processed_logprobs"`, which `VllmRollout` uses: `log_softmax(logits / temperature)` restricted
    to the tokens `sampling_mask` keeps (min_p, top_k, top_p) and renormalised. Without truncation (top_p = 1,
    top_k = 0, min_p = 0, the defaults) that is the plain tempered log-softmax, the trainer's
    `completion_logprobs`; with it, it exceeds the trainer's by log(mass kept) ≥ 0 (the policy loop then
    recomputes them with the trainer: `train.loop.recompute_behaviour_logp`). `greedy`: the tempered log-softmax
    of the argmax token (truncation never changes the argmax).

    `kv_cache`: "preallocated" (default) writes each token's keys/values into buffers sized for prompt + budget
    (`rollout.kvcache`), and the attention mask likewise; "dynamic" is transformers' growing `DynamicCache` (a
    `torch.cat` of the whole cache per token). Both give bit-identical samples and log-probs (tested).

    `top_logprobs`: a `TopLogprobs` that records the top-k of each step's distribution (see `decode_loop`)."""
    if kv_cache not in ("preallocated", "dynamic"):
        raise ValueError(f"kv_cache={kv_cache!r}: use 'preallocated' or 'dynamic'")
    B, P = prompt_ids.shape
    dev = prompt_ids.device
    cache = None
    if kv_cache == "preallocated":
        from .kvcache import preallocated_cache

        cache = preallocated_cache(unwrap(model), P + max_new_tokens)
    # the mask of every step is a prefix of one buffer (no per-token torch.cat): ones past the prompt
    am_buf = torch.ones((B, P + max_new_tokens), dtype=prompt_mask.dtype, device=dev)
    am_buf[:, :P] = prompt_mask
    state = {"am": am_buf[:, :P], "cache": cache}
    pos = position_ids(state["am"])
    logits, state["cache"] = forward(model, prompt_ids, state["am"], pos, cache=cache, use_cache=True,
                                     logits_to_keep=1)
    state["pos"] = pos[:, -1:] + 1

    def step(tok: torch.Tensor) -> torch.Tensor:
        state["am"] = am_buf[:, :state["am"].shape[1] + 1]
        lg, state["cache"] = forward(model, tok[:, None], state["am"], state["pos"], cache=state["cache"],
                                     use_cache=True)
        state["pos"] = state["pos"] + 1
        return lg[:, -1]

    return decode_loop(logits[:, -1], step, max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                       temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, greedy=greedy,
                       generator=generator, top_logprobs=top_logprobs)


class TopLogprobs:
    """The top-`k` ids and log-probs of the untruncated tempered log-softmax at each sampled position — what a
    no-grad scoring pass of the same weights (`score_completions(top_k=k)`) computes, taken while the sampler holds
    each step's logits anyway (vLLM's `logprobs=k`). The dense top-K objective reads its candidates here instead
    of running that pass (`RolloutBatch.top_logprobs`). `[B,k]` a step, never a `[B,T,V]` tensor."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.ids: list[torch.Tensor] = []
        self.logp: list[torch.Tensor] = []

    def record(self, logp: torch.Tensor, live: torch.Tensor) -> None:
        """One step: `logp [B,V]` the untruncated tempered log-softmax; rows not `live` record zeros."""
        v, i = logp.topk(self.k, dim=-1)
        self.ids.append(torch.where(live[:, None], i, torch.zeros_like(i)))
        self.logp.append(torch.where(live[:, None], v, torch.zeros_like(v)))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`([B,T,k] ids, [B,T,k] log-probs)` of the steps recorded."""
        return torch.stack(self.ids, 1), torch.stack(self.logp, 1)


def decode_loop(logits: torch.Tensor, step, *, max_new_tokens: int, eos_id: int | Sequence[int], pad_id: int,
                temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                greedy: bool = False, generator: torch.Generator | None = None,
                top_logprobs: TopLogprobs | None = None):
    """The token loop every in-process sampler shares (`sample`, `rollout.graphed`): from the prompt's last logits
    `[B,V]`, draw a token per row, then `step(tokens [B]) -> next logits [B,V]`, until `max_new_tokens` or every
    row drew a stop id (`eos_id`; an empty sequence never stops: ignore_eos). One draw per step from `generator`
    over the whole batch, so two samplers whose `step` gives the same logits give the same samples. Returns
    completion ids, mask and behaviour log-probs `[B,T]` (see `sample`); `top_logprobs` records each step's top-k."""
    dev = logits.device
    stops = torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id), dtype=torch.long, device=dev)
    finished = torch.zeros(logits.shape[0], dtype=torch.bool, device=dev)
    toks, lps, masks = [], [], []
    truncates = not greedy and (top_p < 1.0 or top_k > 0 or min_p > 0.0)
    for i in range(max_new_tokens):
        lg = logits.float() / temperature
        live = ~finished
        # the untruncated distribution: what greedy and untruncated sampling draw from, and where a recorded
        # top-k comes from (not computed when only the truncated one is needed)
        logp = torch.log_softmax(lg, dim=-1) if greedy or not truncates or top_logprobs is not None else None
        if top_logprobs is not None:
            top_logprobs.record(logp, live)
        if greedy:
            tok = lg.argmax(-1)
        else:  # the distribution sampled from: truncated and renormalised when top_p / top_k / min_p are on
            if truncates:
                lg = lg.masked_fill(~sampling_mask(lg, top_p=top_p, top_k=top_k, min_p=min_p), float("-inf"))
                logp = torch.log_softmax(lg, dim=-1)
            tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        lp = logp.gather(-1, tok[:, None]).squeeze(-1)
        toks.append(torch.where(live, tok, torch.full_like(tok, pad_id)))
        lps.append(torch.where(live, lp, torch.zeros_like(lp)))
        masks.append(live.long())
        finished = finished | (tok[:, None] == stops).any(-1)  # elementwise: every device backend has it
        # the host sync of the all-finished test only where a row can stop; no forward past the budget
        if i == max_new_tokens - 1 or (stops.numel() and bool(finished.all())):
            break
        logits = step(toks[-1])
    return torch.stack(toks, 1), torch.stack(masks, 1), torch.stack(lps, 1)


class RolloutEngine:
    """What the loop and the phase scheduler ask of a rollout engine (`HFRollout`, `engines.VllmRollout`):
    `generate`, the weight hand-over `sync_weights(model) -> report`, and `sleep` / `wake` / `close`, which
    an engine holding no memory of its own leaves as these no-ops."""

    def generate(self, examples: Sequence[Any], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, greedy: bool = False, generator: torch.Generator | None = None,
                 batch_size: int | None = None, top_k: int = 0, min_p: float = 0.0,
                 top_logprobs: int = 0) -> RolloutBatch:
        """Sample one completion per example (`sample`'s truncation: top_k 0 and min_p 0 are off).
        `top_logprobs` k > 0: also record each position's top-k (`RolloutBatch.top_ids`/`top_logp`) where the
        engine holds the logits; an engine that does not leaves them None (the objective then scores them)."""
        raise NotImplementedError

    def sync_weights(self, model=None) -> dict:
        """Hand the trainer's current weights to the engine; returns a report (`bytes_copied`, `seconds`, …)."""
        raise NotImplementedError

    def stop_ids(self) -> list[int] | None:
        """Every id generation stops on (EOS, generation config, end-of-turn); None = unknown, and then every
        completion that used the whole budget counts as cut off (`evaluation.truncated_flags`)."""
        return None

    def sleep(self, level: int | None = None) -> None:
        """Give the device memory back between rollouts (colocated placement)."""

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Take the memory `sleep` gave back."""

    def close(self) -> None:
        """Release the engine for good (end of the stage)."""


class HFRollout(RolloutEngine):
    """`rollout.backend: hf` — samples from the trainer's own module (colocated by construction: the weight
    hand-over is the identity, zero bytes copied)."""

    def __init__(self, model, tokenizer, device, max_prompt_tokens: int | None = None, *, chat=None,
                 formatter=None, ignore_eos: bool = False):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.max_prompt_tokens = max_prompt_tokens
        self.ignore_eos = ignore_eos  # rollout.ignore_eos: every row runs to the budget (no stop ids)
        # `chat` (the data.chat section) or a shared `formatter`: how prompts become ids and which ids stop
        self.formatter = formatter_for(tokenizer, formatter if formatter is not None else chat)

    def stop_ids(self) -> list[int]:
        """EOS, the sampled model's generation-config eos ids, and the chat template's end-of-turn token."""
        return self.formatter.stop_ids(generation_config(self.model), self.tokenizer)

    def generate(self, examples: Sequence[Any], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, greedy: bool = False, generator: torch.Generator | None = None,
                 batch_size: int | None = None, top_k: int = 0, min_p: float = 0.0,
                 top_logprobs: int = 0) -> RolloutBatch:
        was_training = self.model.training
        self.model.eval()
        parts = []
        step = batch_size or len(examples)
        stops = [] if self.ignore_eos else self.stop_ids()
        try:
            for s in range(0, len(examples), step):
                chunk = list(examples[s:s + step])
                ids, mask = encode_prompts(self.tokenizer, chunk, self.device, self.max_prompt_tokens,
                                           formatter=self.formatter)
                top = TopLogprobs(top_logprobs) if top_logprobs else None
                c_ids, c_mask, c_lp = self._sample(
                    ids, mask, max_new_tokens=max_new_tokens, eos_id=stops,
                    pad_id=self.tokenizer.pad_token_id, temperature=temperature, top_p=top_p, top_k=top_k,
                    min_p=min_p, greedy=greedy, generator=generator, top_logprobs=top)
                texts = self.tokenizer.batch_decode(
                    [row[m.bool()].tolist() for row, m in zip(c_ids.cpu(), c_mask.cpu())],
                    skip_special_tokens=True)
                t_ids, t_lp = top.tensors() if top is not None else (None, None)
                parts.append(RolloutBatch(ids, mask, c_ids, c_mask, c_lp, chunk, texts, t_ids, t_lp))
        finally:
            self.model.train(was_training)
        return concat_batches(parts, self.tokenizer.pad_token_id)

    def _sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, **kw):
        """Completion ids, mask and behaviour log-probs of one chunk (`sample`'s arguments after the prompt)."""
        return sample(self.model, prompt_ids, prompt_mask, **kw)

    def sleep(self, level: int | None = None) -> None:
        """No-op: this engine holds no memory of its own (it samples from the trainer's module)."""

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """No-op (see `sleep`)."""

    def sync_weights(self, model=None) -> dict:
        """The identity hand-over: the engine samples from the trainer's module, so nothing moves (0 bytes).
        A different module passed here becomes the one sampled from."""
        if model is not None:
            self.model = model
        params = list(self.model.parameters())
        return {"transport": "identity", "tensors": len(params),
                "bytes_total": sum(p.numel() * p.element_size() for p in params), "bytes_copied": 0,
                "bytes_packed": 0, "messages": 0, "rpc_calls": 0, "load_method": "none", "seconds": 0.0}


def concat_batches(parts: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    if len(parts) == 1:
        return parts[0]
    P = max(p.prompt_ids.shape[1] for p in parts)
    T = max(p.completion_ids.shape[1] for p in parts)

    def left(x, n, v):
        return torch.nn.functional.pad(x, (n - x.shape[1], 0), value=v)

    def right(x, n, v):
        return torch.nn.functional.pad(x, (0, n - x.shape[1]), value=v)

    return RolloutBatch(
        torch.cat([left(p.prompt_ids, P, pad_id) for p in parts]),
        torch.cat([left(p.prompt_mask, P, 0) for p in parts]),
        torch.cat([right(p.completion_ids, T, pad_id) for p in parts]),
        torch.cat([right(p.completion_mask, T, 0) for p in parts]),
        torch.cat([right(p.behaviour_logp, T, 0.0) for p in parts]),
        [e for p in parts for e in p.examples], [t for p in parts for t in p.texts],
        *_concat_top(parts, T))


def _concat_top(parts: list[RolloutBatch], T: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The parts' recorded top-k, right-padded to `T` positions (None unless every part has them)."""
    if any(p.top_ids is None for p in parts):
        return None, None

    def pad(x):
        return torch.nn.functional.pad(x, (0, 0, 0, T - x.shape[1]))

    return torch.cat([pad(p.top_ids) for p in parts]), torch.cat([pad(p.top_logp) for p in parts])
