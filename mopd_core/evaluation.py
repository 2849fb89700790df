"""Evaluation: per-domain accuracy as the papers report it, tables and plots.

Two paths, per domain:

- **held-out split** (a domain without `eval_sources`, e.g. the synthetic ones): greedy accuracy on the domain's
  held-out prompts, plus mean@k sampled at `eval.temperature` when `eval.mean_at_k` is set — exactly as before
  benchmarks existed (same numbers, same generator draws). Metric keys: `greedy`, `mean@<k>`.
- **benchmarks** (`data.domains[].eval_sources`): each benchmark is its own file with its own verifier, `n`
  samples per prompt, temperature (0 = greedy), top_p, top_k, min_p and token budget, generated through the given
  rollout engine in batches of `eval.batch_size` prompts (`HFRollout` when none is given). Metric keys
  `<bench>/<metric>` for every listed metric (mean@<n>, pass@<k>, truncation_rate, IFEval's prompt/instruction ×
  strict/loose), always `<bench>/truncation_rate`, `<bench>` = the headline (first) metric, and `score` = the
  mean of the domain's benchmark headlines.

`evaluate` returns both the scores (`{domain: {metric: value}}`, what `evaluate_model` returns) and one row per
completion (`ROW_KEYS`) for `write_rows_jsonl` (an MLflow artifact). A domain's headline is `greedy` (or the
table's metric) where it has one, else its `score`; the total is the mean of the domains' headlines;
`recovery` compares a row with two reference rows ((student − sft) / (expert − sft)).
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from .config import IFEVAL_METRICS, EvalConfig, EvalSource
from .domains.base import DomainError, Example, domain_rewards, thaw
from .rollout import HFRollout

# The keys of every per-row result (`EvalResult.rows`, one JSON object per line in `write_rows_jsonl`).
# benchmark: the eval_sources name, or `heldout:greedy` / `heldout:mean@<k>` on the held-out path; row: the
# prompt's index in the benchmark; sample: 0..n-1; prompt: the string or the chat messages; extracted: what the
# verifier took from the completion (None on the held-out path and where nothing was found); truncated: the
# completion used the whole token budget without a stop id; info: the verifier's details (benchmarks only).
ROW_KEYS = ("domain", "benchmark", "row", "sample", "prompt", "completion", "extracted", "reward", "truncated",
            "info")


@dataclass
class EvalResult:
    scores: dict[str, dict[str, float]]
    rows: list[dict[str, Any]] = field(default_factory=list)


# ---------------------------------------------------------------- metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with `c` correct of `n` samples: 1 − C(n−c, k) / C(n, k) (Chen et al. 2021,
    HumanEval), as the product 1 − Π_{i=n−c+1..n} (1 − k/i), which never forms the huge binomials."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_at_n(rewards: Sequence[Sequence[float]]) -> float:
    """Mean reward over prompts of the mean over each prompt's samples."""
    return sum(sum(r) / len(r) for r in rewards) / len(rewards)


def truncated_flags(batch, max_new_tokens: int, stop_ids: Sequence[int] | None) -> list[bool]:
    """Per row of a `RolloutBatch`: did the completion use all `max_new_tokens` without ending on a stop id?
    (`stop_ids` None: every full-length completion counts as truncated.)"""
    n = batch.completion_mask.sum(-1).long()
    full = n >= max_new_tokens
    if stop_ids:
        last = batch.completion_ids.gather(1, (n - 1).clamp(min=0)[:, None]).squeeze(1)
        stops = torch.tensor(list(stop_ids), dtype=last.dtype, device=last.device)
        full &= ~(last[:, None] == stops).any(-1)  # elementwise, as rollout.sample: every device backend has it
    return full.tolist()


