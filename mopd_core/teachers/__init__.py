"""Teachers: scorers behind one interface and the router that turns per-teacher scores into ℓᵀ.

A scorer implements `score(batch, top_k=0) -> TeacherScore`: the teacher's log-prob of every sampled
completion token (and optionally its top-k), on the batch's device, and declares what else it can do
(`Teacher.scores_any_ids`, `Teacher.gives_hidden`). `local` keeps the model in-process (offloaded to CPU memory
between turns — `runtime.phases` moves it); the `http` backend (vLLM servers) plugs in behind the same interface.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..algorithms import mix_teacher_logprobs
from ..errors import TeacherError  # noqa: F401 - teachers.TeacherError stays the public name
from ..models import (check_same_tokenizer, load_model, load_tokenizer, logit_transform, tokenizer_fingerprint,
                      unwrap, weights_digest)
from ..rollout import RolloutBatch, score_completions
from ..rollout.shared import score_shared_prefix
from ..runtime.phases import teacher_turn


@dataclass
class TeacherScore:
    logp: torch.Tensor                    # [B,T] log-prob of each sampled token (0 where masked)
    topk_ids: torch.Tensor | None = None  # [B,T,k]
    topk_logp: torch.Tensor | None = None  # [B,T,k]
    support_logp: torch.Tensor | None = None  # [B,T,S] log-probs of the ids asked for (`support_ids`)


@dataclass
class TeacherHead:
    """What a full-vocabulary divergence needs of a teacher beside its hidden states: its `lm_head` and the
    transform between the projection and the softmax (`algorithms.full_vocab_divergence`)."""
    weight: torch.Tensor                  # [V,H] on the scoring device of the student
    bias: torch.Tensor | None
    scale: float
    softcap: float | None
    temperature: float


class Teacher:
    """What the router, the phase scheduler and the loop ask of a scorer (`LocalTeacher`, `http.HttpTeacher`):
    `name`, `path` (for messages), the tokenizer `fingerprint`, counters `stats`, `score`, and what it can do
    beside scoring the sampled tokens and their top-k (the flags below: the router asks them, never probes). The
    defaults describe a teacher whose model lives elsewhere (a server): nothing in this process to load, count or
    keep resident; `close` releases what it holds here (clients, pools)."""

    name: str
    path: str
    stats: dict
    fingerprint: str | None = None
    tokenizer = None  # its own tokenizer where known (a checkpoint's): what `bridge.TokenBridge` re-tokenizes with
    in_process = False  # its weights live in this process (memory pre-flight, colocated turns)
    scores_top_k = True  # `score(..., top_k=k)`: its own k most likely ids and their log-probs (kd_loss=jsd, …)
    scores_any_ids = False  # `score(..., support_ids=)`: log-probs of arbitrary ids (kd_loss=topk_rkl candidates)
    gives_hidden = False  # `hidden(batch, device)`: final hidden states and lm_head (kd_loss=full_jsd)
    param_bytes = 0     # bytes of those weights
    temperature = 1.0   # the softmax temperature of its log-probs (the compatibility pre-flight compares it)
    scores_before_training = True  # can be asked before the stage's trainers start (the pre-flight's probes)

    @property
    def resident(self) -> bool:
        """Whether its weights occupy the scoring device of this process now."""
        return False

    def load(self) -> None:
        """Bring the weights to the device before a turn (no-op without in-process weights). Called by the phase
        scheduler only (`runtime.phases.teacher_turn`)."""

    def unload(self) -> None:
        """Give the device memory back after a turn (no-op without in-process weights); the phase scheduler's."""

    def score(self, batch: RolloutBatch, top_k: int = 0) -> TeacherScore:
        """Log-probs of the sampled tokens (+ top-k). A scorer that can score arbitrary ids takes a keyword
        `support_ids [B,T,S]` and fills `support_logp` (the local one; a vLLM server cannot: its prompt_logprobs
        return the sampled token and the top-k only)."""
        raise NotImplementedError

    def hidden(self, batch: RolloutBatch, device) -> tuple[TeacherScore, torch.Tensor, TeacherHead]:
        """`score` plus the final hidden states and the head that projects them (only where `gives_hidden`)."""
        raise NotImplementedError

    def placement(self) -> dict | None:
        """Where its weights run when that is another process of this stage (a training worker), else None."""
        return None

    def cache_identity(self) -> dict | None:
        """What its scores depend on — weights, tokenizer, temperature, dtype, scoring path — for the score cache
        (`teachers.cache`); None: not known here, never cached."""
        return None

    def uncached(self) -> "Teacher":
        """The teacher that really scores: itself; a score-cache wrapper returns the one it wraps (the
        compatibility pre-flight must ask the model twice, not the cache)."""
        return self

    def span_cuts(self, batch: RolloutBatch) -> torch.Tensor | None:
        """`[B,T]` bool where a span of student tokens whose log-probs are exact only as a sum ends (a teacher with
        its own tokenizer: `bridge.TokenBridge.cuts`); None: every token's log-prob is exact on its own."""
        return None

    def token_mapping(self) -> str | None:
        """How its log-probs reach the student's tokens when it has a tokenizer of its own (a cross-tokenizer
        bridge: `bridge.CrossTokenizerTeacher`), for the compatibility pre-flight; None: it scores the student's
        tokens directly."""
        return None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool,
                    chat_template_kwargs: dict | None = None) -> str | None:
        """`messages` rendered as text by the teacher's own chat template (the compatibility pre-flight compares it
        with the student's); None when it has none. A scorer that cannot reach its template raises
        NotImplementedError (the pre-flight's row then says so)."""
        raise NotImplementedError

    def logprob_mode_gap(self, batch: RolloutBatch) -> tuple[float, str]:
        """How far its returned numbers are from normalised log-probs (the pre-flight's `logprob_mode` check), and
        what was compared. Here: its top-5 at every real position must be ≤ 0 and sum to ≤ 1 — the largest of
        max(logsumexp(top-5), max log p) over the positions (≤ 0 for log-probs; a server in vLLM's logits modes
        returns unnormalised numbers)."""
        if not self.scores_top_k:
            raise NotImplementedError
        sc = self.score(batch, 5)
        m = batch.completion_mask.bool().to(sc.logp.device)
        lse = torch.logsumexp(sc.topk_logp.float(), -1)
        gap = torch.maximum(lse, sc.topk_logp.float().amax(-1))[m]
        return (float(gap.max()) if gap.numel() else 0.0), "logsumexp of its top-5 log-probs (≤ 0)"

    def close(self) -> None:
        """Release what the scorer holds in this process; a server it talks to is not touched."""


