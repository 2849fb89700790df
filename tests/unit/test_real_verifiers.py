"""The published verifiers on real-mini: every golden completion of data/real_mini/golden.jsonl scores its expected
reward through math-verify, lm-eval's IFEval checks and the code sandbox; a hanging SymPy item scores 0 within its
timeout and the pool keeps working; verifier_args and row fields are checked up front with one-line errors."""

from __future__ import annotations

import importlib.util
import json
import random
import os
import subprocess
import sys
import textwrap
import time
from collections import defaultdict
from pathlib import Path

import pytest

from mopd_core.domains import DomainError, Example, build_domain, get_verifier
from mopd_core.domains.verifiers import VerdictRow, lcb_outputs_match, split_think

REAL = Path(__file__).resolve().parents[2] / "data" / "real_mini"
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the code sandbox is Linux-only")


def _jsonl(name: str) -> list[dict]:
    with open(REAL / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# The schema contract the dataset adapters implement (another module); built here from the raw rows.
def math_example(row: dict) -> Example:
    return Example(row["prompt"][-1]["content"], "math", row["reward_model"]["ground_truth"])


def ifeval_example(row: dict) -> Example:
    return Example(row["prompt"], "if", None, {"instruction_id_list": row["instruction_id_list"],
                                               "kwargs": row["kwargs"]})


def lcb_example(row: dict) -> Example:
    meta = json.loads(row["metadata"])
    return Example(row["question_content"], "code", None,
                   {"tests": json.loads(row["public_test_cases"]), "func_name": meta.get("func_name")})


def leetcode_example(row: dict) -> Example:
    return Example(row["query"], "code", None, {"test": row["test"], "entry_point": row["entry_point"],
                                                "import_prompt": row["prompt"]})


SETS = {"math": ("math.jsonl", math_example, lambda r: r["extra_info"]["index"]),
        "ifeval": ("ifeval.jsonl", ifeval_example, lambda r: r["key"]),
        "code_lcb": ("code_lcb.jsonl", lcb_example, lambda r: r["question_id"]),
        "code_leetcode": ("code_leetcode.jsonl", leetcode_example, lambda r: r["task_id"])}


def examples_of(set_name: str) -> dict:
    file, make, key = SETS[set_name]
    return {key(r): make(r) for r in _jsonl(file)}


def golden(set_names: tuple[str, ...]) -> list[dict]:
    return [g for g in _jsonl("golden.jsonl") if g["set"] in set_names]


def run_golden(entries: list[dict], examples: dict, make_verifier) -> list[str]:
    """Score every golden completion (one batch per verifier_args) and return the mismatches, readable."""
    by_args: dict[str, list[tuple[dict, dict]]] = defaultdict(list)
    for g in entries:
        for c in g["completions"]:
            by_args[json.dumps(g["verifier_args"], sort_keys=True)].append((g, c))
    bad = []
    for args_json, items in by_args.items():
        v = make_verifier(json.loads(args_json))
        exs = [examples[g["row"]] for g, _ in items]
        for e in exs:
            v.validate(e)
        rows = v.score_batch(exs, [c["text"] for _, c in items], [c.get("truncated", False) for _, c in items])
        for (g, c), r in zip(items, rows):
            assert isinstance(r, VerdictRow)
            if abs(r.reward - c["reward"]) > 1e-9:
                bad.append(f"{g['set']} row {g['row']} {args_json} {c['name']}: got {r.reward} want {c['reward']} "
                           f"(extracted {r.extracted!r}, info {dict(r.info)})")
    return bad


def test_the_data_files_are_what_build_writes_and_have_the_promised_shape():
    spec = importlib.util.spec_from_file_location("real_mini_build", REAL / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name, rows in mod.build().items():
        on_disk = (REAL / name).read_text(encoding="utf-8").splitlines()
        assert on_disk == [json.dumps(r, ensure_ascii=False, sort_keys=True) for r in rows], \
            f"{name} is stale: run python data/real_mini/build.py"
    math_rows, lcb, lc, ife = (_jsonl(n) for n in ("math.jsonl", "code_lcb.jsonl", "code_leetcode.jsonl",
                                                   "ifeval.jsonl"))
    assert len(math_rows) >= 30 and len(ife) >= 30 and len(lcb) >= 20 and len(lc) >= 3
    kinds = {json.loads(r["public_test_cases"])[0]["testtype"] for r in lcb}
    assert kinds == {"stdin", "functional"}
    assert all(set(r) >= {"data_source", "prompt", "ability", "reward_model", "extra_info"} for r in math_rows)
    for g in golden(("code_lcb", "code_leetcode")):
        if g["verifier_args"]:
            continue
        names = {c["name"] for c in g["completions"]}
        assert {"correct", "wrong", "looping", "crashing", "escape_network", "escape_file_write",
                "escape_subprocess"} <= names, g["row"]


def test_math_golden_completions_score_their_expected_reward():
    exs = examples_of("math")

    def make(args):
        return get_verifier("math_verify", workers=2, **args)

    bad = run_golden(golden(("math",)), exs, make)
    assert not bad, "\n".join(bad)


def test_math_verify_reports_what_it_extracted():
    v = get_verifier("math_verify", workers=2)
    ex = Example("q", "math", "\\frac{1}{2}")
    r = v.score(ex, "so \\boxed{0.5}")
    assert r.reward == 1.0 and r.extracted == "0.5" and v(ex, "so \\boxed{0.5}") == 1.0
    assert v.score(ex, "no box here") == VerdictRow(0.0, None, {"reason": "no final answer found"})
    g = get_verifier("math_verify", mode="gsm8k", workers=2)
    assert g.score(Example("q", "math", "She has 3 + 4 = 7.\n#### 7"), "3+4=7\n#### 7").reward == 1.0


def test_a_hanging_sympy_item_scores_zero_within_its_timeout_and_the_pool_survives():
    from mopd_core.domains.math_verifier import MathVerify

    v = MathVerify(timeout_s=2.0, workers=2)
    ok = Example("q", "math", "3")
    assert v(ok, "\\boxed{3}") == 1.0  # workers started and warm
    pool = v.pool()
    restarts = pool.restarts
    hang = Example("q", "math", "1")
    t0 = time.monotonic()
    rows = v.score_batch([hang, ok, ok], ["\\boxed{9^{9^{9}}}", "\\boxed{3}", "\\boxed{4}"])
    took = time.monotonic() - t0
    assert rows[0].reward == 0.0 and rows[0].info.get("timeout") is True, rows[0]
    assert [r.reward for r in rows[1:]] == [1.0, 0.0]  # the other worker kept scoring meanwhile
    # the hard timeout ended it (9^(9^9) never finishes on its own); the margin is for a loaded machine, not a
    # speed target: a verifier that waited for the item would never get here
    assert took < 2.0 + 30, took
    assert pool.restarts == restarts + 1
    t0 = time.monotonic()
    assert v(ok, "\\boxed{3}") == 1.0  # a fresh worker replaced the killed one
    assert time.monotonic() - t0 < 60


@pytest.fixture()
def punkt_tab(tmp_path, monkeypatch):
    """An untrained Punkt model (no learned abbreviations) where NLTK looks first: the real data cannot be
    downloaded here, and golden sentences have no abbreviations, so the split is the one trained data gives."""
    import nltk

    lang = tmp_path / "nltk_data" / "tokenizers" / "punkt_tab" / "english"
    lang.mkdir(parents=True)
    for name in ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab"):
        (lang / name).write_text("", encoding="utf-8")
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "nltk_data"), *nltk.data.path])
    return tmp_path / "nltk_data"