def _ifeval_metrics(verdicts: Mapping[str, Sequence[Any]], wanted: Sequence[str]) -> dict[str, float]:
    """IFEval's four accuracies from per-completion verdicts of the strict and loose checks, as lm-eval aggregates
    them: prompt-level = share of completions following every instruction; instruction-level = share of all
    (completion, instruction) pairs followed (pooled, not a mean of per-prompt shares)."""
    out = {}
    for m in wanted:
        level, mode = m.split("_")
        followed = [[bool(f) for _, f in v.info["followed"]] for v in verdicts[mode]]
        if level == "prompt":
            out[m] = sum(all(f) for f in followed) / len(followed)
        else:
            out[m] = sum(sum(f) for f in followed) / sum(len(f) for f in followed)
    return out


def benchmark_metrics(spec: EvalSource, rewards: Sequence[Sequence[float]], truncated: Sequence[bool],
                      ifeval: Mapping[str, Sequence[Any]] | None = None) -> dict[str, float]:
    """The metrics of one benchmark: `rewards[p][s]` (prompt p, sample s), the truncation flags of all
    completions, and for IFEval metrics the strict/loose verdicts. Keys: `spec.metric_keys()` + truncation_rate.
    pass@k counts a sample correct when its reward is 1 (fraction-scored partial credit is not a pass)."""
    out: dict[str, float] = {}
    for m in spec.metric_keys():
        kind, _, num = m.partition("@")
        if kind == "mean":
            out[m] = mean_at_n(rewards)
        elif kind == "pass":
            k = int(num)
            out[m] = sum(pass_at_k(len(r), sum(x >= 1.0 for x in r), k) for r in rewards) / len(rewards)
        elif m in IFEVAL_METRICS:
            out.update(_ifeval_metrics(ifeval or {}, [m]))
    out["truncation_rate"] = sum(truncated) / len(truncated) if truncated else 0.0
    return out


# ---------------------------------------------------------------- benchmarks


@dataclass
class Benchmark:
    """A loaded, validated benchmark: its spec, verifier and prompts."""

    domain: str
    spec: EvalSource
    verifier: Any
    examples: list[Example]
    ifeval: dict[str, Any] = field(default_factory=dict)  # mode → the IFEval verifier of the IFEval metrics


def eval_sources_of(recipe) -> dict[str, list[EvalSource]]:
    """{domain: its eval_sources} of a `RecipeConfig`, for the domains that have any."""
    return {d.name: list(d.eval_sources) for d in recipe.data.domains if d.eval_sources}


def load_benchmarks(domain: str, sources: Sequence[EvalSource], eval_size: int | None = None) -> list[Benchmark]:
    """Read and validate every benchmark of `domain` (the rows whose teacher_id is the domain; a file without
    teacher_ids belongs to it whole) — before any compute. A bad file, verifier or row is one DomainError line
    naming `data.domains[<domain>].eval_sources[<name>]`. `eval_size`: at most that many prompts each."""
    from .domains.dataset import load_examples_cached
    from .domains.schemas import COLUMN_MAP_PARAMS
    from .domains.verifiers import get_verifier

    out = []
    for spec in sources:
        where = f"data.domains[{domain}].eval_sources[{spec.name}]"
        try:
            unknown = sorted(set(spec.params) - {"split", *COLUMN_MAP_PARAMS})
            if unknown:
                raise DomainError(f"unknown params {unknown}; accepted: {', '.join(['split', *COLUMN_MAP_PARAMS])}")
            ver = get_verifier(spec.verifier, **spec.verifier_args)
            ver.check_ready()
            rows = load_examples_cached(spec.source, split=spec.params.get("split"), column_map=spec.params,
                                        default_teacher_id=domain)
            exs = [e for e in rows if e.teacher_id == domain]
            if not exs:
                raise DomainError(f"no rows with teacher_id '{domain}' in {spec.source}; fix teacher_id or leave "
                                  "the column out")
            if eval_size:
                exs = exs[:eval_size]
            for i, e in enumerate(exs):
                try:
                    ver.validate(e)
                except DomainError as err:
                    raise DomainError(f"{spec.source} row {i}: {err}") from None
            modes = {m.split("_")[1] for m in spec.metric_keys() if m in IFEVAL_METRICS}
            common = {k: v for k, v in spec.verifier_args.items() if k not in ("mode", "score")}
            # the per-instruction verdicts do not depend on `score`: the benchmark's own verifier serves its mode
            ife = {m: ver if spec.verifier == "ifeval" and ver.mode == m  # an ifeval benchmark's verifier: IFEval
                   else get_verifier("ifeval", mode=m, score="all", **common) for m in sorted(modes)}
        except DomainError as e:
            raise DomainError(f"{where}: {e}") from None
        out.append(Benchmark(domain, spec, ver, exs, ife))
    return out


