"""The MOPD objective (docs/objectives.md) in pure torch: advantages, distillation signals, the policy loss, balancing.

Shapes: ``B`` samples, ``T`` completion positions, ``K`` teachers, ``V`` vocabulary, ``S`` a shared support.
Every function computes in its input's dtype on its input's device and never moves tensors between devices.

Advantages (stop-gradient; :mod:`.advantages`):
    - ``grpo_advantages(rewards [N], group_size, scale_by_std=True, eps=1e-6) -> [N]`` —
      ``(r − mean_g r) / (std_g r + eps)``, unbiased std; constant groups give exactly 0.
    - ``reverse_kl_advantages(teacher_logp, behaviour_logp, mask, clip=None) -> [B, T]`` —
      ``clip(ℓᵀ − ℓ^old, −c, c)``, exactly 0 at masked positions.
    - ``spread_span_gaps(teacher_logp, behaviour_logp, span_end, mask) -> [B, T]`` — ℓᵀ re-split so each token of
      a span (exact only as a sum: a teacher with another tokenizer) gets the span's mean gap.
    - ``combine_advantages(rl_advantages, kd_advantages, mask, w_rl=1, w_kd=1) -> [B, T]`` —
      ``w_rl · A^R + w_kd · A^D``.

Distillation signals (:mod:`.distill`):
    - ``mix_teacher_logprobs(teacher_logps [K, B, T], weights [K] | [B, K], kind) -> [B, T]`` —
      ``"arithmetic"`` ``logsumexp_k(log w_k + ℓ_k)`` or ``"geometric"`` ``Σ_k w_k ℓ_k``.
    - ``topk_support(student_logp [B, T, V], teacher_topk_ids, teacher_topk_logp [B, T, k], sampled_ids=None,
      teacher_sampled_logp=None) -> (student [B, T, S], teacher [B, T, S])`` — {top-k ∪ sampled} + tail bucket.
    - ``support_from_gathered(student_topk_logp [B, T, k], student_sampled_logp [B, T], teacher_topk_ids, …)`` —
      the same from the student's log-probs already gathered at those ids (chunked scorers).
    - ``generalized_jsd(student_logp, teacher_logp [B, T, S], beta, mask) -> scalar`` — TRL-GKD's ``JSD_β``
      (β=0 forward KL(T‖S), β=1 reverse KL(S‖T)), mean over unmasked positions.

MOPD objectives (:mod:`.objectives`; docs/objectives.md):
    - ``candidate_slots(cand_ids [B, T, C], sampled_ids [B, T]) -> (slot_ids, kd_valid, rl_slot) [B, T, C+1]``.
    - ``topk_rkl_advantages(student_logp, teacher_logp, kd_valid [B, T, S], mask, clip=None) -> [B, T, S]`` —
      Open-MOPD's ``clip(ℓᵀ − ℓˢ) · p̃ˢ`` over the candidates.
    - ``dense_policy_loss(logp, old_logp, advantages, slots [B, T, S], mask, clip_low, clip_high, token_weights)``
      — PPO-clip per slot, summed over slots, token mean.
    - ``domain_gaps`` / ``ema_gaps`` / ``gap_scales`` — gap-following's ``clip(m_d / mean(m), lo, hi)``.
    - ``teacher_conflict(per_teacher_logp [K, B, T], student_logp, mask, nats) -> (conflict, pick) [B, T]``.
    - ``full_vocab_divergence(h_s [N, H], W_s, h_t, W_t, beta, ...) -> [N]`` — exact ``JSD_β``, chunked (TRL).

Log-probs from hidden states (:mod:`.logprobs`):
    - ``token_logprobs(hidden [N, H], weight [V, H], targets [N], LogitTransform(temperature, softcap, scale),
      impl="chunked", entropy=False, top_k=0, support_ids=None) -> TokenScores`` — log-prob (grad), entropy,
      top-k, support log-probs, in tiles recomputed in backward (never ``[N, V]``); ``logits_scores`` for logits.

Policy loss (:mod:`.loss`):
    - ``policy_loss(logp, behaviour_logp, advantages, mask, clip_low=0.2, clip_high=0.2, token_weights=None)
      -> (loss, metrics)`` — PPO-clip, token mean over the batch; metrics ``clip_frac``, ``ratio_mean``,
      ``ratio_max``, ``approx_kl`` (k3), ``loss``.

Balancing (:mod:`.balance`):
    - ``token_share_weights(group_ids [B], mask [B, T], prompt_share=None) -> [B, T]`` — each group's share of
      the loss equals its share of samples (or ``prompt_share``); weights sum to the token count.
    - ``balance_weights(kind, group_ids, mask, prompt_share=None)`` — ``"none"`` → ``None``, ``"tokens"``.
"""

from mopd_core.algorithms.advantages import (combine_advantages, grpo_advantages, reverse_kl_advantages,
                                            spread_span_gaps)
from mopd_core.algorithms.balance import BALANCE_KINDS, balance_weights, token_share_weights
from mopd_core.algorithms.distill import (MIX_KINDS, generalized_jsd, mix_teacher_logprobs, support_from_gathered,
                                         topk_support)
from mopd_core.algorithms.loss import policy_loss
from mopd_core.algorithms.objectives import (CANDIDATE_KINDS, CONFLICT_POLICIES, candidate_slots, dense_policy_loss,
                                             domain_gaps, ema_gaps, full_vocab_divergence, gap_scales,
                                             teacher_conflict, topk_rkl_advantages)

__all__ = [
    "BALANCE_KINDS",
    "CANDIDATE_KINDS",
    "CONFLICT_POLICIES",
    "candidate_slots",
    "dense_policy_loss",
    "domain_gaps",
    "ema_gaps",
    "full_vocab_divergence",
    "gap_scales",
    "teacher_conflict",
    "topk_rkl_advantages",
    "MIX_KINDS",
    "balance_weights",
    "combine_advantages",
    "generalized_jsd",
    "grpo_advantages",
    "mix_teacher_logprobs",
    "policy_loss",
    "reverse_kl_advantages",
    "spread_span_gaps",
    "support_from_gathered",
    "token_share_weights",
    "topk_support",
]
