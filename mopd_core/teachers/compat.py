"""The compatibility pre-flight of a MOPD stage: every teacher against the student, before any compute.

A teacher can load, tokenize like the student and still distil the wrong thing: another chat template (a
published reproduction broke on one), an end-of-turn token it never predicts, a replica that answers the same
request with other numbers, a server returning logits instead of log-probs, a temperature other than the
student's. `check_compatibility` probes each teacher on a few held-out prompts of the domains it scores, with
their reference answers ending in the student's stop token, and returns a `CompatReport`: one row per (teacher,
check) with its value, the renderings of the probe conversation on every side, and one line per failure naming
the teacher, the check, the value and the fix. The caller (`preflight.check_compatibility`) raises on failures
before the stage folder is claimed; the Prefect task logs the table in the stage's MLflow run.

Checks (`teachers.compat.<check>`: fail | warn | skip):

- `tokenizer`: the fingerprint equals the student's; another one "needs mapping" — unless `mappable(teacher)`
  describes how its log-probs are mapped onto the student's tokens (cross-tokenizer teachers);
- `chat_template`: the probe conversation and its generation prompt render alike (with data.chat off no template
  is rendered: skipped); a difference names the first differing piece (a role marker, the end of a turn, the
  generation prompt);
- `eos`: mean teacher log p(student's stop token) at the stop position after the reference answers;
- `determinism`: the probe scored twice (local: two forwards; http: two requests), max |Δ log p|;
- `logprob_mode`: `Teacher.logprob_mode_gap` — normalised log-probs of the teacher's own distribution;
- `temperature`: the teacher's τ equals rollout.temperature.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from ..config import CompatConfig, RecipeConfig
from ..models import tokenizer_fingerprint
from ..models.chat import PromptFormatter
from ..rollout import RolloutBatch
from ..runtime.phases import teacher_turn
from . import Teacher, TeacherError, TeacherRouter

CHECKS = ("tokenizer", "chat_template", "eos", "determinism", "logprob_mode", "temperature")


class CompatError(TeacherError):
    """A teacher failed the compatibility pre-flight: one line per failure; `report` holds the whole table."""

    def __init__(self, report: "CompatReport"):
        super().__init__("\n".join(report.failures()))
        self.report = report


@dataclass
class CompatRow:
    teacher: str
    check: str
    status: str        # pass | fail | warn (failed, but teachers.compat.<check>=warn) | skip (not run: why)
    value: str         # the measured value, in words
    fix: str = ""      # what to change when it failed

    def line(self) -> str:
        return f"compat: teacher '{self.teacher}': {self.check}: {self.value} — {self.fix}"


@dataclass
class CompatReport:
    rows: list[CompatRow] = field(default_factory=list)
    renderings: dict[str, dict[str, str]] = field(default_factory=dict)  # side → {conversation, prompt}

    def failures(self) -> list[str]:
        return [r.line() for r in self.rows if r.status == "fail"]

    def warnings(self) -> list[str]:
        return [r.line() for r in self.rows if r.status == "warn"]

    def to_json(self) -> dict[str, Any]:
        return {"rows": [vars(r) for r in self.rows], "renderings": self.renderings}

    def markdown(self) -> str:
        out = ["# Teacher compatibility pre-flight", "", "| teacher | check | status | value | fix |",
               "|---|---|---|---|---|"]
        out += [f"| {r.teacher} | {r.check} | {r.status} | {_cell(r.value)} | {_cell(r.fix)} |" for r in self.rows]
        for side, texts in self.renderings.items():
            out += ["", f"## {side}: probe conversation", "", "```", texts.get("conversation", ""), "```", "",
                    f"## {side}: prompt with generation prompt", "", "```", texts.get("prompt", ""), "```"]
        return "\n".join(out) + "\n"


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", "\\n")


@dataclass
class Probe:
    """A teacher's probe: held-out prompts of its domains rendered as the student renders them, each followed by
    its reference answer and the student's stop token (the last completion token)."""
    examples: list[Any]
    prompts: list[list[int]]
    completions: list[list[int]]
    conversation: list[dict] | None  # the first row as messages with its answer (chat on), else None