def _seed_of(seed: int, domain: str, bench: str) -> int:
    # one stream per benchmark, independent of the other domains' and benchmarks' draws
    return zlib.crc32(f"mopd-eval:{seed}:{domain}:{bench}".encode())


def _prompt_json(e: Example) -> Any:
    return e.prompt if isinstance(e.prompt, str) else thaw(e.prompt)


def _gen_kwargs(spec: EvalSource) -> dict:
    kw: dict[str, Any] = {"greedy": spec.temperature == 0, "temperature": spec.temperature or 1.0,
                          "top_p": spec.top_p}
    # only when set: an engine written before top_k/min_p existed still serves benchmarks without them
    if spec.top_k:
        kw["top_k"] = spec.top_k
    if spec.min_p:
        kw["min_p"] = spec.min_p
    return kw


def _run_benchmark(engine, b: Benchmark, max_new_tokens: int, batch_size: int, seed: int, device,
                   stops) -> tuple[dict[str, float], list[dict]]:
    spec = b.spec
    budget = spec.max_new_tokens or max_new_tokens
    rep = [e for e in b.examples for _ in range(spec.n)]
    gen = torch.Generator(device=device).manual_seed(_seed_of(seed, b.domain, spec.name))
    batch = engine.generate(rep, max_new_tokens=budget, generator=gen, batch_size=batch_size, **_gen_kwargs(spec))
    trunc = truncated_flags(batch, budget, stops)
    verdicts = b.verifier.score_batch(rep, batch.texts, trunc)
    ife = {m: verdicts if v is b.verifier else v.score_batch(rep, batch.texts, trunc) for m, v in b.ifeval.items()}
    rewards = [[verdicts[p * spec.n + s].reward for s in range(spec.n)] for p in range(len(b.examples))]
    metrics = benchmark_metrics(spec, rewards, trunc, ife)
    rows = [{"domain": b.domain, "benchmark": spec.name, "row": i // spec.n, "sample": i % spec.n,
             "prompt": _prompt_json(e), "completion": t, "extracted": v.extracted, "reward": v.reward,
             "truncated": tr, "info": thaw(v.info)}
            for i, (e, t, v, tr) in enumerate(zip(rep, batch.texts, verdicts, trunc))]
    return metrics, rows


def _heldout_rows(domain: str, bench: str, exs, batch, rewards, trunc, k: int = 1) -> list[dict]:
    return [{"domain": domain, "benchmark": bench, "row": i // k, "sample": i % k, "prompt": _prompt_json(e),
             "completion": t, "extracted": None, "reward": float(r), "truncated": tr, "info": {}}
            for i, (e, t, r, tr) in enumerate(zip(exs, batch.texts, rewards, trunc))]


