"""The policy update: PPO-clip (or the decoupled/dense/JSD variants) over one step's batch, `cfg.minibatches`
optimizer steps with gradient accumulation over micro-batches. Runs in the loop's process (`roles.updater.
LocalUpdater`) and on every Ray training rank (`distributed.cluster`), so it takes plain tensors and configs."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from .. import algorithms as alg
from .. import rollout as rollout_mod  # `completion_logprobs` looked up at call time (tests count the forwards)
from ..algorithms.logprobs import LogitTransform
from ..config import PolicyLoopConfig
from ..models import logit_transform, unwrap
from ..rollout import RolloutBatch, score_completions
from .kd import FullJSD, KDPlan
from .microbatch import padded_positions, row_lengths, token_budget_micro_batches, trim

_PPO_METRICS = ("clip_frac", "approx_kl", "ratio_mean")
_DECOUPLED_METRICS = ("is_weight_mean", "is_capped_frac", "behaviour_kl")


@dataclass
class _Update:
    """One `policy_update` call's inputs and what is derived from them once."""

    model: Any
    batch: RolloutBatch
    adv: torch.Tensor
    mask: torch.Tensor
    token_w: torch.Tensor | None
    routed: Any
    cfg: PolicyLoopConfig
    temperature: float
    logprob_impl: str
    max_tokens: int | None
    agree: Callable[[int], int] | None
    packed: bool
    kd_scale: float
    proximal: torch.Tensor | None
    is_cap: float | None
    is_mode: str
    plan: KDPlan | None
    full: FullJSD | None
    n_mbs: int = 1

    def __post_init__(self) -> None:
        self.use_jsd = self.routed is not None and self.cfg.kd_loss == "jsd"
        self.dense = self.plan is not None and self.plan.dense
        self.refresh = self.plan is not None and self.plan.refresh
        self.lens = row_lengths(self.batch) if self.max_tokens is not None else None
        self.computed = self.real = 0
        if self.full is not None:
            self.head = unwrap(self.model).get_output_embeddings()
            softcap, scale = logit_transform(self.model)
            self.s_tr = LogitTransform(self.temperature, softcap, scale)

    def micro_batches(self, mb: list[int]) -> list[list[int]]:
        """The minibatch's micro-batches: by token budget (`[]` = a zero-weight pass that keeps this rank in step
        with the others) or `cfg.micro_batch_size` rows at the batch's full width."""
        if self.max_tokens is not None:
            micros = token_budget_micro_batches(mb, *self.lens, self.max_tokens, packed=self.packed)
            if self.agree is not None:
                micros += [[] for _ in range(self.agree(len(micros)) - len(micros))]
            return micros
        micro = self.cfg.micro_batch_size or len(mb)
        return [mb[s:s + micro] for s in range(0, len(mb), micro)]


def policy_update(model, opt, sched, batch: RolloutBatch, adv, mask, token_w, routed, cfg: PolicyLoopConfig,
                  temperature: float, rng: random.Random, logprob_impl: str = "chunked",
                  max_tokens: int | None = None, agree: Callable[[int], int] | None = None,
                  packed: bool = False, kd_scale: float = 1.0, proximal: torch.Tensor | None = None,
                  is_cap: float | None = None, is_mode: str = "truncate", plan: KDPlan | None = None,
                  full: FullJSD | None = None) -> dict[str, float]:
    """`cfg.minibatches` optimizer steps over the batch; gradient accumulation over micro-batches with each
    micro-loss scaled by its token share, so the objective is the token-mean over the whole minibatch.
    `logprob_impl` is train.logprob_impl (`rollout.score_completions`). `max_tokens` is
    train.max_tokens_per_micro_batch: micro-batches by a token budget, each cut to its own longest row
    (`train.microbatch`), instead of `cfg.micro_batch_size` rows at the batch's full width. Under DDP/FSDP2 every
    rank must run as many forward/backward passes (each runs collectives), which a token budget does not
    guarantee: `agree(n)` returns the ranks' largest count (an all-reduce, as verl's dynamic batch size does), and
    a rank with fewer runs the rest as zero-weight passes over one of its rows. `perf/pad_frac`: the padding
    share of the positions all forwards computed (the zero-weight passes count as computed). `packed`
    (`train.packing`): each micro-batch's rows back to back without padding (`rollout.pack_rows`), the budget
    counting real tokens. `kd_scale` multiplies the JSD term (a Ray worker's `world · n_local / n_global`, the
    factor its token weights carry for the policy loss, so the ranks' mean is the whole batch's token mean).
    `proximal` ([B,T], async stale samples): the decoupled PPO objective's proximal log-probs, with the importance
    weight π_prox/π_behav capped at `is_cap` as `is_mode` says (`algorithms.policy_loss`). `plan`: the dense top-K
    loss (`adv` is then `[B,T,S]` over its slots) and/or reward refresh (`kd.KDPlan`); `full`: the teachers' hidden
    states of kd_loss=full_jsd, whose divergence joins the loss like the top-k JSD."""
    order = list(range(batch.size))
    if cfg.minibatches > 1:
        rng.shuffle(order)
    mbs = [order[i::cfg.minibatches] for i in range(cfg.minibatches)]
    u = _Update(model, batch, adv, mask, token_w, routed, cfg, temperature, logprob_impl, max_tokens, agree, packed,
                kd_scale, proximal, is_cap, is_mode, plan, full, len(mbs))
    agg: dict[str, float] = defaultdict(float)
    for mb_i, mb in enumerate(mbs):
        opt.zero_grad(set_to_none=True)
        n_mb = float(mask[mb].sum()) or 1.0
        micros = u.micro_batches(mb)
        for rows in micros:
            _micro_step(u, agg, mb, mb_i, rows, n_mb)
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        gn = gn.full_tensor() if isinstance(gn, DTensor) else gn  # FSDP2: a DTensor (already reduced)
        agg["grad_norm"] += float(gn) / len(mbs)
        agg["perf/pad_frac"] = 1.0 - u.real / max(u.computed, 1)
        agg["perf/micro_batches"] += float(len(micros))
        if not (math.isfinite(agg["loss"]) and math.isfinite(float(gn))):
            opt.zero_grad(set_to_none=True)
            return dict(agg)
        opt.step()
        sched.step()
    agg["weights_finite"] = float(weights_finite(model))
    return dict(agg)


