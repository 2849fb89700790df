"""Teachers with their own tokenizer: the token bridge between the student's tokens and a teacher's.

A teacher listed in `teachers.cross_tokenizer` whose tokenizer differs from the student's is wrapped once, when the
teachers are built (`bridge_teachers`), in a `CrossTokenizerTeacher`; every other teacher is used as it is (the
same object: same-tokenizer numbers are unchanged, no extra work). The loop never asks which kind it has.

Per row, `TokenBridge.to_teacher` re-renders the sample in the teacher's own terms: the prompt through the teacher's
formatter (its chat template when `data.chat` is on; the raw prompt string otherwise), the student's completion
decoded to text and tokenized by the teacher tokenizer, and, when the student stopped on a stop token, the
teacher's own end (its end-of-turn tokens with chat, else its EOS). The teacher scores that sequence with its own
ids (in-process, or a vLLM server's `prompt_logprobs` on those ids); `TokenBridge.to_student` maps its per-token
log-probs back onto the student's tokens by character offsets in the completion text (ULD / TRL GOLD-style
alignment): a student token's ℓᵀ is the sum of the log-probs of the teacher tokens that END inside its span.

Boundary rule (why "end"): a teacher token that straddles two student tokens, or spans several, is charged whole to
the student token in which its last character lies; a student token in which no teacher token ends gets 0. So

- the sum of ℓᵀ over a completion equals the teacher's log-prob of the whole completion exactly (every teacher token
  is counted once) — the sequence-level reverse KL of the sampled completion is exact;
- where both tokenizations cut the text at the same places, ℓᵀ per student token is the teacher's exact log-prob
  of that piece; inside a span where they cut differently only the span's sum is exact (the split of a teacher
  token's probability over the student tokens it covers is not observable from the teacher's sampled-token
  log-probs alone; GOLD merges such groups the same way before comparing them). The bridge reports where such
  spans end (`span_cuts`); the sampled-token objective gives each token of a span the span's mean gap
  (`algorithms.spread_span_gaps`) rather than the raw split, whose 0s would reward whatever was sampled there.

Dense objectives (kd_loss topk_rkl, jsd, full_jsd) compare distributions over one vocabulary: a bridged teacher
declares it cannot give them (`scores_top_k`, `scores_any_ids`, `gives_hidden` False) and `config.py` refuses the
combination before any compute.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from ..config import ChatConfig
from ..errors import TeacherError
from ..models import tokenizer_fingerprint
from ..models.chat import PromptFormatter
from ..rollout import RolloutBatch
from . import Teacher, TeacherScore, WrappingTeacher


def completion_ends(tokenizer, ids: list[int]) -> tuple[str, list[int]]:
    """The text of completion tokens `ids` and the end (in characters of that text) of each token's span.

    Fast path: the text re-encoded gives the same ids, so the tokenizer's own offsets are the spans. A sampled
    sequence need not be the canonical tokenization of its text (a model may spell "ab" as "a","b"); then the
    ends come from decoding each prefix (a partial multi-byte character decodes to U+FFFD and is charged to the
    token where it starts: ends are kept non-decreasing and within the text, the last one at its end)."""
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if [int(t) for t in enc["input_ids"]] == [int(t) for t in ids]:
        return text, [int(e) for _, e in enc["offset_mapping"]]
    ends, top = [], 0
    for k in range(len(ids)):
        pre = tokenizer.decode(ids[:k + 1], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        top = min(max(top, len(pre)), len(text))
        ends.append(top)
    if ends:
        ends[-1] = len(text)
    return text, ends


def owners(student_ends: list[int], teacher_ends: list[int]) -> list[int]:
    """For each teacher token (by the end of its span), the index of the student token charged with its log-prob:
    the first student token whose span ends at or after it — the one containing its last character (boundary rule
    in the module docstring). A teacher token past the last student end (none, for the same text) goes to the last."""
    last = len(student_ends) - 1
    return [min(bisect.bisect_left(student_ends, e), last) for e in teacher_ends]


def span_cuts(student_ends: list[int], teacher_ends: list[int]) -> list[bool]:
    """Per student token: whether a span of student tokens whose teacher log-prob is exact only as a sum ends there.
    Spans end where both tokenizations cut the text (a student end that is also a teacher end, the last student
    token of equal ends: `owners` charges to the first) and at the last token (a teacher token past the text end
    goes there). Every teacher token is charged inside the span that holds its end, so each span's sum is exact."""
    t_set, n = set(teacher_ends), len(student_ends)
    return [k == n - 1 or (student_ends[k] in t_set and student_ends[k + 1] > student_ends[k]) for k in range(n)]