@torch.no_grad()
def evaluate(model, tokenizer, domains: Mapping[str, object], cfg: EvalConfig, device, max_new_tokens: int,
             seed: int = 0, eval_size: int | None = None, *, chat=None,
             sources: Mapping[str, Sequence[EvalSource]] | None = None, engine=None,
             benchmarks: Mapping[str, Sequence[Benchmark]] | None = None) -> EvalResult:
    """Scores and per-row results of every domain (see the module docstring). `sources`: {domain: eval_sources}
    (`eval_sources_of(recipe)`); a domain absent from it is evaluated on its held-out split. `engine`: the rollout
    engine to generate with (`HFRollout`, `VllmRollout`); None = an `HFRollout` over `model` with `chat` (the
    recipe's `data.chat` or a `PromptFormatter`). `eval_size` (else `cfg.eval_size`) caps the prompts of each
    held-out split and each benchmark. Every benchmark is loaded and validated before anything is generated;
    `benchmarks` ({domain: `load_benchmarks(...)`}) are ones already loaded (the eval stage loads them once for
    all its models) and replace `sources`."""
    n = eval_size or cfg.eval_size
    if benchmarks is None:
        benchmarks = {name: load_benchmarks(name, (sources or {}).get(name) or (), n) for name in domains}
    benches = {name: list(benchmarks.get(name) or ()) for name in domains}
    engine = engine if engine is not None else HFRollout(model, tokenizer, device, chat=chat)
    stops = engine.stop_ids()
    out: dict[str, dict[str, float]] = {}
    rows: list[dict] = []
    gen = torch.Generator(device=device).manual_seed(seed + 7919)
    for name, dom in domains.items():
        if benches[name]:
            res: dict[str, float] = {}
            heads = []
            for b in benches[name]:
                met, r = _run_benchmark(engine, b, max_new_tokens, cfg.batch_size, seed, device, stops)
                heads.append(met[b.spec.headline()])
                res[b.spec.name] = heads[-1]
                res.update({f"{b.spec.name}/{k}": v for k, v in met.items()})
                rows.extend(r)
            out[name] = {"score": sum(heads) / len(heads), **res}
            continue
        # the held-out path: the code (and so the numbers and generator draws) of before eval_sources existed
        exs = dom.eval_examples()[:n] if n else dom.eval_examples()
        res = {}
        if cfg.greedy:
            b = engine.generate(exs, max_new_tokens=max_new_tokens, greedy=True, batch_size=cfg.batch_size)
            tr = truncated_flags(b, max_new_tokens, stops)
            rw = domain_rewards(dom, exs, b.texts, tr)
            res["greedy"] = sum(rw) / len(exs)
            rows.extend(_heldout_rows(name, "heldout:greedy", exs, b, rw, tr))
        if cfg.mean_at_k:
            k = cfg.mean_at_k
            rep = [e for e in exs for _ in range(k)]
            b = engine.generate(rep, max_new_tokens=max_new_tokens, temperature=cfg.temperature, generator=gen,
                                batch_size=cfg.batch_size)
            tr = truncated_flags(b, max_new_tokens, stops)
            rw = domain_rewards(dom, rep, b.texts, tr)
            res[f"mean@{k}"] = sum(rw) / len(rep)
            rows.extend(_heldout_rows(name, f"heldout:mean@{k}", rep, b, rw, tr, k))
        out[name] = res
    return EvalResult(out, rows)


def evaluate_model(model, tokenizer, domains: Mapping[str, object], cfg: EvalConfig, device,
                   max_new_tokens: int, seed: int = 0, eval_size: int | None = None, *,
                   chat=None, sources: Mapping[str, Sequence[EvalSource]] | None = None,
                   engine=None) -> dict[str, dict[str, float]]:
    """{domain: {"greedy": acc, "mean@k": acc}} on each domain's held-out prompts (never trained on), or the
    benchmark metrics of the domains in `sources`: `evaluate(...).scores`. `chat`: the recipe's `data.chat` (or a
    `models.chat.PromptFormatter`) — prompts rendered and generation stopped exactly as in training rollouts;
    None = raw prompt strings."""
    return evaluate(model, tokenizer, domains, cfg, device, max_new_tokens, seed, eval_size, chat=chat,
                    sources=sources, engine=engine).scores


