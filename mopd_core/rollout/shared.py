"""Scoring a group's completions from one prefill of their shared prompt (`teachers.share_prefix`).

GRPO/MOPD samples G completions per prompt, so a teacher that scores the rows one by one prefills every prompt G
times. Here each distinct prompt of a micro-batch runs through the model once (`use_cache`); its KV cache is then
indexed out to the rows that share it (`Cache.batch_select_indices`) and the completions run on top of it. The
log-prob of completion token 0 comes from the prompt's last position, token t ≥ 1 from completion position t-1:
the same hidden states `score_completions` projects, so the same `token_logprobs` path gives the same numbers
up to float rounding (tested in float64 against the unshared path).
"""

from __future__ import annotations

import torch

from ..algorithms.logprobs import LogitTransform, token_logprobs
from ..models import backbone_with_cache, logit_transform, unwrap
from . import CompletionScores, RolloutBatch, _trail, position_ids


def score_shared_prefix(model, batch: RolloutBatch, temperature: float = 1.0, *, impl: str = "chunked",
                        top_k: int = 0, support_ids: torch.Tensor | None = None,
                        micro_batch_size: int | None = None) -> CompletionScores:
    """`score_completions`' log-probs (+ top-k, + `support_ids [B,T,S]`) with each distinct prompt of a
    micro-batch prefilled once. Rows of one group should share a micro-batch (they are contiguous in a rollout
    batch: keep `micro_batch_size` a multiple of the group size)."""
    B = batch.size
    step = micro_batch_size or B
    parts = []
    for s in range(0, B, step):
        sub = batch.select(range(s, min(B, s + step))) if step < B else batch
        sup = support_ids[s:s + step] if support_ids is not None else None
        parts.append(_shared_rows(model, sub, temperature, impl, top_k, sup))
    if len(parts) == 1:
        return parts[0]
    return CompletionScores(*(None if col[0] is None else torch.cat(col) for col in zip(*(p.fields() for p in parts))))


def _shared_rows(model, sub: RolloutBatch, temperature, impl, top_k, support_ids) -> CompletionScores:
    hidden = shared_prefix_hidden(model, sub)
    mask = sub.completion_mask.bool()
    head = unwrap(model).get_output_embeddings()
    softcap, scale = logit_transform(model)
    transform = LogitTransform(temperature, softcap, scale)
    sc = token_logprobs(hidden[mask], head.weight, sub.completion_ids[mask], transform, bias=head.bias, impl=impl,
                        top_k=top_k, support_ids=None if support_ids is None else support_ids[mask])
    return CompletionScores(*(None if x is None else x.new_zeros(mask.shape + x.shape[1:]).masked_scatter(
        _trail(mask, x.dim() - 1), x) for x in (sc.logp, None, sc.topk_ids, sc.topk_logp, sc.support_logp)))


def shared_prefix_hidden(model, sub: RolloutBatch) -> torch.Tensor:
    """`[B,T,H]`: the final hidden state that predicts each completion token (what `score_completions` projects),
    each distinct prompt run once."""
    P = sub.prompt_ids.shape[1]
    # rows with the same real prompt have the same left-padded prompt row (one batch, one padding width)
    key = torch.cat([sub.prompt_ids * sub.prompt_mask, sub.prompt_mask], dim=1)
    uniq, inverse = torch.unique(key, dim=0, return_inverse=True)
    u_ids, u_mask = uniq[:, :P], uniq[:, P:]
    p_hidden, cache = backbone_with_cache(model, u_ids, u_mask, position_ids(u_mask))
    cache.batch_select_indices(inverse)  # each row reads its prompt's keys and values: no copy per token computed
    am = sub.attention_mask()
    c_hidden, _ = backbone_with_cache(model, sub.completion_ids, am, position_ids(am)[:, P:], cache)
    # position P-1 (the prompt's last) predicts completion token 0, completion position t-1 predicts token t
    return torch.cat([p_hidden[inverse, -1:], c_hidden[:, :-1]], dim=1)