class WrappingTeacher(Teacher):
    """A teacher in front of another one, `inner` (the score cache's `CachedTeacher`, the token bridge's
    `CrossTokenizerTeacher`, the test copy `RetokenizedCopy`): its memory, device turns, placement, counters and
    lifetime are the inner teacher's; a subclass changes what scoring returns."""

    def __init__(self, inner: Teacher):
        self.inner = inner
        self.name = inner.name
        self.in_process, self.param_bytes = inner.in_process, inner.param_bytes
        self.temperature = inner.temperature
        self.scores_before_training = inner.scores_before_training

    @property
    def stats(self) -> dict:
        return self.inner.stats

    @property
    def resident(self) -> bool:
        return self.inner.resident

    def load(self) -> None:
        self.inner.load()

    def unload(self) -> None:
        self.inner.unload()

    def placement(self) -> dict | None:
        return self.inner.placement()

    def span_cuts(self, batch: RolloutBatch) -> torch.Tensor | None:
        return self.inner.span_cuts(batch)

    def close(self) -> None:
        self.inner.close()


class LocalTeacher(Teacher):
    """In-process teacher. With `offload`, weights live in CPU memory and visit the device only for a turn
    (`runtime.phases.teacher_turn` loads and unloads them around `score`/`hidden`)."""

    in_process = True
    scores_any_ids = True
    gives_hidden = True

    def __init__(self, name: str, path: str | Path, device: torch.device, dtype: str = "float32",
                 offload: bool = True, temperature: float = 1.0, batch_size: int | None = None,
                 logprob_impl: str = "chunked", share_prefix: bool = False):
        self.name, self.path, self.device = name, str(path), torch.device(device)
        # teachers.share_prefix: each distinct prompt of a micro-batch prefilled once, its KV cache shared by the
        # group's completions (rollout.shared) — the same numbers up to float rounding
        self.share_prefix = share_prefix
        self.logprob_impl = logprob_impl  # train.logprob_impl: the student's and teachers' log-probs alike
        # `offload` is kept as asked even on CPU (where moving weights is a no-op) so residency bookkeeping — at
        # most one teacher loaded at a time in colocated placement — is the same on every device
        self.offload = offload
        self.temperature, self.batch_size = temperature, batch_size
        self.tokenizer = load_tokenizer(path)
        self.fingerprint = tokenizer_fingerprint(self.tokenizer)
        self._moves = self.offload and self.device.type != "cpu"
        self.model = load_model(path, "cpu" if self._moves else self.device, dtype).eval()
        self.model.requires_grad_(False)
        self._loaded = not self.offload
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.stats = {"seconds": 0.0, "tokens": 0, "calls": 0}
        self._identity: dict | None = None

    @property
    def resident(self) -> bool:
        """Whether the weights occupy the scoring device now (always, without offload)."""
        return self._loaded

    def load(self) -> None:
        if not self._loaded:
            if self._moves:
                self.model.to(self.device)
            self._loaded = True

    def unload(self) -> None:
        if self.offload and self._loaded:
            if self._moves:
                self.model.to("cpu")
            self._loaded = False

    @torch.no_grad()
    def score(self, batch: RolloutBatch, top_k: int = 0, support_ids: torch.Tensor | None = None) -> TeacherScore:
        t0 = time.perf_counter()
        scorer = score_shared_prefix if self.share_prefix else score_completions
        sc = scorer(self.model, batch, self.temperature, impl=self.logprob_impl, top_k=top_k,
                    micro_batch_size=self.batch_size, support_ids=support_ids)
        out = TeacherScore(sc.logp, sc.topk_ids, sc.topk_logp, sc.support_logp)
        self._count(batch, t0)
        return out

    def cache_identity(self) -> dict:
        """The weights as loaded (a digest of every parameter and buffer: what the scores come from), the
        tokenizer, temperature, dtype, logit transform and the scoring path."""
        if self._identity is None:
            m = self.model
            self._identity = {
                "kind": "local", "weights": weights_digest(m),
                "tokenizer": self.fingerprint, "temperature": self.temperature, "logprob_impl": self.logprob_impl,
                "dtype": str(next(m.parameters()).dtype), "logit_transform": list(logit_transform(m)),
                "share_prefix": self.share_prefix}
        return self._identity

    def _count(self, batch: RolloutBatch, t0: float) -> None:
        self.stats["seconds"] += time.perf_counter() - t0
        self.stats["tokens"] += int(batch.completion_mask.sum())
        self.stats["calls"] += 1

    def render_chat(self, messages: list[dict], add_generation_prompt: bool,
                    chat_template_kwargs: dict | None = None) -> str | None:
        if not self.tokenizer.chat_template:
            return None
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False, **(chat_template_kwargs or {}))

    @torch.no_grad()
    def logprob_mode_gap(self, batch: RolloutBatch) -> tuple[float, str]:
        """The scoring path (train.logprob_impl; chunked applies the logit transform read from the model's config,
        `models.logit_transform`) against log_softmax(forward logits / τ) of the model's own forward: a family
        whose forward transforms its logits in a way the config does not say (or the other way round) differs."""
        got = self.score(batch).logp
        ref = score_completions(self.model, batch, self.temperature, impl="full", micro_batch_size=self.batch_size)
        m = batch.completion_mask.bool()
        gap = (got - ref.logp).abs()[m]
        return (float(gap.max()) if gap.numel() else 0.0), (f"max |Δ log p| of the {self.logprob_impl} scoring path "
                                                            "vs log_softmax of the model's forward")

    @torch.no_grad()
    def hidden(self, batch: RolloutBatch, device) -> tuple[TeacherScore, torch.Tensor, TeacherHead]:
        """`score` plus the final hidden states of the real completion positions `[N,H]` (row-major) and the head
        that projects them, on `device`, from the same forward (kd_loss=full_jsd: the divergence is taken over the
        whole vocabulary, chunked)."""
        t0 = time.perf_counter()
        sc = score_completions(self.model, batch, self.temperature, impl="chunked",
                               micro_batch_size=self.batch_size, hidden=True)
        head = unwrap(self.model).get_output_embeddings()
        softcap, scale = logit_transform(self.model)
        # a copy when the weights leave the device after the turn: the update projects through it later
        w = head.weight.detach().to(device, copy=self._moves)
        bias = None if head.bias is None else head.bias.detach().to(device, copy=self._moves)
        out = TeacherScore(sc.logp), sc.hidden.to(device), TeacherHead(w, bias, scale, softcap, self.temperature)
        self._count(batch, t0)
        return out


