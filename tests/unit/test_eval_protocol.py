"""Evaluation as the papers report it (`mopd_core.evaluation`): unbiased pass@k, mean@n, truncation rate, IFEval's
four accuracies, per-benchmark `eval_sources` over real-mini with the real verifiers, per-row results; the held-out
path stays bit for bit; top_k / min_p sampling and its behaviour log-probs; config errors and fingerprints."""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mopd_core import evaluation as EV
from mopd_core import recipe as R
from mopd_core.config import ChatConfig, EvalConfig, EvalSource, ModelConfig, load_config
from mopd_core.domains import build_domain
from mopd_core.errors import ConfigError
from mopd_core.models import build_tiny, forward, load_model, load_tokenizer
from mopd_core.rollout import HFRollout, RolloutBatch, encode_prompts, position_ids, sample, sampling_mask
from mopd_core.rollout import engines as E
from tests.unit.test_chat_format import DEFAULT_FPS, INPUTS  # the default tiny stage fingerprints: one record

REAL_MINI = Path(__file__).resolve().parents[2] / "data" / "real_mini"
SMALL = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny(ModelConfig(tiny=SMALL), tmp_path_factory.mktemp("m") / "tiny", seed=0)
    return load_model(path).eval(), load_tokenizer(path)


@pytest.fixture(scope="module")
def chat_tiny(tmp_path_factory):
    path = build_tiny(ModelConfig(tiny={**SMALL, "chat": True, "max_position_embeddings": 1024}),
                      tmp_path_factory.mktemp("m") / "chat", seed=0)
    return load_model(path).eval(), load_tokenizer(path)


# ---------------------------------------------------------------- metrics


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
    subsets = list(itertools.combinations(range(n), k))  # samples 0..c-1 are the correct ones
    return float(Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets)))


def test_pass_at_k_equals_the_fraction_of_k_subsets_with_a_correct_sample():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert abs(EV.pass_at_k(n, c, k) - _brute_pass_at_k(n, c, k)) < 1e-12, (n, c, k)
    # large n: the product form stays exact where the binomials are astronomically large
    exact = 1 - Fraction(math.comb(997, 100), math.comb(1000, 100))
    assert abs(EV.pass_at_k(1000, 3, 100) - float(exact)) < 1e-12
    with pytest.raises(ValueError, match="k <= n"):
        EV.pass_at_k(4, 1, 5)


def test_benchmark_metrics_mean_pass_and_truncation_rate():
    spec = EvalSource(name="b", source="x", n=4, temperature=1.0, metrics=["mean@n", "pass@2", "pass@4"])
    rewards = [[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0.5, 1]]  # 0.5: partial credit is no pass
    m = EV.benchmark_metrics(spec, rewards, [True, False, False, False] * 3)
    assert m["mean@4"] == pytest.approx((0.25 + 0 + 0.875) / 3)
    assert m["pass@2"] == pytest.approx((_brute_pass_at_k(4, 1, 2) + 0 + _brute_pass_at_k(4, 3, 2)) / 3)
    assert m["pass@4"] == pytest.approx(2 / 3)
    assert m["truncation_rate"] == pytest.approx(3 / 12)
    assert list(m) == ["mean@4", "pass@2", "pass@4", "truncation_rate"] and spec.headline() == "mean@4"