def write_rows_jsonl(rows: Sequence[Mapping[str, Any]], path, **extra: Any) -> Path:
    """Write per-row results as JSONL (one object per completion, `extra` — e.g. model="student" — put in front of
    each); returns the path. Non-JSON values (e.g. a verifier's odd info) are written as strings."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({**extra, **r}, ensure_ascii=False, default=str) + "\n")
    return path


# ---------------------------------------------------------------- tables, totals, recovery


def domain_value(r: Mapping[str, float] | None, metric: str = "greedy") -> float | None:
    """A domain's headline: `metric` where it has it (held-out path), else its benchmarks' `score`."""
    if not r:
        return None
    return r[metric] if metric in r else r.get("score")


def total_score(r: Mapping[str, Mapping[str, float]], metric: str = "greedy",
                domains: Sequence[str] | None = None) -> float | None:
    """Mean of the domains' headlines (`domain_value`) of one model; None when none has one."""
    vals = [domain_value(r.get(d), metric) for d in (domains or sorted(r))]
    vals = [v for v in vals if v is not None]
    return sum(vals) / len(vals) if vals else None


def recovery(results: Mapping[str, Mapping[str, Mapping[str, float]]], row: str, low: str,
             high: str | Mapping[str, str], metric: str = "greedy",
             domains: Sequence[str] | None = None) -> dict[str, float]:
    """(row − low) / (high − low) per domain and for the total, e.g. row="student", low="sft",
    high={"math": "expert-math", ...} (one reference row per domain) or one row name. NaN where high == low."""
    for label in [row, low, *([high] if isinstance(high, str) else high.values())]:
        if label not in results:
            raise KeyError(f"recovery: no results row '{label}'; have {sorted(results)}")
    domains = list(domains or sorted({d for r in results.values() for d in r}))

    def ratio(x, lo, hi):
        if x is None or lo is None or hi is None or hi == lo:
            return math.nan
        return (x - lo) / (hi - lo)

    def hi_row(d):
        return results[high if isinstance(high, str) else high[d]]

    out = {d: ratio(domain_value(results[row].get(d), metric), domain_value(results[low].get(d), metric),
                    domain_value(hi_row(d).get(d), metric)) for d in domains}
    hi_total = [domain_value(hi_row(d).get(d), metric) for d in domains]
    hi_total = [v for v in hi_total if v is not None]
    out["total"] = ratio(total_score(results[row], metric, domains), total_score(results[low], metric, domains),
                         sum(hi_total) / len(hi_total) if hi_total else None)
    return out


def _benchmark_columns(results, domains, benchmarks) -> list[tuple[str, str]]:
    """(domain, key) columns: True = every benchmark's headline; a list = 'domain/bench' or 'domain/bench/metric'."""
    if benchmarks is True:
        cols = []
        for d in domains:
            names = {k.split("/")[0] for r in results.values() for k in (r.get(d) or {}) if "/" in k}
            cols += [(d, b) for b in sorted(names)]
        return cols
    cols = []
    for c in benchmarks or []:
        d, _, key = c.partition("/")
        if not key:
            raise ValueError(f"accuracy_table: benchmark column {c!r} must be 'domain/bench' or "
                             "'domain/bench/metric'")
        cols.append((d, key))
    return cols


