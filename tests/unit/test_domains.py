"""Domains: synthetic generators (answers recomputed independently here), held-out eval sets, the dataset loader
and its one-line errors, teacher-id checks, and the simple verifiers."""

from __future__ import annotations

import json
import random
import re

import pytest

from mopd_core.domains import (DatasetDomain, Domain, DomainError, Example, available_domains, build_domain,
                               check_teacher_ids, get_verifier, load_examples, register_domain)
from mopd_core.domains.base import _REGISTRY


# ---- synthetic domains ------------------------------------------------------------------------------------

def _expected(kind: str, prompt: str) -> str:
    """Recompute the answer from the prompt, independently of the generator."""
    if kind == "math":
        m = re.fullmatch(r"(\d{2})([+-])(\d{2})=", prompt)
        assert m, prompt
        a, op, b = int(m[1]), m[2], int(m[3])
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert op == "+" or a >= b, prompt  # no negative results
        return str(a + b if op == "+" else a - b)
    if kind == "code":
        m = re.fullmatch(r"(sort|rev):(\w{5})=", prompt)
        assert m, prompt
        if m[1] == "sort":
            assert m[2].isdigit()
            return "".join(sorted(m[2], key=int))
        assert re.fullmatch(r"[a-z]{5}", m[2])
        return "".join(reversed(m[2]))
    m = re.fullmatch(r"upper:([a-z]{3,5})=", prompt)
    if m:
        return m[1].upper()
    m = re.fullmatch(r"rep([23]):([a-z]{2,3})=", prompt)
    assert m, prompt
    return "".join(m[2] for _ in range(int(m[1])))


KINDS = ["math", "code", "if"]


def test_the_builtin_kinds_are_registered():
    assert set(KINDS) <= set(available_domains())


@pytest.mark.parametrize("kind", KINDS)
def test_synthetic_answers_are_correct(kind):
    dom = build_domain(kind, f"synthetic:{kind}", eval_size=50, seed=3)
    exs = dom.train_examples(1000, random.Random(0)) + dom.eval_examples()
    for ex in exs:
        assert ex.teacher_id == kind
        assert ex.answer == _expected(kind, ex.prompt), ex
        assert ex.answer == ex.answer.strip() and ex.answer
    tasks = {re.sub(r"\d", "", ex.prompt.split(":")[0]) if ":" in ex.prompt else ex.prompt[2] for ex in exs}
    assert len(tasks) == 2, tasks  # both tasks / both operators occur


@pytest.mark.parametrize("kind", KINDS)
def test_eval_prompts_are_fixed_distinct_and_never_trained_on(kind):
    dom = build_domain(kind, f"synthetic:{kind}", eval_size=200, seed=0)
    ev = dom.eval_examples()
    assert len(ev) == 200 and len({e.prompt for e in ev}) == 200
    assert dom.eval_examples() == ev  # same every call
    eval_prompts = {e.prompt for e in ev}
    train = dom.train_examples(5000, random.Random(1))
    assert len(train) == 5000
    assert not eval_prompts & {e.prompt for e in train}


def test_eval_exclusion_holds_on_a_small_space():
    # 1-digit addition: 100 prompts, 50 held out; 5000 training draws must still avoid all of them
    dom = build_domain("m", "synthetic:math", {"digits": 1, "ops": "+"}, eval_size=50, seed=0)
    eval_prompts = {e.prompt for e in dom.eval_examples()}
    train = {e.prompt for e in dom.train_examples(5000, random.Random(0))}
    assert len(eval_prompts) == 50 and not eval_prompts & train and len(train) == 50


@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_same_prompts_other_seed_other_eval(kind):
    a = build_domain(kind, f"synthetic:{kind}", eval_size=100, seed=7)
    b = build_domain(kind, f"synthetic:{kind}", eval_size=100, seed=7)
    c = build_domain(kind, f"synthetic:{kind}", eval_size=100, seed=8)
    assert a.eval_examples() == b.eval_examples()
    assert a.eval_examples() != c.eval_examples()
    assert a.train_examples(300, random.Random(5)) == b.train_examples(300, random.Random(5))
    assert a.train_examples(300, random.Random(5)) != a.train_examples(300, random.Random(6))