def check_routing(teacher_ids, teacher_names) -> None:
    """Domain routing: every teacher_id of the data needs a teacher of that name (cheap: run it before starting
    any server or loading any model)."""
    names = list(teacher_names)
    for tid in sorted(set(teacher_ids)):
        if tid not in names:
            raise TeacherError(f"unknown teacher_id '{tid}': no teacher serves it; known teachers: "
                               f"{', '.join(names) or 'none'} — add a teacher for it or fix the data")


@dataclass
class RoutedScore:
    logp: torch.Tensor                         # [B,T] ℓᵀ after routing / mixing
    teacher_index: torch.Tensor                # [B] index of the routed teacher (mixture: the domain's argmax)
    topk_ids: torch.Tensor | None = None
    topk_logp: torch.Tensor | None = None
    seconds: float = 0.0
    # teacher → (rows it scored [n], its own log-probs of those rows [n,T]) — for per-teacher metrics
    per_teacher: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    support_logp: torch.Tensor | None = None  # [B,T,S] ℓᵀ of `support_ids` after routing / mixing
    # mixture with support_ids: teacher → its own [B,T,S] (teachers.conflict=consensus picks among them)
    per_teacher_support: dict[str, torch.Tensor] = field(default_factory=dict)
    # [B,T] bool: where a span whose ℓᵀ is exact only as a sum ends (teachers with their own tokenizer; None: none
    # routed here) — the objective spreads a span's gap over its tokens (`algorithms.spread_span_gaps`)
    span_cut: torch.Tensor | None = None