@dataclass
class Alignment:
    """Where each teacher completion token's log-prob goes: `owner [B,Tt]` the student completion position
    (-1: padding)."""
    owner: torch.Tensor


class TokenBridge:
    """The student's tokens ↔ one teacher's (module docstring). `student_stop_ids`: the ids the student stops on
    (a completion ending in one has the teacher's end appended, charged to that stop token)."""

    def __init__(self, student_tokenizer, teacher_tokenizer, chat: ChatConfig | None,
                 student_stop_ids: Iterable[int]):
        self.student, self.teacher = student_tokenizer, teacher_tokenizer
        # the teacher's own chat template: a data.chat.chat_template override is written for the student's
        own = (chat or ChatConfig()).model_copy(update={"chat_template": None})
        self.fmt = PromptFormatter(teacher_tokenizer, own)
        self.end_ids = list(self.fmt.turn_end_ids) if self.fmt.enabled else [int(teacher_tokenizer.eos_token_id)]
        self.stop_ids = {int(t) for t in student_stop_ids}
        self.pad_id = int(teacher_tokenizer.pad_token_id if teacher_tokenizer.pad_token_id is not None
                          else teacher_tokenizer.eos_token_id)
        self._row = functools.lru_cache(maxsize=8192)(self._map_row)  # this bridge's own, gone with it

    def row(self, ids: list[int]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[bool, ...]]:
        """One completion (its real tokens, the stop token included): the teacher's completion ids, per teacher id
        the student position it is charged to, and per student token whether a span ends there (`span_cuts`).
        Remembered per completion (`_row`): scoring and the objective's span ends both ask within a step, and a
        cache hit asks only for the spans."""
        return self._row(tuple(ids))

    def _map_row(self, ids: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[bool, ...]]:
        ids = list(ids)
        stopped = bool(ids) and ids[-1] in self.stop_ids
        content = ids[:-1] if stopped else ids
        text, s_ends = completion_ends(self.student, content)
        enc = self.teacher(text, add_special_tokens=False, return_offsets_mapping=True)
        t_ids = [int(t) for t in enc["input_ids"]]
        t_ends = [int(e) for _, e in enc["offset_mapping"]]
        own = owners(s_ends, t_ends) if content else [0] * len(t_ids)
        cuts = span_cuts(s_ends, t_ends)
        if stopped:  # the teacher's end of turn stands for the student's stop token: a span of its own
            t_ids += self.end_ids
            own += [len(ids) - 1] * len(self.end_ids)
            cuts.append(True)
        return tuple(t_ids), tuple(own), tuple(cuts)  # shared by every caller: immutable

    def rows(self, batch: RolloutBatch) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[bool, ...]]]:
        """`row` of every completion of the batch (its real tokens)."""
        c_ids, c_len = batch.completion_ids.cpu(), batch.completion_mask.cpu().long().sum(-1)
        return [self.row(c_ids[i, :int(c_len[i])].tolist()) for i in range(batch.size)]

    def cuts(self, batch: RolloutBatch) -> torch.Tensor:
        """`[B,T]` bool: the span ends of every row (`span_cuts`; False on padding). They depend on the ids only,
        so a cached score and a fresh one share them."""
        out = torch.zeros(batch.completion_ids.shape, dtype=torch.bool)
        for i, (_, _, row) in enumerate(self.rows(batch)):
            out[i, :len(row)] = torch.tensor(row, dtype=torch.bool)
        return out.to(batch.completion_ids.device)

    def to_teacher(self, batch: RolloutBatch) -> tuple[RolloutBatch, Alignment]:
        """The batch in the teacher's tokens (left-padded prompts, right-padded completions, mask = the real
        completion tokens) and where its completion log-probs go."""
        if len(batch.examples) != batch.size:
            raise TeacherError("a teacher with its own tokenizer re-renders each prompt: the batch must carry its "
                               "examples (score on the process that sampled it)")
        dev = batch.completion_ids.device
        prompts = self.fmt.batch_ids(batch.examples)
        rows = [r[:2] for r in self.rows(batch)]
        B, P = batch.size, max([len(p) for p in prompts] + [1])
        T = max([len(t) for t, _ in rows] + [1])
        p_ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        p_mask = torch.zeros(B, P, dtype=torch.long)
        t_ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        t_mask = torch.zeros(B, T, dtype=torch.long)
        owner = torch.full((B, T), -1, dtype=torch.long)
        for i, (p, (ids, own)) in enumerate(zip(prompts, rows)):
            if p:
                p_ids[i, P - len(p):], p_mask[i, P - len(p):] = torch.tensor(p), 1
            if ids:
                n = len(ids)
                t_ids[i, :n], t_mask[i, :n], owner[i, :n] = torch.tensor(ids), 1, torch.tensor(own)
        tb = RolloutBatch(p_ids.to(dev), p_mask.to(dev), t_ids.to(dev), t_mask.to(dev),
                          torch.zeros(B, T, device=dev), batch.examples, batch.texts)
        return tb, Alignment(owner.to(dev))

    @staticmethod
    def to_student(t_logp: torch.Tensor, al: Alignment, shape: tuple[int, int]) -> torch.Tensor:
        """ℓᵀ on the student's tokens `[B,T]`: each teacher token's log-prob added to its owner (0 elsewhere)."""
        valid = al.owner >= 0
        out = torch.zeros(shape, dtype=t_logp.dtype, device=t_logp.device)
        src = torch.where(valid, t_logp, torch.zeros_like(t_logp))
        return out.scatter_add_(1, al.owner.clamp(min=0).to(t_logp.device), src)