def test_truncated_flags_need_a_full_budget_without_a_stop_id():
    ids = torch.tensor([[5, 6, 9], [5, 6, 7], [5, 9, 0], [5, 6, 1]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
    b = RolloutBatch(ids[:, :1], torch.ones(4, 1), ids, mask, torch.zeros(4, 3))
    assert EV.truncated_flags(b, 3, [9, 1]) == [False, True, False, False]
    assert EV.truncated_flags(b, 3, None) == [True, True, False, True]


def test_ifeval_accuracies_pool_instructions_as_lm_eval_does():
    v = lambda *f: SimpleNamespace(info={"followed": [[f"i{j}", x] for j, x in enumerate(f)]})  # noqa: E731
    ver = {"strict": [v(True, False, False), v(True)], "loose": [v(True, True, False), v(True)]}
    spec = EvalSource(name="ife", source="x", verifier="ifeval",
                      metrics=["prompt_strict", "inst_strict", "prompt_loose", "inst_loose"])
    m = EV.benchmark_metrics(spec, [[0.0], [1.0]], [False, False], ver)
    assert (m["prompt_strict"], m["inst_strict"], m["prompt_loose"], m["inst_loose"]) == (0.5, 0.5, 0.5, 0.75)


# ---------------------------------------------------------------- the held-out path stays bit for bit


@torch.no_grad()
def _evaluate_before(model, tokenizer, domains, cfg, device, max_new_tokens, seed=0, eval_size=None, *, chat=None):
    """`evaluation.evaluate_model` as it was before eval_sources (commit be69873), verbatim."""
    engine = HFRollout(model, tokenizer, device, chat=chat)
    n = eval_size or cfg.eval_size
    out = {}
    gen = torch.Generator(device=device).manual_seed(seed + 7919)
    for name, dom in domains.items():
        exs = dom.eval_examples()[:n] if n else dom.eval_examples()
        res = {}
        if cfg.greedy:
            b = engine.generate(exs, max_new_tokens=max_new_tokens, greedy=True, batch_size=cfg.batch_size)
            res["greedy"] = sum(dom.rewards(exs, b.texts)) / len(exs)
        if cfg.mean_at_k:
            k = cfg.mean_at_k
            rep = [e for e in exs for _ in range(k)]
            b = engine.generate(rep, max_new_tokens=max_new_tokens, temperature=cfg.temperature, generator=gen,
                                batch_size=cfg.batch_size)
            res[f"mean@{k}"] = sum(dom.rewards(rep, b.texts)) / len(rep)
        out[name] = res
    return out


def test_heldout_path_gives_the_numbers_of_before(tiny):
    model, tok = tiny
    domains = {d: build_domain(d, f"synthetic:{d}", eval_size=12, seed=0) for d in ("math", "code", "if")}
    cfg = EvalConfig(mean_at_k=3, temperature=1.0, batch_size=8)
    before = _evaluate_before(model, tok, domains, cfg, "cpu", 6, seed=1)
    res = EV.evaluate(model, tok, domains, cfg, "cpu", 6, seed=1)
    assert res.scores == before and EV.evaluate_model(model, tok, domains, cfg, "cpu", 6, seed=1) == before
    assert all(set(r) == set(EV.ROW_KEYS) for r in res.rows)
    assert len(res.rows) == 3 * (12 + 36)
    g = [r for r in res.rows if r["domain"] == "math" and r["benchmark"] == "heldout:greedy"]
    assert sum(r["reward"] for r in g) / len(g) == before["math"]["greedy"]
    # an unchanged table for results without benchmarks
    table = EV.accuracy_table({"m": before}, "greedy", ["math", "code", "if"])
    assert table.splitlines()[0] == "| model | math | code | if |"


# ---------------------------------------------------------------- eval_sources over real-mini


def test_eval_sources_over_real_mini_with_the_real_verifiers(chat_tiny, tmp_path, monkeypatch):
    model, tok = chat_tiny
    srcs = {
        "math": [EvalSource(name="mini-math", source=str(REAL_MINI / "math.jsonl"), verifier="math_verify",
                            n=3, temperature=0.8, top_p=0.95, top_k=20, min_p=0.05, max_new_tokens=6,
                            metrics=["mean@n", "pass@2"]),
                 EvalSource(name="mini-math-greedy", source=str(REAL_MINI / "math.jsonl"), verifier="math_verify",
                            max_new_tokens=4)],
        "code": [EvalSource(name="mini-lcb", source=str(REAL_MINI / "code_lcb.jsonl"), verifier="code_tests",
                            max_new_tokens=5, metrics=["mean@1", "truncation_rate"])],
        # the first two IFEval rows need no NLTK data (rows 1003/1011 do)
        "if": [EvalSource(name="mini-ifeval", source=str(REAL_MINI / "ifeval.jsonl"), verifier="ifeval",
                          n=2, temperature=1.0, max_new_tokens=5,
                          metrics=["prompt_strict", "inst_strict", "prompt_loose", "inst_loose", "mean@2"])],
    }
    domains = {d: object() for d in srcs}  # benchmark domains never read the domain object
    cfg = EvalConfig(batch_size=4)
    res = EV.evaluate(model, tok, domains, cfg, "cpu", 8, seed=0, eval_size=2, chat=ChatConfig(enabled=True),
                      sources=srcs)
    s = res.scores
    assert set(s["math"]) == {"score", "mini-math", "mini-math/mean@3", "mini-math/pass@2",
                              "mini-math/truncation_rate", "mini-math-greedy", "mini-math-greedy/mean@1",
                              "mini-math-greedy/truncation_rate"}
    assert s["math"]["score"] == pytest.approx((s["math"]["mini-math"] + s["math"]["mini-math-greedy"]) / 2)
    assert s["if"]["mini-ifeval"] == s["if"]["mini-ifeval/prompt_strict"]
    assert all(0.0 <= v <= 1.0 for d in s.values() for v in d.values())
    assert s["math"]["mini-math/pass@2"] >= s["math"]["mini-math/mean@3"] - 1e-12
    assert len(res.rows) == 2 * 3 + 2 + 2 + 2 * 2
    for r in res.rows:
        assert set(r) == set(EV.ROW_KEYS)
        assert isinstance(r["completion"], str) and isinstance(r["truncated"], bool)
        assert 0.0 <= r["reward"] <= 1.0
    # tiny budgets and an untrained model: nothing stops on time, and truncation is reported as it happened
    lcb = [r for r in res.rows if r["benchmark"] == "mini-lcb"]
    assert s["code"]["mini-lcb/truncation_rate"] == sum(r["truncated"] for r in lcb) / len(lcb)
    assert all(r["info"]["total"] >= 1 and "passed" in r["info"] for r in lcb)  # the sandboxed tests ran
    ife = [r for r in res.rows if r["benchmark"] == "mini-ifeval"]
    assert all(r["info"]["mode"] == "strict" and r["info"]["followed"] for r in ife)
    assert [r["prompt"][-1]["role"] for r in res.rows if r["domain"] == "math"] == ["user"] * 8
    # benchmarks loaded once serve every later evaluation (the eval stage's models) with the same numbers; the
    # IFEval benchmark's own strict verifier gives its strict metrics, the loose ones get a verifier of their own
    loaded = {d: EV.load_benchmarks(d, specs, 2) for d, specs in srcs.items()}
    (ifb,) = loaded["if"]
    assert ifb.ifeval["strict"] is ifb.verifier and ifb.ifeval["loose"] is not ifb.verifier
    with monkeypatch.context() as mp:
        mp.setattr(EV, "load_benchmarks", lambda *a, **k: pytest.fail("benchmarks loaded again"))
        again = EV.evaluate(model, tok, domains, cfg, "cpu", 8, seed=0, eval_size=2, chat=ChatConfig(enabled=True),
                            benchmarks=loaded)
    assert again.scores == s and [r["completion"] for r in again.rows] == [r["completion"] for r in res.rows]
    # JSONL artifact
    p = EV.write_rows_jsonl(res.rows, tmp_path / "rows.jsonl", model="student")
    back = [json.loads(x) for x in p.read_text().splitlines()]
    assert len(back) == len(res.rows) and back[0]["model"] == "student" and back[0]["benchmark"] == "mini-math"
    # per-benchmark columns on demand, a total column
    table = EV.accuracy_table({"student": s}, domains=["math", "code", "if"], benchmarks=True, total=True)
    head = table.splitlines()[0]
    assert head.startswith("| model | math | code | if | math/mini-math | math/mini-math-greedy | code/mini-lcb")
    assert head.endswith("| total |")


class _Spy:
    """A rollout engine that records what evaluation asks of it (and samples with an HFRollout)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def stop_ids(self):
        return self.inner.stop_ids()

    def generate(self, examples, **kw):
        self.calls.append((len(examples), {k: v for k, v in kw.items() if k != "generator"}))
        return self.inner.generate(examples, **kw)


def test_benchmarks_generate_through_the_given_engine_with_their_own_settings(tiny, tmp_path):
    model, tok = tiny
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(5)))
    srcs = {"math": [EvalSource(name="s", source=str(data), n=4, temperature=0.6, top_p=0.95, top_k=20, min_p=0.05,
                                max_new_tokens=3, metrics=["pass@4", "mean@n"]),
                     EvalSource(name="g", source=str(data))]}
    spy = _Spy(HFRollout(model, tok, "cpu"))
    res = EV.evaluate(None, tok, {"math": None}, EvalConfig(batch_size=7), "cpu", 5, seed=3, sources=srcs,
                      engine=spy)
    assert spy.calls == [(20, dict(max_new_tokens=3, batch_size=7, greedy=False, temperature=0.6, top_p=0.95,
                                   top_k=20, min_p=0.05)),
                         (5, dict(max_new_tokens=5, batch_size=7, greedy=True, temperature=1.0, top_p=1.0))]
    assert res.scores["math"]["s"] == res.scores["math"]["s/pass@4"]  # the first metric is the headline
    # batch size changes nothing of the greedy benchmark; no engine given = an HFRollout over the model
    again = EV.evaluate(model, tok, {"math": None}, EvalConfig(batch_size=2), "cpu", 5, seed=3, sources=srcs)
    assert [r["completion"] for r in again.rows if r["benchmark"] == "g"] == \
        [r["completion"] for r in res.rows if r["benchmark"] == "g"]


def test_bad_benchmarks_fail_before_compute_naming_the_benchmark(tmp_path):
    bad = tmp_path / "b.jsonl"
    bad.write_text(json.dumps({"prompt": "2+2=", "teacher_id": "math"}) + "\n")
    with pytest.raises(Exception, match=r"data.domains\[math\].eval_sources\[b\]: .*row 0.*answer") as e:
        EV.load_benchmarks("math", [EvalSource(name="b", source=str(bad), verifier="math_verify")])
    assert "\n" not in str(e.value)
    with pytest.raises(Exception, match=r"eval_sources\[c\]: .*not found"):
        EV.load_benchmarks("math", [EvalSource(name="c", source=str(tmp_path / "nope.jsonl"))])
    with pytest.raises(Exception, match=r"eval_sources\[d\]: unknown params \['colum'\]"):
        EV.load_benchmarks("math", [EvalSource(name="d", source=str(bad), params={"colum": 1})])


# ---------------------------------------------------------------- recovery and totals


def test_total_and_recovery():
    res = {"sft": {"math": {"greedy": 0.2}, "code": {"score": 0.1}},
           "expert-math": {"math": {"greedy": 0.6}, "code": {"score": 0.1}},
           "expert-code": {"math": {"greedy": 0.2}, "code": {"score": 0.5}},
           "student": {"math": {"greedy": 0.5}, "code": {"score": 0.2}}}
    assert EV.total_score(res["student"]) == pytest.approx(0.35)
    rec = EV.recovery(res, "student", "sft", {"math": "expert-math", "code": "expert-code"})
    assert rec["math"] == pytest.approx(0.75) and rec["code"] == pytest.approx(0.25)
    assert rec["total"] == pytest.approx((0.35 - 0.15) / (0.55 - 0.15))
    assert math.isnan(EV.recovery(res, "student", "sft", "sft")["math"])
    with pytest.raises(KeyError, match="no results row 'rl'"):
        EV.recovery(res, "rl", "sft", "sft")


# ---------------------------------------------------------------- top_k / min_p sampling


def _reference_keep(lg: torch.Tensor, top_p: float, top_k: int, min_p: float) -> set[int]:
    """Float64, one row, written out step by step in vLLM's order: min_p, top_k, top_p."""
    p = torch.softmax(lg.double(), -1)
    ids = [i for i in range(lg.numel()) if p[i] >= min_p * p.max()]
    ids = sorted(ids, key=lambda i: -float(lg[i]))
    if top_k:
        kth = float(lg[ids[min(top_k, len(ids)) - 1]])
        ids = [i for i in ids if float(lg[i]) >= kth]
    mass = sum(float(p[i]) for i in ids)
    keep, before = [], 0.0
    for i in ids:
        if before / mass > top_p:
            break
        keep.append(i)
        before += float(p[i])
    return set(keep)


def test_sampling_mask_matches_a_float64_reference():
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        lg = torch.randn(1, 50, generator=g, dtype=torch.float64) * 3
        tp, tk, mp = [(1.0, 5, 0.0), (0.8, 0, 0.0), (1.0, 0, 0.1), (0.9, 10, 0.02), (0.5, 3, 0.3)][trial % 5]
        got = set(sampling_mask(lg, top_p=tp, top_k=tk, min_p=mp)[0].nonzero().flatten().tolist())
        assert got == _reference_keep(lg[0], tp, tk, mp), (trial, tp, tk, mp)
    assert sampling_mask(lg).all()


def test_top_k_min_p_sample_only_allowed_tokens_with_truncated_behaviour_logprobs(tiny):
    model, tok = tiny
    ids, mask = encode_prompts(tok, ["12+34=", "rev:abc=", "up:ab="] * 6, "cpu")
    T, temp, tp, tk, mp = 8, 0.9, 0.9, 6, 0.05
    c_ids, c_mask, c_lp = sample(model, ids, mask, max_new_tokens=T, eos_id=tok.eos_token_id,
                                 pad_id=tok.pad_token_id, temperature=temp, top_p=tp, top_k=tk, min_p=mp,
                                 generator=torch.Generator().manual_seed(5))
    full = torch.cat([ids, c_ids], 1)
    am = torch.cat([mask, c_mask], 1)
    with torch.no_grad():
        logits, _ = forward(model, full, am, position_ids(am))
    P = ids.shape[1]
    checked = truncated_rows = 0
    for b in range(full.shape[0]):
        for t in range(c_ids.shape[1]):
            if not c_mask[b, t]:
                continue
            lg = logits[b, P - 1 + t].double() / temp
            keep = _reference_keep(lg, tp, tk, mp)
            tok_t = int(c_ids[b, t])
            assert tok_t in keep, (b, t)
            p = torch.softmax(lg, -1)
            want = math.log(float(p[tok_t]) / sum(float(p[i]) for i in keep))
            assert abs(float(c_lp[b, t]) - want) < 1e-4, (b, t)
            truncated_rows += len(keep) < lg.numel()
            checked += 1
    assert checked > 50 and truncated_rows == checked  # top_k=6 truncates every step
    # the engine passes them through, and a tight top_k=1 is greedy
    eng = HFRollout(model, tok, "cpu")
    one = eng.generate(["12+34="] * 8, max_new_tokens=3, top_k=1, generator=torch.Generator().manual_seed(1))
    greedy = eng.generate(["12+34="], max_new_tokens=3, greedy=True)
    assert (one.completion_ids == greedy.completion_ids[0]).all()
    assert torch.allclose(one.behaviour_logp[one.completion_mask.bool()], torch.tensor(0.0), atol=1e-6)


def test_vllm_sampling_params_carry_top_k_and_min_p_only_when_set():
    base = dict(max_new_tokens=4, temperature=0.6, top_p=0.95, greedy=False, seed=1, stop_ids=[1])
    assert "top_k" not in E.sampling_kwargs(**base) and "min_p" not in E.sampling_kwargs(**base)
    kw = E.sampling_kwargs(**base, top_k=20, min_p=0.05)
    assert (kw["top_k"], kw["min_p"], kw["top_p"], kw["temperature"]) == (20, 0.05, 0.95, 0.6)
    assert "top_k" not in E.sampling_kwargs(**{**base, "greedy": True}, top_k=20)


# ---------------------------------------------------------------- config


def test_default_tiny_fingerprints_are_unchanged_and_eval_sources_are_part_of_them():
    cfg = load_config("tiny")
    assert {s: R.stage_spec(cfg, s, INPUTS).fingerprint for s in DEFAULT_FPS} == DEFAULT_FPS
    assert all("eval_sources" not in d for d in cfg.data.model_dump()["domains"])
    on = load_config("tiny", ['data.domains.math.eval_sources=[{name: aime, source: a.jsonl, n: 4, temperature: 0.6,'
                              ' top_k: 20, metrics: [mean@n, pass@4]}]'])
    assert on.data.domains[0].eval_sources[0].headline() == "mean@4"
    assert R.stage_spec(on, "evaluate", INPUTS).fingerprint != DEFAULT_FPS["evaluate"]
    assert EV.eval_sources_of(on) == {"math": list(on.data.domains[0].eval_sources)}


@pytest.mark.parametrize("item,needle", [
    ("{name: a, source: x, n: 2, temperature: 1, metrics: [pass@4]}", "pass@4 needs n >= 4"),
    ("{name: a, source: x, n: 4, temperature: 1, metrics: [mean@2]}", "mean@2 but n=4"),
    ("{name: a, source: x, n: 4}", "greedy samples are all the same"),
    ("{name: a, source: x, metrics: [prompt_strict]}", "needs verifier ifeval"),
    ("{name: a, source: x, metrics: [accuracy]}", "unknown metric 'accuracy'"),
    ("{name: a, source: x, top_k: -1}", "top_k"),
    ("{name: a, source: x, tempreature: 1}", "unknown config key"),
])
def test_eval_source_config_errors_are_one_line_naming_the_field(item, needle):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [f"data.domains.math.eval_sources=[{item}]"])
    msg = str(e.value)
    assert "\n" not in msg and needle in msg and "eval_sources" in msg


def test_duplicate_benchmark_names_are_an_error():
    with pytest.raises(ConfigError, match="duplicate names"):
        load_config("tiny", ["data.domains.math.eval_sources=[{name: a, source: x}, {name: a, source: y}]"])