def probe_for(fmt: PromptFormatter, domains: Mapping[str, Any], names: Sequence[str], n: int) -> Probe:
    """Up to `n` held-out examples with a reference answer, taken in turn from the domains `names`. The answer is
    the verifier's (`answer`; what an expert is trained to end after), else the SFT completion."""
    pools = [[e for e in domains[d].eval_examples() if (e.answer or e.fields.get("completion")) is not None]
             for d in names if d in domains]
    exs = [p[i] for i in range(max((len(p) for p in pools), default=0)) for p in pools if i < len(p)][:n]
    tok = fmt.tokenizer
    comps = []
    for e in exs:
        text = e.answer if e.answer is not None else e.fields["completion"]
        # chat on: the template's end of turn up to its stop token; off: EOS, as SFT ends every completion
        comps.append(fmt.completion_ids(text) if fmt.enabled else
                     [int(t) for t in tok(text, add_special_tokens=False)["input_ids"]] + [int(tok.eos_token_id)])
    conv = None
    if exs and fmt.enabled:
        conv = fmt.messages(exs[0]) + [{"role": "assistant", "content": exs[0].answer or exs[0].fields["completion"]}]
    return Probe(exs, fmt.batch_ids(exs), comps, conv)


def probe_batch(probe: Probe, pad_id: int, device) -> RolloutBatch:
    """The probe as a batch every scorer takes: left-padded prompts, right-padded completions."""
    P, T = max(map(len, probe.prompts)), max(map(len, probe.completions))
    B = len(probe.prompts)
    p_ids, p_mask = torch.full((B, P), pad_id), torch.zeros(B, P, dtype=torch.long)
    c_ids, c_mask = torch.full((B, T), pad_id), torch.zeros(B, T, dtype=torch.long)
    for i, (p, c) in enumerate(zip(probe.prompts, probe.completions)):
        p_ids[i, P - len(p):], p_mask[i, P - len(p):] = torch.tensor(p), 1
        c_ids[i, :len(c)], c_mask[i, :len(c)] = torch.tensor(c), 1
    return RolloutBatch(p_ids.to(device), p_mask.to(device), c_ids.to(device), c_mask.to(device),
                        torch.zeros(B, T, device=device), list(probe.examples))


def check_compatibility(router: TeacherRouter, student_tokenizer, recipe: RecipeConfig,
                        domains: Mapping[str, Any], device,
                        mappable: Callable[[Teacher], str | None] | None = None) -> CompatReport:
    """Every check of every teacher of `router` against the student (`student_tokenizer`, with the run's
    `data.chat`). `mappable(teacher)`: how a teacher of another tokenizer is mapped onto the student's tokens
    (None: it is not) — cross-tokenizer teachers pass the tokenizer check through it. Returns the report; raises
    nothing (the caller decides). The teachers' counters are left as they were."""
    cfg = recipe.teachers.compat
    fmt = PromptFormatter(student_tokenizer, recipe.data.chat)
    student_fp = tokenizer_fingerprint(student_tokenizer)
    report = CompatReport()
    for name, cached in router.teachers.items():
        t = cached.uncached()  # the model itself: a score cache would answer the second scoring from the first
        names = [name] if router.routing == "domain" else list(domains)
        probe = probe_for(fmt, domains, names, cfg.probe_rows)
        tok_row = _tokenizer_row(name, student_fp, t, mappable)
        report.rows.append(_moded(cfg, tok_row))
        report.rows.append(_moded(cfg, _template_row(name, t, fmt, probe, report)))
        report.rows.append(_moded(cfg, _temperature_row(name, t, recipe)))
        if tok_row.status == "fail":  # ids the teacher does not read: its scores would mean nothing
            report.rows += [CompatRow(name, c, "skip", "not run: the tokenizer needs mapping first")
                            for c in ("eos", "determinism", "logprob_mode")]
            continue
        if not t.scores_before_training:
            report.rows += [CompatRow(name, c, "skip", "not run: the teacher scores on the training workers "
                                      "(teachers.placement=workers), which start with the stage's trainers")
                            for c in ("eos", "determinism", "logprob_mode")]
            continue
        if not probe.prompts:
            report.rows += [CompatRow(name, c, "skip", f"not run: no held-out example with a reference answer in "
                                      f"{', '.join(names)}") for c in ("eos", "determinism", "logprob_mode")]
            continue
        batch = probe_batch(probe, student_tokenizer.pad_token_id, device)
        saved = dict(t.stats)
        try:
            with teacher_turn(t):  # an in-process teacher's weights on the device for the probe
                report.rows += [_moded(cfg, row) for row in _scoring_rows(name, t, batch, cfg)]
        finally:
            t.stats.clear()
            t.stats.update(saved)
    return report