@pytest.mark.parametrize("kind", KINDS)
def test_rewards_are_exact_match_in_unit_interval(kind):
    dom = build_domain(kind, f"synthetic:{kind}", eval_size=20)
    exs = dom.eval_examples()
    right = [e.answer for e in exs]
    assert dom.rewards(exs, right) == [1.0] * len(exs)
    assert dom.rewards(exs, [f" {a}\n" for a in right]) == [1.0] * len(exs)  # surrounding whitespace only
    assert dom.rewards(exs, [a + "0" for a in right]) == [0.0] * len(exs)
    assert dom.rewards(exs, ["", "!", "a b"] * 6 + ["", ""]) == [0.0] * 20
    assert all(0.0 <= r <= 1.0 for r in dom.rewards(exs, ["12"] * 20))
    with pytest.raises(ValueError):
        dom.rewards(exs, right[:-1])


def test_synthetic_params():
    dom = build_domain("m3", "synthetic:math", {"digits": 3, "ops": "-"}, eval_size=10)
    for ex in dom.train_examples(200, random.Random(0)):
        a, b = map(int, ex.prompt[:-1].split("-"))
        assert 100 <= b <= a <= 999 and ex.answer == str(a - b)
    code = build_domain("c", "synthetic:code", {"length": 7, "tasks": ["rev"]}, eval_size=10)
    assert all(re.fullmatch(r"rev:[a-z]{7}=", e.prompt) for e in code.train_examples(50, random.Random(0)))
    with pytest.raises(DomainError, match="unknown params \\['digitz'\\].*digits"):
        build_domain("m", "synthetic:math", {"digitz": 3})
    with pytest.raises(DomainError, match="params.ops"):
        build_domain("m", "synthetic:math", {"ops": "/"})
    with pytest.raises(DomainError, match="eval_size=90 is more than half"):
        build_domain("m", "synthetic:math", {"digits": 1, "ops": "+"}, eval_size=90)


@pytest.mark.parametrize("kind,weak,other", [("math", "-", "+"), ("code", "rev", "sort"), ("if", "rep", "upper")])
def test_weak_demonstrator_changes_only_its_tasks_sft_completion(kind, weak, other):
    """With `weak_rate` r, about r of the weak task's SFT completions end in a stray "."; the reward's
    reference, the other task and the eval set are untouched; off by default (and then the same draws)."""
    from mopd_core.config import load_config
    from mopd_core.train.sft import sft_examples

    dom = build_domain(kind, f"synthetic:{kind}", {"weak_tasks": [weak], "weak_rate": 0.7}, eval_size=20)
    exs = dom.train_examples(3000, random.Random(1))
    flawed = {True: [0, 0], False: [0, 0]}  # per is-weak-task: [flawed, all]
    for e in exs:
        is_weak = dom.task_of(e.prompt) == weak
        assert dom.task_of(e.prompt) in (weak, other)
        c = e.fields.get("completion")
        if c is not None:
            assert is_weak and c == e.answer + "." and dom.reward(e, e.answer) == 1.0
            assert dom.reward(e, c) == 0.0
        flawed[is_weak][0] += c is not None
        flawed[is_weak][1] += 1
    assert flawed[False][0] == 0
    assert 0.64 < flawed[True][0] / flawed[True][1] < 0.76, flawed  # 0.7 of them, ± ~5 sigma
    assert not any("completion" in e.fields for e in dom.eval_examples())
    plain = build_domain(kind, f"synthetic:{kind}", eval_size=20)
    zero = build_domain(kind, f"synthetic:{kind}", {"weak_tasks": [weak], "weak_rate": 0.0}, eval_size=20)
    assert plain.train_examples(50, random.Random(1)) == zero.train_examples(50, random.Random(1))
    # SFT trains on the demonstration, the verifier keeps the reference
    cfg = load_config("tiny", ["sft.steps=4", "sft.batch_size=64", f"sft.mix={{{kind}: 1.0}}"])
    rows = [r for r in sft_examples(cfg, {kind: dom}) if dom.task_of(r["prompt"]) == weak]

    def reference(prompt: str) -> str:  # the weak task's right answer, from the prompt alone
        body = prompt[:-1]
        if kind == "math":
            a, b = map(int, body.split("-"))
            return str(a - b)
        task, w = body.split(":")
        return w[::-1] if task == "rev" else w * int(task[3:])

    long = sum(r["completion"] == reference(r["prompt"]) + "." for r in rows)
    assert all(r["completion"] in (reference(r["prompt"]), reference(r["prompt"]) + ".") for r in rows)
    assert 0.5 < long / len(rows) < 0.85, (long, len(rows))
    with pytest.raises(DomainError, match="params.weak_tasks"):
        build_domain(kind, f"synthetic:{kind}", {"weak_tasks": ["nope"]})
    with pytest.raises(DomainError, match="params.weak_rate"):
        build_domain(kind, f"synthetic:{kind}", {"weak_rate": 1.5})