def test_ifeval_golden_completions_score_their_expected_reward(punkt_tab):
    exs = examples_of("ifeval")
    bad = run_golden(golden(("ifeval",)), exs, lambda args: get_verifier("ifeval", **args))
    assert not bad, "\n".join(bad)


def test_ifeval_reads_chat_prompts_and_reports_each_instruction(punkt_tab):
    row = next(r for r in _jsonl("ifeval.jsonl") if r["key"] == 1026)
    chat = ({"role": "system", "content": "be brief"}, {"role": "user", "content": row["prompt"]})
    ex = Example(chat, "if", None, {"instruction_id_list": row["instruction_id_list"], "kwargs": row["kwargs"]})
    v = get_verifier("ifeval", score="fraction")
    v.validate(ex)
    r = v.score(ex, "<<Night Sky>>\nThe moon is bright tonight.")
    assert r.reward == pytest.approx(2 / 3)
    assert r.info["followed"] == [["detectable_format:title", True], ["keywords:existence", True],
                                  ["startend:end_checker", False]]


def test_ifeval_without_punkt_names_the_instructions_and_the_fix_while_other_rows_score(tmp_path, monkeypatch):
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    monkeypatch.delenv("NLTK_DATA", raising=False)
    exs = examples_of("ifeval")
    v = get_verifier("ifeval")
    with pytest.raises(DomainError) as e:
        v.validate(exs[1003])
    msg = str(e.value)
    assert "\n" not in msg and "length_constraints:number_sentences" in msg and "punkt_tab" in msg
    assert "nltk.downloader" in msg and "NLTK_DATA" in msg
    with pytest.raises(DomainError, match="change_case:capital_word_frequency"):
        v(exs[1011], "The storm was VERY loud and the rain was HEAVY.")
    v.validate(exs[1001])
    assert v(exs[1001], "No commas in this sentence.") == 1.0