def _moded(cfg: CompatConfig, row: CompatRow) -> CompatRow:
    """`teachers.compat.<check>`: skip → not run; warn → a failure is reported but does not stop the stage."""
    mode = cfg.model_dump()[row.check]
    if mode == "skip":
        return CompatRow(row.teacher, row.check, "skip", f"not checked (teachers.compat.{row.check}=skip)")
    if row.status == "fail" and mode == "warn":
        row.status = "warn"
    if row.status in ("fail", "warn"):
        row.fix += f" (or teachers.compat.{row.check}=warn|skip to train anyway)"
    return row


def _tokenizer_row(name: str, student_fp: str, t: Teacher, mappable) -> CompatRow:
    bridged = t.token_mapping()
    if bridged:
        return CompatRow(name, "tokenizer", "pass", f"mapped: {bridged}")
    if t.fingerprint == student_fp:
        return CompatRow(name, "tokenizer", "pass", f"same fingerprint {student_fp}")
    how = mappable(t) if mappable is not None else None
    if how:
        return CompatRow(name, "tokenizer", "pass", f"fingerprint {t.fingerprint} ≠ student {student_fp}, "
                         f"mapped: {how}")
    return CompatRow(name, "tokenizer", "fail", f"fingerprint {t.fingerprint} ≠ student {student_fp} — needs mapping",
                     f"use a teacher with the student's tokenizer ({t.path}: retrain the expert from the same base)")


def _temperature_row(name: str, t: Teacher, recipe: RecipeConfig) -> CompatRow:
    ro = recipe.rollout.temperature
    value = f"teacher τ={t.temperature:g}, rollout.temperature={ro:g}"
    if abs(t.temperature - ro) <= 1e-9:
        return CompatRow(name, "temperature", "pass", value)
    fix = (f"set rollout.temperature={t.temperature:g}, or teachers.temperature={ro:g} (local teachers; an http "
           "teacher's prompt_logprobs are at τ=1)")
    return CompatRow(name, "temperature", "fail", value + ": ℓ^old − ℓᵀ would compare different temperatures", fix)


def _scoring_rows(name: str, t: Teacher, batch: RolloutBatch, cfg: CompatConfig) -> list[CompatRow]:
    """eos, determinism and logprob_mode from the same probe batch (within the teacher's turn)."""
    rows = []
    m = batch.completion_mask.bool()
    last = m.long().sum(-1) - 1  # the student's stop token: the last completion position of each row
    first = t.score(batch).logp.float()
    eos = first[torch.arange(batch.size, device=first.device), last.to(first.device)]
    v = float(eos.mean())
    value = f"mean log p(stop) = {v:.3g} over {batch.size} probe rows (min {float(eos.min()):.3g})"
    rows.append(CompatRow(name, "eos", "pass", value) if v >= cfg.min_eos_logprob else CompatRow(
        name, "eos", "fail", f"{value} < teachers.compat.min_eos_logprob={cfg.min_eos_logprob:g}: the teacher "
        "does not end turns where the student does", "use a teacher that ends its answers with the student's "
        "EOS / end-of-turn token (same chat template and stop token), or lower teachers.compat.min_eos_logprob"))
    second = t.score(batch).logp.float()
    d = float((first - second).abs()[m.to(first.device)].max())
    value = f"max |Δ log p| = {d:.3g} between two scorings of the same probe"
    rows.append(CompatRow(name, "determinism", "pass", value) if d <= cfg.determinism_tol else CompatRow(
        name, "determinism", "fail", f"{value} > teachers.compat.determinism_tol={cfg.determinism_tol:g}",
        "make the teacher deterministic (eval mode: no dropout; the same kernels and batch for a request; for a "
        "server, no sampling noise in prompt_logprobs) or raise teachers.compat.determinism_tol"))
    if d > cfg.determinism_tol:  # a reference forward would differ by the same noise: nothing to learn from it
        return rows + [CompatRow(name, "logprob_mode", "skip", "not run: the teacher is not deterministic")]
    try:
        gap, what = t.logprob_mode_gap(batch)
    except NotImplementedError:
        return rows + [CompatRow(name, "logprob_mode", "skip", "this teacher cannot be asked for a reference")]
    value = f"{what}: {gap:.3g}"
    rows.append(CompatRow(name, "logprob_mode", "pass", value) if gap <= cfg.logprob_tol else CompatRow(
        name, "logprob_mode", "fail", f"{value} > teachers.compat.logprob_tol={cfg.logprob_tol:g}: not the "
        "normalised log-probs of its distribution", "serve vLLM with --logprobs-mode raw_logprobs (not a logits "
        "mode); for a local model whose forward transforms the logits otherwise than its config says "
        "(softcapping, logit scale: models.logit_transform), set train.logprob_impl=full or fix its config"))
    return rows


