"""An exact re-tokenized copy of a teacher: the same model, reading another tokenizer's tokens.

`RetokenizedCopy(base, tokenizer)` is a teacher whose own tokenizer is `tokenizer` (e.g. a BPE over the same
alphabet) and whose log-prob of each of its tokens is the chain of the base teacher's log-probs of the base tokens
that spell it: log p(piece | prefix) = Σ_j log p_base(b_j | prefix, b_<j). Its log-prob of any text is the base
teacher's exactly, only cut into other tokens. So, behind the token bridge, its ℓᵀ must equal the base teacher's
per student token wherever the two tokenizations cut the text alike, and in every sequence sum: that is how the
bridge is checked end to end (tests/unit/test_cross_tokenizer.py) and how `benchmarks/cross_tokenizer.py` gets a
different-tokenizer code expert whose knowledge is the code expert's (labelled as such in its results).
"""

from __future__ import annotations

import torch

from ..models import tokenizer_fingerprint
from ..rollout import RolloutBatch
from . import LocalTeacher, TeacherScore, WrappingTeacher


class RetokenizedCopy(WrappingTeacher):
    """`base` (a `LocalTeacher`) read through `tokenizer` (module docstring). Loading and counters are the
    base's."""

    in_process = True
    scores_top_k = False

    def __init__(self, base: LocalTeacher, tokenizer):
        super().__init__(base)
        self.base, self.tokenizer = base, tokenizer
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        specials = set(tokenizer.all_special_ids)
        btok = base.tokenizer
        # each own id → the base ids that spell it (special tokens by name: EOS is EOS on both sides)
        self._spell = {}
        for tok, i in tokenizer.get_vocab().items():
            if i in specials:
                b = btok.convert_tokens_to_ids(tok)
                self._spell[i] = [b] if b is not None and b != btok.unk_token_id else [btok.unk_token_id]
            else:
                piece = tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
                self._spell[i] = [int(t) for t in btok(piece, add_special_tokens=False)["input_ids"]]

    @property
    def path(self) -> str:
        return f"{self.base.path} (re-tokenized copy)"

    def _base_batch(self, batch: RolloutBatch) -> tuple[RolloutBatch, list[list[int]]]:
        """The batch spelled in base tokens, and per row the number of base tokens of each own completion token."""
        B = batch.size
        p_rows, c_rows, counts = [], [], []
        pm, cm = batch.prompt_mask.cpu().bool(), batch.completion_mask.cpu().long().sum(-1)
        for i in range(B):
            p_rows.append([b for t in batch.prompt_ids[i][pm[i]].tolist() for b in self._spell[t]])
            own = batch.completion_ids[i, :int(cm[i])].tolist()
            counts.append([len(self._spell[t]) for t in own])
            c_rows.append([b for t in own for b in self._spell[t]])
        pad = int(self.base.tokenizer.pad_token_id)
        P, T = max(len(r) for r in p_rows), max([len(r) for r in c_rows] + [1])
        p_ids, p_mask = torch.full((B, P), pad), torch.zeros(B, P, dtype=torch.long)
        c_ids, c_mask = torch.full((B, T), pad), torch.zeros(B, T, dtype=torch.long)
        for i, (p, c) in enumerate(zip(p_rows, c_rows)):
            p_ids[i, P - len(p):], p_mask[i, P - len(p):] = torch.tensor(p, dtype=torch.long), 1
            if c:
                c_ids[i, :len(c)], c_mask[i, :len(c)] = torch.tensor(c, dtype=torch.long), 1
        dev = batch.completion_ids.device
        return RolloutBatch(p_ids.to(dev), p_mask.to(dev), c_ids.to(dev), c_mask.to(dev),
                            torch.zeros(B, T, device=dev), batch.examples, batch.texts), counts

    def score(self, batch: RolloutBatch, top_k: int = 0) -> TeacherScore:
        bb, counts = self._base_batch(batch)
        lp = self.base.score(bb).logp
        out = torch.zeros(batch.completion_ids.shape, dtype=lp.dtype, device=lp.device)
        for i, row in enumerate(counts):  # each own token: the sum of the base tokens that spell it
            seg = torch.repeat_interleave(torch.arange(len(row), device=lp.device),
                                          torch.tensor(row, device=lp.device))
            out[i].index_add_(0, seg, lp[i, :seg.numel()])
        return TeacherScore(out)