def test_importing_lm_evals_ifeval_never_downloads(tmp_path):
    """In a fresh interpreter with no NLTK data, lm-eval's import-time `nltk.download` is never reached and no
    socket is opened."""
    script = textwrap.dedent(f"""
        import socket, nltk, nltk.downloader
        def refuse(*a, **k):
            raise SystemExit("network or download attempted: " + repr(a)[:80])
        socket.socket.connect = refuse
        socket.create_connection = refuse
        nltk.downloader.Downloader.download = refuse
        nltk.data.path[:] = [{str(tmp_path)!r}]
        from mopd_core.domains.ifeval_verifier import lm_eval_ifeval
        registry, utils = lm_eval_ifeval()
        assert "punctuation:no_comma" in registry.INSTRUCTION_DICT
        print("ok")
    """)
    env = {**os.environ, "NLTK_DATA": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-500:] + r.stderr[-1500:]


@linux
def test_code_golden_completions_score_their_expected_reward_and_nothing_escapes():
    exs = {**examples_of("code_lcb"), **examples_of("code_leetcode")}
    entries = golden(("code_lcb", "code_leetcode"))
    marks = [Path(f"/tmp/mopd-real-mini-escape-{g['row']}") for g in entries]
    for m in marks:
        m.unlink(missing_ok=True)
    bad = run_golden(entries, exs, lambda args: get_verifier("code_tests", timeout_s=1.0, **args))
    assert not bad, "\n".join(bad)
    assert not [m for m in marks if m.exists()], "a sandboxed program wrote outside its work dir"


@linux
def test_code_tests_reports_the_program_and_the_failure():
    ex = examples_of("code_lcb")["rm-c05"]
    v = get_verifier("code_tests", timeout_s=2.0)
    r = v.score(ex, "```python\ninput()\nprint(max(map(int, input().split())))\n```")
    assert r.reward == 1.0 and r.extracted.startswith("input()") and r.info["passed"] == r.info["total"] == 2
    r = v.score(ex, "```python\nwhile True:\n    pass\n```")
    assert r.reward == 0.0 and r.info["failure"] == "timeout" and r.info["passed"] == 0
    r = v.score(ex, "```python\nimport socket\n```")
    assert r.reward == 0.0 and "blocked" in r.info["failure"]
    legacy = Example("p", "code", None, {"tests": ["assert f(1) == 2", "assert f(2) == 5"]})
    assert v(legacy, "def f(x):\n    return 2 * x\n") == 0.5  # assert rows keep fraction scoring by default


def test_lcb_output_comparison():
    assert lcb_outputs_match("2.5\n", "2.50")
    assert lcb_outputs_match("1  2 \n3\n\n", "1 2\n3")
    assert lcb_outputs_match("3.0", "3")
    assert not lcb_outputs_match("0.333", "0.3333")
    assert not lcb_outputs_match("YES", "yes")
    assert not lcb_outputs_match("1 2 3", "1\n2\n3")
    assert not lcb_outputs_match("abc 1", "abd 1")


def test_split_think():
    assert split_think("no tags") == (None, "no tags")
    assert split_think("<think>a</think> b") == (True, " b")
    assert split_think("<think>a</think>") == (False, "")
    assert split_think("<think>a") == (False, "")
    assert split_think("<think>a</think><think>b</think>c") == (False, "c")


def test_unknown_or_bad_verifier_args_are_one_line_errors(tmp_path):
    with pytest.raises(DomainError) as e:
        get_verifier("math_verify", mod="boxed")
    assert "\n" not in str(e.value) and "unknown verifier_args ['mod']" in str(e.value)
    assert "accepted:" in str(e.value) and "mode" in str(e.value) and "timeout_s" in str(e.value)
    for name, args, needle in [("math_verify", {"mode": "fuzzy"}, "mode must be one of boxed, gsm8k, aime, any"),
                               ("ifeval", {"score": "half"}, "score must be one of all, fraction"),
                               ("ifeval", {"mode": "lenient"}, "mode must be one of strict, loose"),
                               ("code_tests", {"scoring": "most"}, "scoring must be one of all, fraction"),
                               ("code_tests", {"max_tests": 0}, "max_tests must be >= 1"),
                               ("math_verify", {"think_format_weight": 2}, "think_format_weight"),
                               ("exact_match", {"mode": "x"}, "accepted: (none)")]:
        with pytest.raises(DomainError, match=needle.replace("(", r"\(").replace(")", r"\)")) as e:
            get_verifier(name, **args)
        assert "\n" not in str(e.value)
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "teacher_id": "math", "answer": str(i)}) + "\n"
                            for i in range(5)), encoding="utf-8")
    with pytest.raises(DomainError) as e:
        build_domain("math", str(path), verifier="math_verify", verifier_args={"timeout": 3})
    assert str(e.value).startswith("domain 'math': verifier math_verify: unknown verifier_args ['timeout']")
    d = build_domain("math", str(path), verifier="math_verify", verifier_args={"mode": "aime"}, eval_size=1)
    assert d.verifier.mode == "aime"
    ex = d.eval_examples()[0]
    assert d.reward(ex, f"\\boxed{{{ex.answer}}}") == 1.0  # aime compares integers in-process: no pool
    with pytest.raises(DomainError, match="synthetic sources take no verifier_args"):
        build_domain("m", "synthetic:math", verifier_args={"mode": "aime"})