def _template_row(name: str, t: Teacher, fmt: PromptFormatter, probe: Probe, report: CompatReport) -> CompatRow:
    """Both renderings of the probe conversation (and its prompt with the generation prompt) into the report, and
    the first piece where they differ: a role marker, the end of a turn, or the generation prompt."""
    if not fmt.enabled:
        return CompatRow(name, "chat_template", "skip", "data.chat.enabled=false: raw prompts, no template is "
                         "rendered on either side")
    if probe.conversation is None:
        return CompatRow(name, "chat_template", "skip", "no probe conversation (no example with an answer)")
    if t.token_mapping():  # a cross-tokenizer teacher re-renders every sample in its own template, by design
        return CompatRow(name, "chat_template", "skip", "its own template by design: each sample is re-rendered "
                         "in it (teachers.cross_tokenizer)")
    conv, prompt = probe.conversation, probe.conversation[:-1]
    mine = {"conversation": fmt.render(conv, False), "prompt": fmt.render(prompt, True)}
    kw = dict(fmt.chat.chat_template_kwargs)  # the student's template arguments (enable_thinking, …) for both
    report.renderings.setdefault("student", mine)
    try:
        theirs = {"conversation": t.render_chat(conv, False, kw), "prompt": t.render_chat(prompt, True, kw)}
    except NotImplementedError:
        return CompatRow(name, "chat_template", "skip", "this teacher's template cannot be read here")
    if theirs["conversation"] is None or theirs["prompt"] is None:
        return CompatRow(name, "chat_template", "fail", "the teacher has no chat template; the student renders "
                         "chat", "give the teacher the student's chat template (tokenizer_config.json) or set "
                         "data.chat.chat_template")
    report.renderings[f"teacher '{name}'"] = theirs
    diff = template_difference(conv, mine, theirs)
    if diff is None:
        return CompatRow(name, "chat_template", "pass", "same rendering of the probe conversation and generation "
                         "prompt")
    return CompatRow(name, "chat_template", "fail", diff, "distil from a teacher trained with the student's chat "
                     "template, or set data.chat.chat_template to the one the teachers use")


def template_difference(conv: list[dict], mine: Mapping[str, str], theirs: Mapping[str, str]) -> str | None:
    """None when both renderings agree; else the first differing piece, named: the text before/between/after the
    messages' contents (role markers, ends of turns) or the generation prompt, student vs teacher."""
    if dict(mine) == dict(theirs):
        return None
    a, b = _pieces(mine["conversation"], conv), _pieces(theirs["conversation"], conv)
    if a is None or b is None:
        return "the renderings differ and a message's content is not found in one of them (student " \
               f"{mine['conversation'][:80]!r} vs teacher {theirs['conversation'][:80]!r})"
    for (label, x), (_, y) in zip(a, b):
        if x != y:
            return f"{label}: student {x!r} vs teacher {y!r}"
    ga = _generation_prompt(mine["prompt"], conv)
    gb = _generation_prompt(theirs["prompt"], conv)
    if ga != gb:
        return f"generation prompt: student {ga!r} vs teacher {gb!r}"
    return f"prompt rendering: student {mine['prompt'][:80]!r} vs teacher {theirs['prompt'][:80]!r}"


def _pieces(text: str, conv: list[dict]) -> list[tuple[str, str]] | None:
    """The text around the contents of `conv` in `text`, each labelled by the turns it separates."""
    out, at = [], 0
    roles = [m["role"] for m in conv]
    for i, m in enumerate(conv):
        j = text.find(m["content"], at)
        if j < 0:
            return None
        label = f"{roles[0]} marker" if i == 0 else f"end of {roles[i - 1]} turn + {roles[i]} marker"
        out.append((label, text[at:j]))
        at = j + len(m["content"])
    out.append((f"end of {roles[-1]} turn", text[at:]))
    return out


def _generation_prompt(prompt: str, conv: list[dict]) -> str:
    """What the prompt adds after the last prompt message: the text from the end of its content on."""
    j = prompt.rfind(conv[-2]["content"]) if len(conv) >= 2 else -1
    return prompt[j + len(conv[-2]["content"]):] if j >= 0 else prompt