class CrossTokenizerTeacher(WrappingTeacher):
    """A teacher with its own tokenizer, seen in the student's tokens (module docstring). Loading, residency and
    counters are the wrapped teacher's; it gives the sampled token's log-prob only."""

    scores_top_k = False
    scores_any_ids = False
    gives_hidden = False

    def __init__(self, inner: Teacher, bridge: TokenBridge, student_fingerprint: str):
        super().__init__(inner)
        self.bridge = bridge
        self.fingerprint = student_fingerprint  # what it speaks after the bridge: the student's tokens
        self.teacher_fingerprint = inner.fingerprint
        self.tokenizer = inner.tokenizer

    def token_mapping(self) -> str | None:
        return (f"its own tokenizer {self.teacher_fingerprint} and chat template, log-probs mapped onto the "
                "student's tokens by character offsets (teachers.cross_tokenizer)")

    @property
    def path(self) -> str:
        return f"{self.inner.path} (own tokenizer, bridged)"

    def span_cuts(self, batch: RolloutBatch) -> torch.Tensor:
        return self.bridge.cuts(batch)

    def score(self, batch: RolloutBatch, top_k: int = 0) -> TeacherScore:
        if top_k:
            raise TeacherError(f"teacher '{self.name}' has its own tokenizer: it cannot give top-{top_k} log-probs "
                               "over the student's vocabulary; use mopd.kd_loss=sampled_rkl")
        tb, al = self.bridge.to_teacher(batch)
        s = self.inner.score(tb, 0)
        return TeacherScore(self.bridge.to_student(s.logp, al, tuple(batch.completion_ids.shape)))


def bridge_teachers(teachers: Mapping[str, Teacher], student_tokenizer, chat: ChatConfig | None,
                    allowed: Iterable[str], student_stop_ids: Iterable[int]) -> dict[str, Teacher]:
    """Each teacher as the loop sees it, chosen once: itself when it shares the student's tokenizer (or its
    tokenizer is not known here: the router's pre-flight compares fingerprints), a `CrossTokenizerTeacher` when
    it has another and is listed in `teachers.cross_tokenizer`."""
    allowed = set(allowed)
    unknown = sorted(allowed - set(teachers))
    if unknown:
        raise TeacherError(f"teachers.cross_tokenizer names unknown teacher '{unknown[0]}'; known teachers: "
                           f"{', '.join(teachers)}")
    student_fp = tokenizer_fingerprint(student_tokenizer)
    stops = list(student_stop_ids)
    out: dict[str, Teacher] = {}
    for name, t in teachers.items():
        if name not in allowed or t.fingerprint == student_fp:
            out[name] = t  # the fast path: the very same object
            continue
        if t.tokenizer is None:
            raise TeacherError(f"teacher '{name}' ({t.path}) is in teachers.cross_tokenizer but its tokenizer is "
                               "not known here — serve it from a checkpoint dir or give its manifest entry a "
                               "'tokenizer' path")
        out[name] = CrossTokenizerTeacher(t, TokenBridge(student_tokenizer, t.tokenizer, chat, stops), student_fp)
    return out