class TeacherRouter:
    """Domain routing (each sample → the teacher of its `teacher_id`) or mixture routing (weights per teacher,
    optionally per domain; arithmetic or geometric (a product of experts); docs/objectives.md)."""

    def __init__(self, teachers: dict, routing: str = "domain", mixture_kind: str = "arithmetic",
                 mixture_weights: dict[str, float] | None = None,
                 domain_mixture_weights: dict[str, dict[str, float]] | None = None):
        if not teachers:
            raise TeacherError("no teachers given: MOPD needs one teacher per domain (teachers: {id: path})")
        self.teachers = dict(teachers)
        self.names = list(self.teachers)
        self.routing, self.mixture_kind = routing, mixture_kind
        self.mixture_weights = mixture_weights
        self.domain_mixture_weights = domain_mixture_weights or {}
        for table in [mixture_weights or {}, *self.domain_mixture_weights.values()]:
            for t in table:
                if t not in self.teachers:
                    raise TeacherError(f"teachers.mixture_weights names unknown teacher '{t}'; known teachers: "
                                       f"{', '.join(self.names)}")

    def check(self, student_fingerprint: str, teacher_ids) -> None:
        """Pre-flight: same tokenizer everywhere, a teacher for every teacher_id. Raises before any compute."""
        for name, t in self.teachers.items():
            check_same_tokenizer(student_fingerprint, t.fingerprint, name, f" ({t.path})")
        if self.routing == "domain":
            check_routing(teacher_ids, self.names)

    def _weights(self, teacher_ids: list[str], device) -> torch.Tensor:
        K = len(self.names)
        rows = []
        for tid in teacher_ids:
            table = self.domain_mixture_weights.get(tid) or self.mixture_weights or {n: 1.0 for n in self.names}
            rows.append([float(table.get(n, 0.0)) for n in self.names])
        w = torch.tensor(rows, dtype=torch.float32, device=device).reshape(len(teacher_ids), K)
        return w

    def _score_all(self, jobs: list[tuple[str, RolloutBatch]], top_k: int, visit,
                   supports: list[torch.Tensor | None] | None = None) -> list[TeacherScore]:
        """Score each (teacher, rows) job. In-process teachers go one after another, each inside `visit(name)`
        (the colocated phase scheduler loads one teacher at a time); remote (http) teachers are independent
        servers, so their requests run at the same time — 3 teachers cost about as long as the slowest one.
        `supports`: per job the ids `[n,T,S]` whose log-probs to return too (None: none)."""
        supports = supports or [None] * len(jobs)
        for n, _ in jobs:
            if top_k and not self.teachers[n].scores_top_k:
                raise TeacherError(f"teacher '{n}' cannot return its top-{top_k} log-probs; use another teacher "
                                   "backend or a kd_loss that needs only the sampled token")
        for (n, _), sup in zip(jobs, supports):
            if sup is not None and not self.teachers[n].scores_any_ids:
                raise TeacherError(f"teacher '{n}' cannot score the student's candidate tokens (a vLLM server's "
                                   "prompt_logprobs return the sampled token and its own top-k only); use a local "
                                   "teacher or mopd.kd_candidates=teacher")

        def one(n, b, sup):  # the keyword only when asked: a scorer without it (http) is never handed one
            return self.teachers[n].score(b, top_k, **({} if sup is None else {"support_ids": sup}))
        local = [n for n, _ in jobs if self.teachers[n].in_process]
        if len(jobs) > 1 and not local:
            with ThreadPoolExecutor(len(jobs), thread_name_prefix="router") as ex:
                futs = [ex.submit(one, n, b, sup) for (n, b), sup in zip(jobs, supports)]
                return [f.result() for f in futs]  # every future finishes before the pool exits
        out = []
        for (n, b), sup in zip(jobs, supports):
            with self._turn(n, visit):
                out.append(one(n, b, sup))
        return out

    def score(self, batch: RolloutBatch, top_k: int = 0, visit=None,
              support_ids: torch.Tensor | None = None) -> RoutedScore:
        """ℓᵀ for every completion token. `visit(teacher_name)` is an optional context manager entered around each
        in-process teacher's turn (phase scheduling, memory accounting). `support_ids [B,T,S]`: also ℓᵀ of those
        ids (kd_loss=topk_rkl's student candidates; local teachers only), mixed like ℓᵀ under mixture routing."""
        t0 = time.perf_counter()
        tids = [e.teacher_id for e in batch.examples]
        dev = batch.completion_ids.device
        B, T = batch.completion_ids.shape
        if self.routing == "domain":
            logp = torch.zeros(B, T, device=dev)
            index = torch.tensor([self.names.index(t) for t in tids], device=dev)
            tk_ids = torch.zeros(B, T, top_k, dtype=torch.long, device=dev) if top_k else None
            tk_lp = torch.zeros(B, T, top_k, device=dev) if top_k else None
            sup = torch.zeros(support_ids.shape, device=dev) if support_ids is not None else None
            per = {}
            jobs, job_rows = [], []
            for k, name in enumerate(self.names):
                rows = (index == k).nonzero().squeeze(-1)
                if rows.numel():
                    jobs.append((name, batch.select(rows)))
                    job_rows.append(rows)
            job_sup = None if support_ids is None else [support_ids[rows] for rows in job_rows]
            for (name, _), rows, s in zip(jobs, job_rows, self._score_all(jobs, top_k, visit, job_sup)):
                logp[rows] = s.logp.to(dev)
                per[name] = (rows, s.logp.to(dev))
                if top_k:
                    tk_ids[rows], tk_lp[rows] = s.topk_ids.to(dev), s.topk_logp.to(dev)
                if sup is not None:
                    sup[rows] = s.support_logp.to(dev)
            cut = self._span_cuts(batch, [(name, rows, b) for (name, b), rows in zip(jobs, job_rows)])
            return RoutedScore(logp, index, tk_ids, tk_lp, time.perf_counter() - t0, per, support_logp=sup,
                               span_cut=cut)
        if top_k:
            raise TeacherError("top-k scores (mopd.kd_loss=jsd, or topk_rkl with teacher candidates) need "
                               "teachers.routing=domain")
        scored = self._score_all([(n, batch) for n in self.names], 0, visit,
                                 None if support_ids is None else [support_ids] * len(self.names))
        scores = torch.stack([s.logp.to(dev) for s in scored])  # [K,B,T]
        w = self._weights(tids, dev)
        cm = batch.completion_mask.bool()
        mixed = mix_teacher_logprobs(scores, w, self.mixture_kind)
        mixed = torch.where(cm, mixed, torch.zeros_like(mixed))
        all_rows = torch.arange(B, device=dev)
        sup, per_sup = None, {}
        if support_ids is not None:  # each candidate mixed like the sampled token: [K,B,T,S] as [K,B,T·S]
            st = torch.stack([s.support_logp.to(dev) for s in scored])
            sup = mix_teacher_logprobs(st.flatten(2), w, self.mixture_kind).view(st.shape[1:])
            sup = torch.where(cm.unsqueeze(-1), sup, torch.zeros_like(sup))
            per_sup = {n: st[k] for k, n in enumerate(self.names)}
        return RoutedScore(mixed, w.argmax(-1), None, None, time.perf_counter() - t0,
                           {n: (all_rows, scores[k]) for k, n in enumerate(self.names)}, sup, per_sup,
                           self._span_cuts(batch, [(n, all_rows, batch) for n in self.names]))

    def _span_cuts(self, batch: RolloutBatch, jobs: list[tuple[str, torch.Tensor, RolloutBatch]]
                   ) -> torch.Tensor | None:
        """The span ends of the teachers that scored `jobs` ((teacher, its rows, those rows)); a row several
        teachers scored (mixture) cuts only where all of them do: the coarsest spans over which every mixed ℓᵀ sums
        exactly. None when every teacher's log-probs are exact per token."""
        out = None
        for name, rows, sub in jobs:
            c = self.teachers[name].span_cuts(sub)
            if c is None:
                continue
            if out is None:
                out = torch.ones(batch.completion_ids.shape, dtype=torch.bool, device=batch.completion_ids.device)
            out[rows] &= c.to(out.device)
        return None if out is None else out & batch.completion_mask.bool()

    def hidden(self, batch: RolloutBatch, visit=None
               ) -> tuple[RoutedScore, dict[str, tuple[torch.Tensor, torch.Tensor, TeacherHead]]]:
        """kd_loss=full_jsd, domain routing: `score`'s ℓᵀ and, from the same forwards, teacher → (its rows [n], the
        final hidden states of their real completion positions [N_t,H_t] row-major, its head); each in-process
        teacher inside `visit(name)`."""
        if self.routing != "domain":
            raise TeacherError("mopd.kd_loss=full_jsd needs teachers.routing=domain")
        t0 = time.perf_counter()
        dev = batch.completion_ids.device
        index = torch.tensor([self.names.index(e.teacher_id) for e in batch.examples], device=dev)
        logp = torch.zeros(batch.completion_ids.shape, device=dev)
        per, out = {}, {}
        for k, name in enumerate(self.names):
            rows = (index == k).nonzero().squeeze(-1)
            if not rows.numel():
                continue
            t = self.teachers[name]
            if not t.gives_hidden:
                raise TeacherError(f"mopd.kd_loss=full_jsd needs local teachers (teachers.backend=local): teacher "
                                   f"'{name}' cannot return hidden states")
            with self._turn(name, visit):
                sc, h, head = t.hidden(batch.select(rows), dev)
            logp[rows] = sc.logp.to(dev)
            per[name] = (rows, sc.logp.to(dev))
            out[name] = (rows, h, head)
        return RoutedScore(logp, index, seconds=time.perf_counter() - t0, per_teacher=per), out

    def _turn(self, name: str, visit):
        """An in-process teacher's turn: the caller's `visit(name)` (the phase scheduler's, which records memory
        too), else a bare `teacher_turn` — either way `runtime.phases` loads and unloads the weights."""
        return visit(name) if visit is not None else teacher_turn(self.teachers[name])

    def stats(self) -> dict[str, dict]:
        return {n: dict(t.stats) for n, t in self.teachers.items()}

    def close(self) -> None:
        """Release what the scorers hold in this process (HTTP clients and their pools); servers are not touched."""
        for t in self.teachers.values():
            t.close()


def build_local_router(paths: dict[str, str | Path], cfg, device, dtype: str = "float32",
                       logprob_impl: str = "chunked") -> TeacherRouter:
    """`cfg` is a TeachersConfig; `logprob_impl` is train.logprob_impl."""
    teachers = {n: LocalTeacher(n, p, device, dtype, cfg.offload, cfg.temperature, cfg.batch_size, logprob_impl,
                                cfg.share_prefix)
                for n, p in paths.items()}
    return TeacherRouter(teachers, cfg.routing, cfg.mixture_kind, cfg.mixture_weights, cfg.domain_mixture_weights)
