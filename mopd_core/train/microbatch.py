"""Token-budget micro-batches (`train.max_tokens_per_micro_batch`): which rows of a minibatch share a
forward/backward, and each micro-batch cut to its own longest prompt and completion.

The references are verl's dynamic batch size (`rearrange_micro_batches`: as many micro-batches as the real
tokens need, balanced by Karmarkar–Karp) and AReaL's `mb_spec`. Both count real tokens because they run without
padding; here a micro-batch is still padded (left-padded prompts, right-padded completions), so the budget
counts the positions a forward computes — rows × (longest prompt + longest completion) — which is what its
activation memory grows with. Rows are taken longest first and a micro-batch is closed when the next row would
push it over the budget: rows of similar length share a micro-batch, so little of it is padding (a bin-packing
that fills a long row's micro-batch with short ones would need fewer passes but pad every short row to the long
one's width).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..rollout import RolloutBatch


def row_lengths(batch: RolloutBatch) -> tuple[list[int], list[int]]:
    """Real prompt and completion tokens of each row."""
    return batch.prompt_mask.sum(1).tolist(), batch.completion_mask.sum(1).tolist()


def token_budget_micro_batches(rows: Sequence[int], prompt_len: Sequence[int], completion_len: Sequence[int],
                               budget: int, packed: bool = False) -> list[list[int]]:
    """Split `rows` (indices into the length lists) into micro-batches whose padded size — rows × (longest
    prompt + longest completion) — stays within `budget`; `packed` (`train.packing`): whose real tokens do, as
    verl and AReaL count them. A row longer than the budget gets a micro-batch of its own (the pre-flight warns
    about such a budget; failing mid-stage would lose the step)."""
    order = sorted(rows, key=lambda r: (-(prompt_len[r] + completion_len[r]), r))  # index breaks ties: stable
    out: list[list[int]] = []
    cur: list[int] = []
    p_max = c_max = 0
    used = 0
    for r in order:
        p, c = max(p_max, prompt_len[r]), max(c_max, completion_len[r])
        n = prompt_len[r] + completion_len[r]
        if cur and ((used + n) if packed else (len(cur) + 1) * (p + c)) > budget:
            out.append(cur)
            cur, p, c, used = [], prompt_len[r], completion_len[r], 0
        cur.append(r)
        used += n
        p_max, c_max = p, c
    if cur:
        out.append(cur)
    return out


def trim(batch: RolloutBatch, rows: Sequence[int]) -> tuple[RolloutBatch, int]:
    """`batch.select(rows)` without the columns that are padding in every selected row (prompt columns on the
    left, completion columns on the right). Returns the cut batch and its completion width `T'`: the caller cuts
    its own `[B,T]` tensors to `[:, :T']`. At least one column of each stays, as an uncut batch has."""
    sub = batch.select(rows)
    P, T = sub.prompt_ids.shape[1], sub.completion_ids.shape[1]
    p = min(P, max(1, int(sub.prompt_mask.sum(1).max()))) if len(rows) else P
    t = min(T, max(1, int(sub.completion_mask.sum(1).max()))) if len(rows) else T
    return RolloutBatch(sub.prompt_ids[:, P - p:], sub.prompt_mask[:, P - p:], sub.completion_ids[:, :t],
                        sub.completion_mask[:, :t], sub.behaviour_logp[:, :t], sub.examples, sub.texts), t


def padded_positions(batch: RolloutBatch) -> tuple[int, int]:
    """(positions a forward over `batch` computes, how many of them are real tokens): `perf/pad_frac`."""
    am = batch.attention_mask()
    return am.numel(), int(torch.count_nonzero(am))