def test_domain_spec_carries_verifier_args():
    from mopd_core.config import DomainSpec

    spec = DomainSpec(name="math", source="x.jsonl", verifier="math_verify", verifier_args={"mode": "gsm8k"})
    assert spec.verifier_args == {"mode": "gsm8k"} and DomainSpec(name="a", source="b").verifier_args == {}


def test_missing_or_bad_fields_are_one_line_errors(punkt_tab):
    cases = [
        ("math_verify", {}, Example("q", "math", None), "needs the gold answer in 'answer'"),
        ("math_verify", {"mode": "aime"}, Example("q", "math", "1/2"), "is not an integer 0-999"),
        ("ifeval", {}, Example("q", "if", None, {}), "needs 'instruction_id_list'"),
        ("ifeval", {}, Example("q", "if", None, {"instruction_id_list": ["punctuation:no_coma"], "kwargs": [{}]}),
         "unknown instruction id 'punctuation:no_coma'"),
        ("ifeval", {}, Example("q", "if", None, {"instruction_id_list": ["punctuation:no_comma"], "kwargs": []}),
         "object per instruction"),
        ("ifeval", {}, Example("q", "if", None, {"instruction_id_list": ["length_constraints:number_words"],
                                                 "kwargs": [{"relation": "less than"}]}), "lacks ['num_words']"),
        ("ifeval", {}, Example("q", "if", None, {"instruction_id_list": ["length_constraints:number_words"],
                                                 "kwargs": [{"relation": "about", "num_words": 3}]}),
         "kwargs[0] for length_constraints:number_words are invalid"),
        ("code_tests", {}, Example("q", "code", None, {"tests": [{"input": "1", "output": "1",
                                                                  "testtype": "functional"}]}), "'func_name'"),
        ("code_tests", {}, Example("q", "code", None, {"tests": [{"input": "[1", "output": "1",
                                                                  "testtype": "functional"}], "func_name": "f"}),
         "not JSON"),
        ("code_tests", {}, Example("q", "code", None, {"tests": [{"input": "1", "output": "1",
                                                                  "testtype": "stdio"}]}), "testtype 'stdio'"),
        ("code_tests", {}, Example("q", "code", None, {"test": "def check(candidate):\n    assert candidate()\n"}),
         "needs an 'entry_point'"),
        ("code_tests", {}, Example("q", "code", None, {"test": "assert True", "entry_point": "f"}),
         "def check(candidate)"),
    ]
    for name, args, ex, needle in cases:
        with pytest.raises(DomainError) as e:
            get_verifier(name, **args).validate(ex)
        assert needle in str(e.value) and "\n" not in str(e.value), (needle, str(e.value))


def test_training_rewards_get_the_truncation_flags(tmp_path):
    """`zero_if_truncated` in training, not only at eval: the loop's reward call passes each completion's
    truncation flag (budget used up without a stop id) to the domain's verifier."""
    import torch

    from mopd_core.domains import build_domain
    from mopd_core.evaluation import truncated_flags
    from mopd_core.rollout import RolloutBatch
    from mopd_core.train.roles.scorer import rewards as _rewards

    f = tmp_path / "m.jsonl"
    f.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n" + json.dumps({"prompt": "2+2?", "answer": "4"})
                 + "\n")
    dom = build_domain("math", str(f), eval_size=0, verifier="math_verify",
                       verifier_args={"zero_if_truncated": True})
    exs = [e for e in dom.train_examples(40, random.Random(0)) if e.answer == "2"][:1] + \
        [e for e in dom.train_examples(40, random.Random(0)) if e.answer == "4"][:1]
    ok = [rf"\boxed{{{e.answer}}}" for e in exs]
    # row 0 used the 3-token budget without a stop id (9): truncated; row 1 stopped on 9
    ids = torch.tensor([[5, 6, 7], [5, 9, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    batch = RolloutBatch(torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1), ids, mask, torch.zeros(2, 3),
                         exs, ok)
    flags = truncated_flags(batch, 3, [9])
    assert flags == [True, False]
    assert dom.rewards(exs, ok) == [1.0, 1.0]  # without flags: nothing is known to be cut off
    assert _rewards({"math": dom}, batch, flags) == [0.0, 1.0]