def test_unknown_kind_lists_the_known_ones():
    with pytest.raises(DomainError, match=r"unknown synthetic domain kind 'chess'; known kinds: .*code.*if.*math"):
        build_domain("chess", "synthetic:chess")
    with pytest.raises(DomainError, match="synthetic sources bring their own"):
        build_domain("math", "synthetic:math", verifier="code_tests")


def test_register_domain_as_decorator():
    class Echo(Domain):
        def __init__(self, name, eval_size, seed, word="hi"):
            self.name, self.word = name, word

        def train_examples(self, n, rng):
            return [Example(f"say {self.word}{rng.randrange(10)}=", self.name, self.word) for _ in range(n)]

        def eval_examples(self):
            return [Example(f"say {self.word}=", self.name, self.word)]

        def reward(self, example, completion):
            return float(completion.strip() == example.answer)

    try:
        assert register_domain("echo")(Echo) is Echo
        assert "echo" in available_domains()
        dom = build_domain("e", "synthetic:echo", {"word": "yo"})
        assert dom.eval_examples()[0].prompt == "say yo=" and dom.rewards(dom.eval_examples(), ["yo"]) == [1.0]
    finally:
        _REGISTRY.pop("echo", None)


def test_examples_are_hashable_with_dict_like_fields():
    ex = Example("p", "code", None, {"tests": ["assert 1", {"input": "1", "output": "2"}], "n": 3})
    assert ex.fields["tests"][0] == "assert 1" and ex.fields["tests"][1]["output"] == "2" and ex.fields["n"] == 3
    assert hash(ex) == hash(Example("p", "code", None, {"n": 3, "tests": ["assert 1", {"output": "2", "input": "1"}]}))
    assert len({ex, Example("p", "code", None, dict(ex.fields))}) == 1
    assert ex.to_dict() == {"prompt": "p", "teacher_id": "code", "tests": ["assert 1", {"input": "1", "output": "2"}],
                            "n": 3}
    with pytest.raises(TypeError):
        ex.fields["n"] = 4  # type: ignore[index]
    import copy
    import pickle

    for clone in (pickle.loads(pickle.dumps(ex)), copy.deepcopy(ex)):  # Ray workers pickle examples
        assert clone == ex and hash(clone) == hash(ex)


# ---- the dataset loader -----------------------------------------------------------------------------------

ROWS = [
    {"prompt": f"q{i}?", "teacher_id": ["math", "code"][i % 2], "answer": f"a{i}", "difficulty": i % 3}
    for i in range(40)
]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _check_round_trip(exs):
    assert len(exs) == len(ROWS)
    for ex, row in zip(exs, ROWS):
        assert (ex.prompt, ex.teacher_id, ex.answer) == (row["prompt"], row["teacher_id"], row["answer"])
        assert dict(ex.fields) == {"difficulty": row["difficulty"]}


def test_load_jsonl_and_json(tmp_path):
    _check_round_trip(load_examples(_write_jsonl(tmp_path / "d.jsonl", ROWS)))
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    _check_round_trip(load_examples(tmp_path / "d.json"))