def weights_finite(model) -> bool:
    """Whether every trained parameter is finite after the update: a finite loss and gradient can still step the
    weights to inf/NaN (a learning rate far too large), which the next step's loss would show only after the stage
    had been marked done on its last step. One fused norm per dtype and one host sync."""
    params = [p.detach() for p in model.parameters() if p.requires_grad]
    if not params:
        return True
    norms = torch._foreach_norm(params)  # a NaN/inf anywhere in a tensor makes its norm non-finite
    return bool(torch.isfinite(torch.stack([n.float() for n in norms])).all())


def _micro_step(u: _Update, agg: dict[str, float], mb: list[int], mb_i: int, rows: list[int], n_mb: float) -> None:
    """Forward, loss and backward of one micro-batch (`rows` empty: a zero-weight pass over the minibatch's first
    row, only to stay in step with the other ranks); its metrics are added to `agg`."""
    idle = not rows
    rows = rows or mb[:1]
    if u.max_tokens is not None:
        sub, t = trim(u.batch, rows)
    else:  # today's layout, untouched: the batch's full width (same numbers as before the budget)
        sub, t = u.batch.select(rows), u.batch.completion_ids.shape[1]
    c, r = padded_positions(sub)
    c = r if u.packed else c  # packed: only the real tokens are computed
    u.computed, u.real = u.computed + c, u.real + (0 if idle else r)
    sup = u.routed.topk_ids[rows, :t] if u.use_jsd else u.plan.slot_ids[rows, :t] if u.dense else None
    sc = score_completions(u.model, sub, u.temperature, impl=u.logprob_impl, entropy=True, support_ids=sup,
                           packed=u.packed, hidden=u.full is not None)
    mk = u.mask[rows, :t]
    a = u.adv[rows, :t]
    if u.refresh and mb_i > 0 and not idle:  # the first minibatch's weights made the stored advantage
        a = u.plan.advantage((sc.support_logp if u.dense else sc.logp).detach(), rows, t, mk)
        diff = (a - u.adv[rows, :t]).abs()
        agg["refresh/kd_adv_change"] += float((diff.sum(-1) if u.dense else diff).mul(mk).sum()) / n_mb
    loss, met = _ppo_loss(u, sc, sub, rows, t, mk, a)
    # weight by tokens, not by micro-batch count: the minibatch's token mean (0: a pass only to stay in step)
    share = 0.0 if idle else float(mk.sum()) / n_mb
    total = loss * share
    jsd = _jsd_term(u, sc, sub, rows, t, mk)
    if jsd is not None:
        total = total + u.cfg.w_kd * jsd * share * u.kd_scale
        agg["jsd"] += float(jsd.detach()) * share * u.kd_scale / u.n_mbs
    total.backward()
    with torch.no_grad():
        agg["entropy"] += 0.0 if idle else float((sc.entropy * mk).sum()) / n_mb / u.n_mbs
    for k in _PPO_METRICS + (() if u.proximal is None else _DECOUPLED_METRICS):
        agg[k] += met.get(k, 0.0) * share / u.n_mbs
    agg["loss"] += float(total.detach()) / u.n_mbs