def accuracy_table(results: Mapping[str, Mapping[str, Mapping[str, float]]], metric: str = "greedy",
                   domains: list[str] | None = None, *, benchmarks: bool | Sequence[str] = False,
                   total: bool = False) -> str:
    """Markdown table: one row per model, one column per domain (its headline, `domain_value`, in %). On demand:
    `benchmarks` — True adds every benchmark's headline column (`math/aime24`), a list adds the given
    `domain/bench[/metric]` columns; `total` adds the mean of the domain columns."""
    domains = domains or sorted({d for r in results.values() for d in r})
    extra = _benchmark_columns(results, domains, benchmarks)
    heads = list(domains) + [f"{d}/{k}" for d, k in extra] + (["total"] if total else [])
    lines = ["| model | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]

    def cell(v):
        return "–" if v is None else f"{100 * v:.1f}"

    for model, r in results.items():
        cells = [cell(domain_value(r.get(d), metric)) for d in domains]
        cells += [cell((r.get(d) or {}).get(k)) for d, k in extra]
        if total:
            cells.append(cell(total_score(r, metric, domains)))
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_accuracy(results: Mapping[str, Mapping[str, Mapping[str, float]]], path, metric: str = "greedy"):
    """Grouped bar chart, one group per domain, one bar per model; saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = sorted({d for r in results.values() for d in r})
    models = list(results)
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(domains), 3.6))
    width = 0.8 / max(1, len(models))
    for i, m in enumerate(models):
        vals = [100 * (domain_value(results[m].get(d), metric) or 0.0) for d in domains]
        ax.bar([j + i * width for j in range(len(domains))], vals, width, label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(domains))], domains)
    ax.set_ylabel(f"{metric} accuracy (%)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- the eval stage's report


@dataclass
class EvalReport:
    """What the eval stage produced: `accuracy` ({model: {domain: {metric: value}}}), the Markdown `table`
    (per-benchmark columns and a total when a domain has benchmarks), `benchmarks` (one record per model ×
    benchmark, for a Prefect table), `rows` (per-completion results, each with its `model`) and, once `write`
    ran, the `files` written ({name: path})."""

    accuracy: dict[str, dict[str, dict[str, float]]]
    table: str
    benchmarks: list[dict[str, Any]] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    files: dict[str, Path] = field(default_factory=dict)
    metric: str = "greedy"

    def write(self, out_dir: str | Path, extra: Mapping[str, Any] | None = None) -> dict[str, Path]:
        """accuracy.md (the table), accuracy.json (scores, benchmark records and `extra`, e.g. wall seconds or
        model refs), accuracy.png (per-domain headlines) and eval_rows.jsonl (every completion) in `out_dir`."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "accuracy.md").write_text(self.table + "\n")
        (out / "accuracy.json").write_text(json.dumps({"accuracy": self.accuracy, "benchmarks": self.benchmarks,
                                                       **(extra or {})}, indent=2))
        plot_accuracy(self.accuracy, out / "accuracy.png", self.metric)
        write_rows_jsonl(self.rows, out / ROWS_FILE)
        self.files = {f: out / f for f in ("accuracy.md", "accuracy.json", "accuracy.png", ROWS_FILE)}
        return self.files


ROWS_FILE = "eval_rows.jsonl"


def benchmark_records(results: Mapping[str, Mapping[str, Mapping[str, float]]],
                      sources: Mapping[str, Sequence[EvalSource]]) -> list[dict[str, Any]]:
    """One record per model × benchmark: model, domain, benchmark, n, temperature, headline metric, then every
    reported metric (values in %, 2 decimals; truncation_rate too)."""
    out = []
    for model, r in results.items():
        for d, specs in sources.items():
            for s in specs:
                met = {k.split("/", 1)[1]: v for k, v in (r.get(d) or {}).items() if k.startswith(f"{s.name}/")}
                if not met:
                    continue
                out.append({"model": model, "domain": d, "benchmark": s.name, "n": s.n,
                            "temperature": s.temperature, "headline": s.headline(),
                            **{k: round(100 * v, 2) for k, v in met.items()}})
    return out


def eval_report(results: Mapping[str, Mapping[str, Mapping[str, float]]], rows: Sequence[Mapping[str, Any]],
                domains: Sequence[str], sources: Mapping[str, Sequence[EvalSource]] | None = None,
                metric: str = "greedy") -> EvalReport:
    """The report of an evaluation. The table keeps its `| model | <domain>… |` shape; with benchmarks it adds
    each benchmark's headline column and the total (mean of the domains)."""
    sources = dict(sources or {})
    table = accuracy_table(results, metric, list(domains), benchmarks=bool(sources), total=bool(sources))
    return EvalReport({k: {d: dict(m) for d, m in v.items()} for k, v in results.items()}, table,
                      benchmark_records(results, sources), list(rows), metric=metric)