def test_load_parquet(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    pd.DataFrame(ROWS).to_parquet(tmp_path / "d.parquet")
    _check_round_trip(load_examples(tmp_path / "d.parquet"))


def test_load_save_to_disk_dirs(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "ds"))
    _check_round_trip(load_examples(tmp_path / "ds"))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(4))}).save_to_disk(str(tmp_path / "dd"))
    _check_round_trip(load_examples(tmp_path / "dd", split="train"))
    assert len(load_examples(tmp_path / "dd", split="test")) == 4
    with pytest.raises(DomainError, match=r"DatasetDict with splits train, test; choose one with split="):
        load_examples(tmp_path / "dd")
    with pytest.raises(DomainError, match=r"split 'dev' not in .*dd; available splits: train, test"):
        load_examples(tmp_path / "dd", split="dev")
    with pytest.raises(DomainError, match="not a `datasets` save_to_disk directory"):
        load_examples(tmp_path)


def _one_line_error(fn, *needles):
    with pytest.raises(DomainError) as ei:
        fn()
    msg = str(ei.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def test_bad_inputs_give_one_line_errors_naming_the_problem(tmp_path):
    missing = tmp_path / "nope.jsonl"
    _one_line_error(lambda: load_examples(missing), "not found", str(missing))
    csv = tmp_path / "d.csv"
    csv.write_text("prompt,teacher_id\nx,math\n")
    _one_line_error(lambda: load_examples(csv), str(csv), "'.csv'", ".jsonl", ".parquet")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    _one_line_error(lambda: load_examples(empty), str(empty), "empty")
    no_tid = _write_jsonl(tmp_path / "no_tid.jsonl", [{"prompt": "x", "answer": "1", "level": 2}])
    _one_line_error(lambda: load_examples(no_tid), str(no_tid), "'teacher_id'",
                    "columns present: prompt, answer, level")
    blank = _write_jsonl(tmp_path / "blank.jsonl", ROWS[:3] + [{"prompt": "  ", "teacher_id": "math"}])
    _one_line_error(lambda: load_examples(blank), str(blank), "row 3", "prompt")
    int_tid = _write_jsonl(tmp_path / "int_tid.jsonl", ROWS[:5] + [{"prompt": "x", "teacher_id": 7}])
    _one_line_error(lambda: load_examples(int_tid), str(int_tid), "row 5", "teacher_id must be a non-empty string")
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "x", "teacher_id": "math"}\n{"prompt": \n')
    _one_line_error(lambda: load_examples(bad_json), str(bad_json), "line 2", "invalid JSON")
    num_answer = _write_jsonl(tmp_path / "num.jsonl", [{"prompt": "1+1=", "teacher_id": "math", "answer": 2}])
    _one_line_error(lambda: load_examples(num_answer), "row 0", "answer must be a string")


def test_missing_parquet_column_is_named(tmp_path):
    pd = pytest.importorskip("pandas")
    pd.DataFrame([{"question": "x", "teacher_id": "math"}]).to_parquet(tmp_path / "d.parquet")
    _one_line_error(lambda: load_examples(tmp_path / "d.parquet"), "no column 'prompt'",
                    "columns present: question, teacher_id")


def test_check_teacher_ids_names_the_unknown_and_the_known():
    exs = [Example("a", "math"), Example("b", "code"), Example("c", "poetry")]
    check_teacher_ids(exs[:2], ["math", "code", "if"])
    msg = _one_line_error(lambda: check_teacher_ids(exs, ["math", "code", "if"], source="data.jsonl"),
                          "unknown teacher_id 'poetry'", "data.jsonl", "row 2", "known teachers: code, if, math")
    assert msg.startswith("unknown teacher_id 'poetry' in data.jsonl (row 2); known teachers: code, if, math")


# ---- dataset domains --------------------------------------------------------------------------------------

def test_dataset_domain_splits_its_teachers_rows(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", ROWS + [dict(ROWS[0])])  # a duplicate prompt of an eval/train row
    dom = build_domain("math", str(path), eval_size=5, seed=1)
    assert isinstance(dom, DatasetDomain)
    ev = dom.eval_examples()
    assert len(ev) == 4  # min(eval_size, ceil(20% of 20 distinct prompts))
    assert all(e.teacher_id == "math" for e in ev) and dom.eval_examples() == ev
    train = dom.train_examples(2000, random.Random(0))
    assert {e.teacher_id for e in train} == {"math"}
    assert not {e.prompt for e in ev} & {e.prompt for e in train}
    assert len({e.prompt for e in train}) == 16  # every other math row is reachable
    assert dom.train_examples(50, random.Random(3)) == dom.train_examples(50, random.Random(3))
    assert build_domain("math", str(path), eval_size=5, seed=1).eval_examples() == ev
    assert dom.rewards(ev, [e.answer for e in ev]) == [1.0] * 4
    assert dom.rewards(ev, ["nope"] * 4) == [0.0] * 4


def test_dataset_domain_errors(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    _one_line_error(lambda: build_domain("poetry", str(path)), "no rows with teacher_id 'poetry'",
                    "teacher_ids present: code, math")
    one = _write_jsonl(tmp_path / "one.jsonl", [{"prompt": "x", "teacher_id": "math", "answer": "1"}])
    _one_line_error(lambda: build_domain("math", str(one)), "nothing left to train on")
    assert build_domain("math", str(one), eval_size=0).eval_examples() == []
    no_answer = _write_jsonl(tmp_path / "na.jsonl", ROWS[:4] + [{"prompt": "y", "teacher_id": "math"}])
    _one_line_error(lambda: build_domain("math", str(no_answer)), "row 4", "exact_match needs an 'answer' column")
    _one_line_error(lambda: build_domain("math", str(path), verifier="regex"), "unknown verifier 'regex'",
                    "code_tests, contains, exact_match")
    _one_line_error(lambda: build_domain("math", str(path), {"spilt": "train"}), "unknown params ['spilt']")
    _one_line_error(lambda: build_domain("math", str(path), verifier="code_tests"), "row 0", "'tests' column")


def test_simple_verifiers():
    ex = Example("capital of France?", "qa", "Paris")
    em, contains = get_verifier("exact_match"), get_verifier("contains")
    assert em(ex, " Paris\n") == 1.0 and em(ex, "paris") == 0.0 and em(ex, "It is Paris") == 0.0
    assert contains(ex, "It is Paris.") == 1.0 and contains(ex, "Lyon") == 0.0
    assert em.batch([ex, ex], ["Paris", "Rome"]) == [1.0, 0.0]
    with pytest.raises(DomainError, match="unknown verifier 'bleu'; known verifiers: code_tests, contains, exact_"):
        get_verifier("bleu")


def test_sft_trains_on_a_datasets_completion_column_and_needs_an_answer_or_completion(tmp_path):
    """A `completion` column is the SFT target while `answer` stays the verifier's; a domain whose examples have
    neither is one line naming both columns."""
    from mopd_core.config import load_config
    from mopd_core.errors import DataError
    from mopd_core.train.sft import sft_examples

    rows = [{"prompt": f"q{i}=", "teacher_id": "math", "answer": f"a{i}", "completion": f"c{i}"} for i in range(20)]
    dom = build_domain("math", str(_write_jsonl(tmp_path / "c.jsonl", rows)), eval_size=2, seed=0)
    cfg = load_config("tiny", ["sft.steps=2", "sft.batch_size=8", "sft.mix={math: 1.0}"])
    got = sft_examples(cfg, {"math": dom})
    assert len(got) == 16 and all(r["completion"] == "c" + r["prompt"][1:-1] for r in got)

    class Bare(Domain):
        name = "math"

        def train_examples(self, n, rng):
            return [Example(f"q{i}=", "math") for i in range(n)]

        def eval_examples(self):
            return []

        def reward(self, example, completion):
            return 0.0

    with pytest.raises(DataError, match="SFT needs a reference answer.*`completion`"):
        sft_examples(cfg, {"math": Bare()})