def _ppo_loss(u: _Update, sc, sub: RolloutBatch, rows: list[int], t: int, mk, a):
    """The clipped policy loss of one micro-batch: over the dense slots, or the sampled token's (decoupled when
    the samples are stale)."""
    tw = u.token_w[rows, :t] if u.token_w is not None else None
    if u.dense:
        return alg.dense_policy_loss(sc.support_logp, u.plan.old_logp[rows, :t], a, u.plan.slots[rows, :t], mk,
                                     u.cfg.clip_low, u.cfg.clip_high, token_weights=tw)
    dec = {} if u.proximal is None else {"proximal_logp": u.proximal[rows, :t], "is_cap": u.is_cap,
                                         "is_mode": u.is_mode}
    return alg.policy_loss(sc.logp, sub.behaviour_logp, a, mk, u.cfg.clip_low, u.cfg.clip_high, token_weights=tw,
                           **dec)


def _jsd_term(u: _Update, sc, sub: RolloutBatch, rows: list[int], t: int, mk) -> torch.Tensor | None:
    """The micro-batch's JSD to the teachers (kd_loss jsd over their top-k, or full_jsd over the vocabulary);
    None for the advantage objectives."""
    if u.use_jsd:
        s_sup, t_sup = alg.support_from_gathered(sc.support_logp, sc.logp, u.routed.topk_ids[rows, :t],
                                                 u.routed.topk_logp[rows, :t], sub.completion_ids,
                                                 u.routed.logp[rows, :t])
        return alg.generalized_jsd(s_sup, t_sup, u.cfg.jsd_beta, mk)
    if u.full is not None:
        return u.full.divergence(sc.hidden, u.head, u.s_tr, rows, mk.bool(), u.cfg.jsd_beta) / max(float(mk.sum()),
                                                                                                      1.0)
    return None


def recompute_behaviour_logp(model, batch: RolloutBatch, temperature: float, impl: str = "chunked",
                             micro_batch_size: int | None = None, amp=contextlib.nullcontext, *,
                             packed: bool = False) -> tuple[RolloutBatch, dict[str, float]]:
    """`batch` with its behaviour log-probs replaced by the trainer's `completion_logprobs` (no gradient, in `amp`),
    and `rollout/trunc_logp_gap`: the mean over completion tokens of (engine's − recomputed), ≥ 0.

    With truncated sampling (rollout.top_p < 1, top_k > 0 or min_p > 0) the engines report processed log-probs
    (the renormalised truncated distribution, vLLM's processed_logprobs), which exceed the trainer's untruncated
    log_softmax(logits / T) by log(mass kept): used as π_old they make the first PPO ratio exp(−gap) instead of 1
    and shift the reverse-KL advantage by the gap. verl recomputes old_log_prob with the actor (the rollout's
    log-probs serve only its importance-sampling correction) and TRL's GRPO takes the old log-probs from the model,
    so the ratio and the advantage compare the trainer's distribution with itself. With a `PolicyTrainer` the
    driver's `model` holds the workers' weights of this step (reloaded after each update), so it scores for them.
    """
    with torch.no_grad(), amp():
        logp = rollout_mod.completion_logprobs(model, batch, temperature, impl=impl,
                                               micro_batch_size=micro_batch_size, packed=packed)
    cm = batch.completion_mask.bool()
    logp = torch.where(cm, logp, torch.zeros_like(logp)).to(batch.behaviour_logp.dtype)  # 0 where masked
    n = int(cm.sum())
    gap = float((batch.behaviour_logp.double() - logp.double())[cm].sum()) / n if n else 0.0
    return dataclasses.replace(batch, behaviour_logp=logp), {"rollout/trunc_logp_gap": gap}


def lr_lambda(cfg: PolicyLoopConfig):
    """The learning-rate factor of optimizer step `s` (0-based; `LambdaLR`): a linear warm-up over
    `warmup_steps`, then `lr_schedule` — 1, or a linear / cosine decay that reaches `min_lr_ratio` at the stage's
    last optimizer step (`steps × minibatches`: the scheduler steps once per minibatch)."""
    warm, lo, kind = cfg.warmup_steps, cfg.min_lr_ratio, cfg.lr_schedule
    span = max(1, cfg.steps * cfg.minibatches - warm - 1)

    def factor(s: int) -> float:
        if s < warm:
            return (s + 1) / warm
        if kind == "constant":
            return 1.0
        p = min(1.0, (s - warm) / span)
        return lo + (1.0 - lo) * ((1.0 - p) if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * p)))
    return factor


def enable_gradient_checkpointing(model) -> None:
    """transformers' activation checkpointing per decoder layer, non-reentrant (torch's recommended mode: works
    with FSDP2, with inputs that need no grad and under autocast). The rollout engines sample in eval mode, where
    transformers keeps the KV cache on."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
