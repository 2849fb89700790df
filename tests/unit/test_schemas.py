"""Hub dataset schemas: each adapter reads a small file written here in that schema (jsonl, and parquet where the
hub ships parquet) into the expected Examples, which round-trip through `Example.to_dict` and the flat loader;
chat-message prompts; the column map; the restricted unpickler; one-line errors; `filter_long_prompts`;
`mopd data check`."""

from __future__ import annotations

import base64
import copy
import json
import logging
import pickle
import random
import zlib
from pathlib import Path

import pytest

from mopd_core import cli
from mopd_core.domains import DatasetDomain, DomainError, Example, build_domain, load_examples
from mopd_core.domains.base import prompt_text
from mopd_core.domains.dataset import filter_long_prompts, inspect_source
from mopd_core.domains.schemas import ColumnMap, coerce_answer, detect_schema, normalize_tests, plain_unpickle

ROOT = Path(__file__).resolve().parents[2]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path: Path, rows: list[dict]) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _one_line(fn, *needles) -> str:
    with pytest.raises(DomainError) as ei:
        fn()
    msg = str(ei.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def _round_trips(exs: list[Example], tmp_path: Path, name: str) -> None:
    """`to_dict` rows written as mopd's flat jsonl load back to the same Examples (the loader's inverse)."""
    back = load_examples(_jsonl(tmp_path / f"{name}-flat.jsonl", [e.to_dict() for e in exs]))
    assert back == exs


def _b64_zlib(data: bytes) -> str:
    return base64.b64encode(zlib.compress(data)).decode()


# ---- chat-message prompts --------------------------------------------------------------------------------

MSGS = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2+2?"}]


def test_message_prompts_are_frozen_hashable_and_round_trip(tmp_path):
    ex = Example(MSGS, "math", "4", {"level": 1})
    assert isinstance(ex.prompt, tuple) and ex.prompt[1]["content"] == "What is 2+2?" and ex.is_chat
    with pytest.raises(TypeError):
        ex.prompt[0]["role"] = "user"  # type: ignore[index]
    same = Example(tuple(dict(m) for m in MSGS), "math", "4", {"level": 1})
    assert same == ex and hash(same) == hash(ex) and len({ex, same}) == 1
    assert Example(MSGS[1:], "math", "4", {"level": 1}) != ex
    assert ex.to_dict() == {"prompt": MSGS, "teacher_id": "math", "answer": "4", "level": 1}
    assert ex.prompt_messages() == MSGS
    assert prompt_text(ex) == "Answer briefly.\n\nWhat is 2+2?" and prompt_text(MSGS[1:]) == "What is 2+2?"
    for clone in (pickle.loads(pickle.dumps(ex)), copy.deepcopy(ex)):  # Ray workers pickle examples
        assert clone == ex and hash(clone) == hash(ex)
    s = Example("2+2=", "math", "4")  # string prompts are unchanged
    assert not s.is_chat and s.prompt_messages() == [{"role": "user", "content": "2+2="}] and prompt_text(s) == "2+2="
    _round_trips([ex, s], tmp_path, "msgs")
    # parquet struct columns add null keys: ignored
    assert Example([{"role": "user", "content": "hi", "name": None}], "x").prompt_messages() == [
        {"role": "user", "content": "hi"}]


def test_bad_messages_are_one_line_errors():
    _one_line(lambda: Example([{"role": "human", "content": "hi"}], "x"), "role 'human'", "user")
    _one_line(lambda: Example([{"role": "user", "content": None}], "x"), "content must be a string")
    _one_line(lambda: Example([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "x"),
              "content must be a string")
    _one_line(lambda: Example([], "x"), "empty list of chat messages")
    _one_line(lambda: Example([{"from": "human", "value": "hi"}], "x"), "['from', 'value']", "ShareGPT")
    _one_line(lambda: Example(["hi"], "x"), "message 0 is a str")
    _one_line(lambda: Example([{"role": "user", "content": "  "}], "x"), "empty content")
    _one_line(lambda: Example(7, "x"), "prompt must be a string or a list of chat messages")  # type: ignore[arg-type]


def test_a_dataset_domain_of_message_prompts_splits_by_prompt(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i)} for i in range(10)]
    dom = build_domain("math", str(_jsonl(tmp_path / "m.jsonl", rows + rows[:1])), eval_size=2, seed=0)
    assert isinstance(dom, DatasetDomain) and len(dom.eval_examples()) == 2
    ev = {e.prompt for e in dom.eval_examples()}
    train = dom.train_examples(500, random.Random(0))
    assert {e.teacher_id for e in train} == {"math"}  # no teacher_id column: the domain's name
    assert not ev & {e.prompt for e in train} and len({e.prompt for e in train}) == 8
    assert dom.rewards(dom.eval_examples(), [e.answer for e in dom.eval_examples()]) == [1.0, 1.0]


# ---- verl RL parquet -------------------------------------------------------------------------------------

def _verl_row(i: int, q: str, gt, ability: str = "math") -> dict:
    """As verl's examples/data_preprocess/gsm8k.py writes a row."""
    return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": q}], "ability": ability,
            "reward_model": {"style": "rule", "ground_truth": gt},
            "extra_info": {"split": "train", "index": i, "question": q}}


def test_verl_parquet_and_jsonl(tmp_path):
    rows = [_verl_row(0, "Natalia sold 48 clips ... How many?", "72"), _verl_row(1, "Half of 5?", "2.5"),
            _verl_row(2, "Roots of x^2-9?", "3, -3")]
    want = [Example([{"role": "user", "content": r["extra_info"]["question"]}], "math",
                    r["reward_model"]["ground_truth"],
                    {"data_source": "openai/gsm8k", "ability": "math", "extra_info": r["extra_info"]}) for r in rows]
    for path in (_parquet(tmp_path / "v.parquet", rows), _jsonl(tmp_path / "v.jsonl", rows)):
        exs, info = inspect_source(path, default_teacher_id="math")
        assert (info.schema, info.how) == ("verl", "recognised") and exs == want
    _round_trips(want, tmp_path, "verl")
    # numbers as ground truth (a jsonl can mix types): coerced to strings, no spurious ".0"
    mixed = [_verl_row(0, "a", 72), _verl_row(1, "b", 2.5), _verl_row(2, "c", 3.0), _verl_row(3, "d", -4)]
    got = load_examples(_jsonl(tmp_path / "n.jsonl", mixed), default_teacher_id="math")
    assert [e.answer for e in got] == ["72", "2.5", "3", "-4"]
    # without a teacher_id column and outside a domain, nothing names the teacher
    _one_line(lambda: load_examples(tmp_path / "v.parquet"), "no column 'teacher_id'", "schema verl",
              "load the file as a domain")


def test_a_mixed_verl_file_routes_by_a_teacher_id_field(tmp_path):
    rows = ([_verl_row(i, f"m{i}", str(i)) for i in range(6)]
            + [_verl_row(i, f"c{i}", "[]", ability="code") for i in range(6, 10)])
    path = _parquet(tmp_path / "mixed.parquet", rows)
    dom = build_domain("code", str(path), {"teacher_id_field": "ability"}, eval_size=1)
    assert {e.prompt[0]["content"] for e in dom.train_examples(200, random.Random(0))} | {
        e.prompt[0]["content"] for e in dom.eval_examples()} == {f"c{i}" for i in range(6, 10)}
    _one_line(lambda: build_domain("math", str(path), {"teacher_id_field": "domain"}), "'domain'",
              "params.teacher_id_field")


# ---- IFEval ----------------------------------------------------------------------------------------------

IFEVAL = [
    {"key": 1000, "prompt": "Write a 300+ word summary. Do not use any commas. Highlight at least 3 sections.",
     "instruction_id_list": ["punctuation:no_comma", "detectable_format:number_highlighted_sections",
                             "length_constraints:number_words"],
     "kwargs": [{}, {"num_highlights": 3}, {"relation": "at least", "num_words": 300}]},
    {"key": 1001, "prompt": "Answer in all lowercase letters.",
     "instruction_id_list": ["change_case:english_lowercase"], "kwargs": [{}]},
]


def test_ifeval_jsonl_and_parquet(tmp_path):
    want = [Example(r["prompt"], "if", None, {"key": r["key"], "instruction_id_list": r["instruction_id_list"],
                                              "kwargs": r["kwargs"]}) for r in IFEVAL]
    # the hub's parquet turns kwargs into one struct of every key, null where an instruction has none
    for path in (_jsonl(tmp_path / "if.jsonl", IFEVAL), _parquet(tmp_path / "if.parquet", IFEVAL)):
        exs, info = inspect_source(path, default_teacher_id="if")
        assert info.schema == "ifeval" and exs == want
        assert exs[0].fields["kwargs"][2] == {"relation": "at least", "num_words": 300}
    _round_trips(want, tmp_path, "ifeval")
    bad = [dict(IFEVAL[1], kwargs=[{}, {}])]
    _one_line(lambda: load_examples(_jsonl(tmp_path / "bad.jsonl", bad), default_teacher_id="if"), "row 0",
              "'kwargs' has 2 entries for 1 instructions")
    bad = [dict(IFEVAL[1], instruction_id_list="change_case:english_lowercase")]
    _one_line(lambda: load_examples(_jsonl(tmp_path / "bad2.jsonl", bad), default_teacher_id="if"), "row 0",
              "instruction_id_list")


# ---- LiveCodeBench ---------------------------------------------------------------------------------------

TWO_SUM_STARTER = "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n        "


def _lcb_rows() -> list[dict]:
    """As livecodebench/code_generation_lite publishes them: test cases as JSON text, the private ones as
    base64(zlib(pickle(JSON text)))."""
    private = [{"input": "[3,3]\n6", "output": "[0, 1]", "testtype": "functional"}]
    return [
        {"question_title": "two-sum", "question_content": "Given nums and target, return the two indices.",
         "platform": "leetcode", "question_id": "1", "contest_id": "weekly-1", "contest_date": "2023-08-21T00:00:00",
         "starter_code": TWO_SUM_STARTER, "difficulty": "easy",
         "public_test_cases": json.dumps([{"input": "[2,7,11,15]\n9", "output": "[0, 1]", "testtype": "functional"}]),
         "private_test_cases": _b64_zlib(pickle.dumps(json.dumps(private))),
         "metadata": json.dumps({"func_name": "twoSum"})},
        {"question_title": "A+B", "question_content": "Read A and B from standard input and print A+B.",
         "platform": "atcoder", "question_id": "abc000_a", "contest_id": "abc000",
         "contest_date": "2023-08-26T00:00:00",
         "starter_code": "", "difficulty": "easy",
         "public_test_cases": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]),
         "private_test_cases": json.dumps([{"input": "5 5\n", "output": "10\n", "testtype": "stdin"}]),
         "metadata": "{}"},
    ]


def test_livecodebench_rows(tmp_path):
    rows = _lcb_rows()
    exs, info = inspect_source(_jsonl(tmp_path / "lcb.jsonl", rows), default_teacher_id="code")
    assert info.schema == "livecodebench"
    two, ab = exs
    assert two.prompt == ("Given nums and target, return the two indices.\n\nStarter code:\n```python\n"
                          + TWO_SUM_STARTER.rstrip() + "\n```")
    assert two.fields["tests"] == (
        {"input": "[2,7,11,15]\n9", "output": "[0, 1]", "testtype": "functional"},
        {"input": "[3,3]\n6", "output": "[0, 1]", "testtype": "functional"})
    assert two.fields["func_name"] == "twoSum" and two.fields["metadata"] == {"func_name": "twoSum"}
    assert two.answer is None and two.teacher_id == "code" and two.fields["question_id"] == "1"
    assert "public_test_cases" not in two.fields and "private_test_cases" not in two.fields
    assert ab.prompt == rows[1]["question_content"] and "func_name" not in ab.fields
    assert [t["input"] for t in ab.fields["tests"]] == ["1 2\n", "5 5\n"]
    _round_trips(exs, tmp_path, "lcb")
    # a plain pickled list (no JSON inside) is data too; the name comes from the starter code if metadata has none
    rows[0]["private_test_cases"] = _b64_zlib(pickle.dumps([{"input": "[1,2]\n3", "output": "[0, 1]",
                                                            "testtype": "functional"}]))
    rows[0]["metadata"] = "{}"
    ex = load_examples(_jsonl(tmp_path / "lcb2.jsonl", rows), default_teacher_id="code")[0]
    assert ex.fields["tests"][1]["input"] == "[1,2]\n3" and ex.fields["func_name"] == "twoSum"


def test_the_restricted_unpickler_refuses_code(tmp_path):
    """A pickle that would run os.system (built by hand, never loaded by pickle itself) is refused in one line
    and runs nothing; so is one calling builtins.eval; plain data still loads."""
    marker = tmp_path / "pwned"
    evil = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()  # protocol 0: GLOBAL os.system, REDUCE
    _one_line(lambda: plain_unpickle(evil, "private_test_cases"), "os.system", "never executed", "JSON")
    _one_line(lambda: plain_unpickle(b"cbuiltins\neval\n(S'1+1'\ntR.", "x"), "builtins.eval")
    rows = _lcb_rows()
    rows[0]["private_test_cases"] = _b64_zlib(evil)
    path = _jsonl(tmp_path / "evil.jsonl", rows)
    _one_line(lambda: load_examples(path, default_teacher_id="code"), str(path), "row 0", "private_test_cases",
              "os.system")
    assert not marker.exists()
    assert plain_unpickle(pickle.dumps({"a": [1, 2.5, True, None, "s"]})) == {"a": [1, 2.5, True, None, "s"]}
    rows[0]["private_test_cases"] = "not json, not base64 zlib!"
    _one_line(lambda: load_examples(_jsonl(tmp_path / "junk.jsonl", rows), default_teacher_id="code"), "row 0",
              "neither JSON nor base64")


# ---- DeepCoder / TACO ------------------------------------------------------------------------------------

def _deepcoder_rows() -> list[dict]:
    """One row per subset form of agentica-org/DeepCoder-Preview-Dataset (lcbv5, primeintellect stdin and
    function_call, taco), `tests` and `metadata` as JSON text."""
    return [
        {"problem": "Return the max score.", "starter_code": "class Solution:\n    def maxScore(self, a):\n",
         "tests": json.dumps([{"input": "[1,2,3]", "output": "6", "testtype": "functional"}]),
         "metadata": json.dumps({"func_name": "maxScore"})},
        {"problem": "Print the sum of the numbers on the line.", "starter_code": "",
         "tests": json.dumps([{"type": "stdin_stdout", "input": "1 2 3\n", "output": "6\n"}]), "metadata": "{}"},
        {"problem": "Write add(a, b).", "starter_code": "",
         "tests": json.dumps([{"type": "function_call", "fn_name": "add", "input": [1, 2], "output": [3]},
                              {"type": "function_call", "fn_name": "add", "input": ["a", "b"], "output": ["ab"]}]),
         "metadata": "{}"},
        {"problem": "Reverse the list.", "starter_code": "def rev(xs):\n\t",
         "tests": json.dumps({"fn_name": "rev", "inputs": [[[1, 2]]], "outputs": [[[2, 1]]]}), "metadata": "{}"},
    ]


def test_deepcoder_parquet_and_jsonl(tmp_path):
    rows = _deepcoder_rows()
    want_tests = [
        ([{"input": "[1,2,3]", "output": "6", "testtype": "functional"}], "maxScore"),
        ([{"input": "1 2 3\n", "output": "6\n", "testtype": "stdin"}], None),
        ([{"input": "1\n2", "output": "3", "testtype": "functional"},
          {"input": '"a"\n"b"', "output": '"ab"', "testtype": "functional"}], "add"),
        ([{"input": "[1, 2]", "output": "[2, 1]", "testtype": "functional"}], "rev"),
    ]
    for path in (_parquet(tmp_path / "dc.parquet", rows), _jsonl(tmp_path / "dc.jsonl", rows)):
        exs, info = inspect_source(path, default_teacher_id="code")
        assert info.schema == "deepcoder"
        for ex, row, (tests, fn) in zip(exs, rows, want_tests):
            assert ex.fields["tests"] == tuple(tests) and ex.fields.get("func_name") == fn
            assert ex.prompt.startswith(row["problem"]) and ("Starter code" in ex.prompt) == bool(row["starter_code"])
    _round_trips(exs, tmp_path, "deepcoder")
    # a PrimeIntellect column written with Python's repr is read as a literal (never evaluated as code)
    rows[1]["tests"] = str([{"type": "stdin_stdout", "input": "1\n", "output": "1\n"}])
    assert load_examples(_jsonl(tmp_path / "repr.jsonl", rows), default_teacher_id="code")[1].fields["tests"][0][
        "input"] == "1\n"
    rows[1]["tests"] = "__import__('os').system('true')"
    _one_line(lambda: load_examples(_jsonl(tmp_path / "bad.jsonl", rows), default_teacher_id="code"), "row 1",
              "neither JSON nor a Python literal")


def test_taco_rows(tmp_path):
    rows = [
        {"question": "Read two integers and print their sum.",
         "solutions": json.dumps(["print(sum(map(int, input().split())))"]),
         "starter_code": "", "input_output": json.dumps({"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]}),
         "difficulty": "EASY", "source": "codeforces"},
        {"question": "Complete the function is_even.", "solutions": json.dumps([]),
         "starter_code": "def is_even(n):\n\t",
         "input_output": json.dumps({"fn_name": "is_even", "inputs": [[2], [3]], "outputs": [[True], [False]]}),
         "difficulty": "EASY", "source": "codewars"},
    ]
    for path in (_jsonl(tmp_path / "taco.jsonl", rows), _parquet(tmp_path / "taco.parquet", rows)):
        exs, info = inspect_source(path, default_teacher_id="code")
        assert info.schema == "taco"
        assert exs[0].prompt == rows[0]["question"] and exs[0].fields["tests"] == (
            {"input": "1 2\n", "output": "3\n", "testtype": "stdin"},
            {"input": "5 7\n", "output": "12\n", "testtype": "stdin"})
        assert "func_name" not in exs[0].fields and exs[0].fields["source"] == "codeforces"
        assert exs[1].fields["func_name"] == "is_even" and exs[1].fields["tests"] == (
            {"input": "2", "output": "true", "testtype": "functional"},
            {"input": "3", "output": "false", "testtype": "functional"})
        assert "input_output" not in exs[1].fields
    _round_trips(exs, tmp_path, "taco")
    rows[0]["input_output"] = json.dumps({"inputs": ["1\n"], "outputs": []})
    _one_line(lambda: load_examples(_jsonl(tmp_path / "bad.jsonl", rows), default_teacher_id="code"), "row 0",
              "1 inputs but 0 outputs")


# ---- LeetCodeDataset -------------------------------------------------------------------------------------

LEETCODE = {
    "task_id": "two-sum", "question_id": 1, "difficulty": "Easy", "tags": ["Array", "Hash Table"],
    "problem_description": "Given an array of integers nums and an integer target, return indices ...",
    "starter_code": "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:",
    "estimated_date": "2015-08-07", "prompt": "from typing import *\nfrom collections import *\n",
    "completion": "class Solution:\n    def twoSum(self, nums, target):\n        d = {}\n        ...",
    "entry_point": "Solution().twoSum",
    "test": "def check(candidate):\n    assert candidate(nums = [2,7,11,15], target = 9) == [0,1]\n",
    "input_output": [{"input": "nums = [3,3], target = 6", "output": "[0, 1]"}],
    "query": ("Given an array of integers nums ...\nPlease complete the following python code precisely:\n"
              "```python\nclass Solution:\n```"),
    "response": "Use a hash map.\n```python\nclass Solution:\n    ...\n```",
}


def test_leetcode_rows(tmp_path):
    exs, info = inspect_source(_jsonl(tmp_path / "lc.jsonl", [LEETCODE]), default_teacher_id="code")
    assert info.schema == "leetcode"
    (ex,) = exs
    assert ex.prompt == LEETCODE["query"] and ex.answer is None
    assert ex.fields["test"] == LEETCODE["test"] and ex.fields["entry_point"] == "Solution().twoSum"
    assert ex.fields["import_prompt"] == LEETCODE["prompt"]
    assert ex.fields["completion"] == LEETCODE["response"] and ex.fields["solution"] == LEETCODE["completion"]
    assert ex.fields["task_id"] == "two-sum" and "query" not in ex.fields and "response" not in ex.fields
    _round_trips(exs, tmp_path, "leetcode")
    # the repository's own jsonl files keep query/response inside `meta`
    nested = {k: v for k, v in LEETCODE.items() if k not in ("query", "response")}
    nested["meta"] = {"question_id": 1, "query": LEETCODE["query"], "response": LEETCODE["response"]}
    (ex2,) = load_examples(_jsonl(tmp_path / "lc2.jsonl", [nested]), default_teacher_id="code")
    assert (ex2.prompt, ex2.fields["completion"], ex2.fields["test"]) == (ex.prompt, ex.fields["completion"],
                                                                         ex.fields["test"])
    bad = dict(LEETCODE, test="assert twoSum([3,3], 6) == [0, 1]")
    _one_line(lambda: load_examples(_jsonl(tmp_path / "bad.jsonl", [bad]), default_teacher_id="code"), "row 0",
              "def check(candidate)")


# ---- GSM8K / AIME ----------------------------------------------------------------------------------------

GSM8K = [
    {"question": "Natalia sold clips to 48 friends in April and half as many in May. How many altogether?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 48+24 = <<48+24=72>>72.\n#### 72"},
    {"question": "A city has 1,000 houses and builds 72 more. How many now?",
     "answer": "1000 + 72 = <<1000+72=1072>>1072\n#### 1,072"},
]


def test_gsm8k_parquet_and_jsonl(tmp_path):
    want = [Example(r["question"], "math", a, {"solution": r["answer"]}) for r, a in zip(GSM8K, ("72", "1072"))]
    for path in (_parquet(tmp_path / "g.parquet", GSM8K), _jsonl(tmp_path / "g.jsonl", GSM8K)):
        exs, info = inspect_source(path, default_teacher_id="math")
        assert info.schema == "gsm8k" and exs == want
    _round_trips(want, tmp_path, "gsm8k")
    bad = GSM8K + [{"question": "q", "answer": "no final line"}]
    _one_line(lambda: load_examples(_jsonl(tmp_path / "bad.jsonl", bad), column_map={"schema": "gsm8k"},
                                    default_teacher_id="math"), "row 2", "'#### <final answer>'")


def test_aime_style_files(tmp_path):
    rows = [{"id": 60, "problem": "Find the number of ...", "solution": "...", "answer": 204, "url": "u", "year": 2024},
            {"id": 61, "problem": "Let x be ...", "solution": "...", "answer": 33, "url": "u", "year": 2024}]
    for path in (_parquet(tmp_path / "a24.parquet", rows), _jsonl(tmp_path / "a24.jsonl", rows)):
        exs, info = inspect_source(path, default_teacher_id="math")
        assert info.schema == "aime" and [e.answer for e in exs] == ["204", "33"]
        assert exs[0] == Example("Find the number of ...", "math", "204",
                                 {"id": 60, "solution": "...", "url": "u", "year": 2024})
    _round_trips(exs, tmp_path, "aime")
    q = [{"question": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}"},
         {"question": "3.0 as an integer?", "answer": 3.0}]
    exs, info = inspect_source(_jsonl(tmp_path / "a25.jsonl", q), default_teacher_id="math")
    assert info.schema == "aime" and [e.answer for e in exs] == ["\\frac{3}{4}", "3"]
    assert exs[0].prompt == q[0]["question"]


# ---- the column map --------------------------------------------------------------------------------------

def test_column_map_dotted_paths_fields_and_answer_coercion(tmp_path):
    rows = [{"q": {"text": "Half of one?"}, "sol": {"final": 0.5}, "meta": json.dumps({"level": 3}),
             "golds": ["1/2", "0.5"], "io": {"inputs": ["1\n"], "outputs": ["1\n"]}, "tid": "math"}]
    path = _jsonl(tmp_path / "custom.jsonl", rows)
    params = {"prompt_field": "q.text", "answer_field": "sol.final", "teacher_id_field": "tid",
              "fields": {"level": "meta.level", "tests": "io"}}
    exs, info = inspect_source(path, column_map=params)
    assert info.how == "fallback" and info.schema == "flat"
    assert exs == [Example("Half of one?", "math", "0.5",
                           {"level": 3, "tests": [{"input": "1\n", "output": "1\n", "testtype": "stdin"}],
                            "golds": ["1/2", "0.5"]})]
    assert dict(info.mapping)["prompt"] == "q.text (params.prompt_field)"
    joined = load_examples(path, column_map={**params, "answer_field": "golds", "answer_join": " | "})
    assert joined[0].answer == "1/2 | 0.5"
    _one_line(lambda: load_examples(path, column_map={**params, "answer_field": "golds"}), "row 0",
              "list of 2 item(s)", "params.answer_join")
    assert load_examples(path, column_map={**params, "answer_field": None})[0].answer is None
    _one_line(lambda: load_examples(path, column_map={**params, "answer_field": "sol.exact"}), "row 0",
              "'sol.exact' not found", "'sol' has keys: final")
    _one_line(lambda: load_examples(path, column_map={"schema": "csv"}), "params.schema 'csv'", "verl, ifeval")
    _one_line(lambda: ColumnMap.from_params({"fields": {"answer": "x"}}), "'answer' cannot be a field name")
    assert [coerce_answer(v) for v in (7, 7.0, -0.25, 1e20, "x", None)] == ["7", "7", "-0.25",
                                                                           "100000000000000000000", "x", None]
    _one_line(lambda: coerce_answer(True), "boolean")
    _one_line(lambda: coerce_answer(float("nan")), "finite")
    _one_line(lambda: coerce_answer({"a": 1}), "object (keys: a)")


def test_flat_answers_stay_strict_unless_mapped(tmp_path):
    path = _jsonl(tmp_path / "f.jsonl", [{"prompt": "1+1=", "teacher_id": "math", "answer": 2}])
    _one_line(lambda: load_examples(path), "row 0", "answer must be a string", "params.answer_field")
    assert load_examples(path, column_map={"answer_field": "answer"})[0].answer == "2"


def test_schema_detection_and_unknown_or_missing_columns_are_one_line(tmp_path):
    assert detect_schema(["prompt", "teacher_id", "answer"]) == "flat"
    assert detect_schema(["data_source", "prompt", "ability", "reward_model", "extra_info"]) == "verl"
    assert detect_schema(["question", "answer"], {"answer": "x\n#### 4"}) == "gsm8k"
    assert detect_schema(["question", "answer"], {"answer": "4"}) == "aime"
    assert detect_schema(["text", "label"]) is None
    unknown = _parquet(tmp_path / "u.parquet", [{"text": "hi", "label": 1}])
    _one_line(lambda: build_domain("math", str(unknown)), "no column 'prompt'", "no known schema matches",
              "columns present: text, label", "params.schema", "params.prompt_field")
    no_kwargs = _parquet(tmp_path / "ik.parquet", [{k: v for k, v in IFEVAL[1].items() if k != "kwargs"}])
    _one_line(lambda: build_domain("if", str(no_kwargs), {"schema": "ifeval"}), "no column 'kwargs'",
              "schema ifeval", "columns present: key, prompt, instruction_id_list")
    rows = _lcb_rows()
    del rows[1]["public_test_cases"]
    _one_line(lambda: load_examples(_jsonl(tmp_path / "l.jsonl", rows), column_map={"schema": "livecodebench"},
                                    default_teacher_id="code"), "row 1 has no column 'public_test_cases'",
              "schema livecodebench", "columns present: question_title")
    _one_line(lambda: build_domain("math", str(unknown), {"prompt_fild": "text"}), "unknown params ['prompt_fild']",
              "prompt_field")
    _one_line(lambda: load_examples(unknown, column_map={"prompt_field": "body"}, default_teacher_id="x"),
              "no column 'body'", "fix params.prompt_field")


def test_normalize_tests_forms():
    assert normalize_tests(["assert f(1) == 2", {"input": "1", "output": "2"}]) == (
        ["assert f(1) == 2", {"input": "1", "output": "2", "testtype": "stdin"}], None)
    assert normalize_tests({"inputs": [["ab"]], "outputs": [[["a", "b"]]], "fn_name": "split"}) == (
        [{"input": '"ab"', "output": '["a", "b"]', "testtype": "functional"}], "split")
    with pytest.raises(DomainError, match="no function name"):
        normalize_tests([{"input": "1", "output": "1", "testtype": "functional"}])
    with pytest.raises(DomainError, match="holds no test cases"):
        normalize_tests("[]")


# ---- over-long prompts -----------------------------------------------------------------------------------

def test_filter_long_prompts_counts_and_logs_once(caplog):
    exs = [Example(" ".join(["w"] * n), "math", "1") for n in (3, 9, 4, 12, 5)]
    words = lambda e: len(prompt_text(e).split())  # noqa: E731
    with caplog.at_level(logging.INFO, logger="mopd"):
        kept, dropped = filter_long_prompts(exs, 5, words, source="data/math.parquet")
    assert kept == [exs[0], exs[2], exs[4]] and dropped == 2
    recs = [r for r in caplog.records if r.name == "mopd"]
    assert len(recs) == 1 and recs[0].levelno == logging.WARNING
    assert "data/math.parquet" in recs[0].getMessage() and "dropped 2 of 5" in recs[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mopd"):
        assert filter_long_prompts(exs, 12, words) == (exs, 0)
    assert not [r for r in caplog.records if r.name == "mopd"]
    _one_line(lambda: filter_long_prompts(exs, 2, words, source="s.jsonl"), "every prompt of s.jsonl (5)",
              "shortest has 3", "data.max_prompt_tokens")
    _one_line(lambda: filter_long_prompts(exs, 0, words), "max_tokens must be an int >= 1")
    chat = [Example(MSGS, "math"), Example([{"role": "user", "content": "w " * 50}], "math")]
    assert filter_long_prompts(chat, 10, words) == ([chat[0]], 1)


# ---- mopd data check -------------------------------------------------------------------------------------

def test_data_check_prints_schema_mapping_counts_and_first_row(tmp_path, capsys):
    rows = [dict(_verl_row(0, "What is 6*7?", "42"), teacher_id=None), dict(_verl_row(1, "b", "1"), teacher_id=None),
            dict(_verl_row(2, "c", "2"), teacher_id="x")]  # a null teacher_id: the domain's name
    path = _parquet(tmp_path / "math.parquet", rows)
    assert cli.main(["data", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "schema:  verl (recognised from the columns)" in out
    assert "reward_model.ground_truth" in out and "the domain name 'math'" in out
    assert "  math: 2\n" in out and "  x: 1\n" in out and "rows:    3" in out
    assert '"content": "What is 6*7?"' in out and "[user] What is 6*7?" in out and '"answer": "42"' in out
    assert "rendered:" in out
    assert cli.main(["data", "check", str(path), "--name", "arith", "--set", "answer_field=extra_info.index",
                     "--schema", "verl"]) == 0
    out = capsys.readouterr().out
    assert "schema:  verl (given)" in out and "  arith: 2\n" in out and '"answer": "0"' in out
    # rendered as a preset feeds it: the tiny chat tokenizer's template around the user turn
    assert cli.main(["data", "check", str(path), "--config", "tiny", "--config-set", "model.tiny.chat=true",
                     "--config-set", "data.chat.enabled=true", "--config-set", "data.chat.user_suffix=' Box it.'"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("rendered: "))
    assert "<|im_start|>user" in line and "What is 6*7? Box it." in line and "<|im_start|>assistant" in line, line
    assert "tokens; data.max_prompt_tokens=16, over it)" in line, line
    assert cli.main(["data", "check", str(path), "--config", "tiny"]) == 2  # messages need the chat template
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "data.chat.enabled=true" in err, err


def test_data_check_bad_input_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MOPD_TRACEBACK", raising=False)
    unknown = _jsonl(tmp_path / "u.jsonl", [{"text": "hi"}])
    for argv, needle in ((["data", "check", str(tmp_path / "nope.jsonl")], "dataset not found"),
                         (["data", "check", str(unknown)], "no column 'prompt'"),
                         (["data", "check", str(unknown), "--set", "promt_field=text"], "--set promt_field"),
                         (["data", "check", str(unknown), "--schema", "csv"], "params.schema 'csv'")):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err


# ---- real-mini (written by the verifier work in data/real_mini) ------------------------------------------

REAL_MINI = {"math": "verl", "code_lcb": "livecodebench", "code_leetcode": "leetcode", "ifeval": "ifeval"}


def _real_mini(name: str) -> Path | None:
    for d in (ROOT / "data" / "real_mini", Path("/tmp/wtA/data/real_mini")):
        if (d / f"{name}.jsonl").exists():
            return d / f"{name}.jsonl"
    return None


@pytest.mark.parametrize("name", sorted(REAL_MINI))
def test_real_mini_files_load_in_their_hub_schema(name, tmp_path):
    path = _real_mini(name)
    if path is None:
        pytest.skip(f"data/real_mini/{name}.jsonl is not written yet (data/real_mini/build.py writes it)")
    exs, info = inspect_source(path, default_teacher_id=name)
    assert (info.schema, info.how) == (REAL_MINI[name], "recognised"), info
    assert exs and all(e.teacher_id for e in exs)
    if name.startswith("code"):
        assert all("tests" in e.fields or "test" in e.fields for e in exs)
    _round_trips(exs, tmp_path, name)


def test_a_file_of_one_domain_may_leave_teacher_id_out_a_shared_one_may_not(tmp_path):
    """`recipe.build_domains`: rows without teacher_id are the domain's own when only that domain reads the file;
    a file two domains read must name each row's teacher_id (one line saying so), or both would get every row."""
    from mopd_core import recipe as R
    from mopd_core.config import load_config
    from tests.conftest import tiny_overrides

    src = tmp_path / "m.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(12)))
    one = load_config("tiny", tiny_overrides(tmp_path / "a") + [
        f"data.domains=[{{name: math, source: '{src}', eval_size: 2}}, "
        "{name: code, source: 'synthetic:code', eval_size: 2}]", "sft.mix=null", "mopd.mix=null"])
    doms = R.build_domains(one)
    assert {e.teacher_id for e in doms["math"].eval_examples()} == {"math"}
    two = load_config("tiny", tiny_overrides(tmp_path / "b") + [
        f"data.domains=[{{name: math, source: '{src}'}}, {{name: code, source: '{src}'}}]",
        "sft.mix=null", "mopd.mix=null"])
    with pytest.raises(DomainError) as e:
        R.build_domains(two)
    msg = str(e.value)
    assert "\n" not in msg and "teacher_id" in msg and "math, code share this file" in msg, msg


def test_a_shared_file_is_read_once_for_the_check_and_every_domain(tmp_path):
    """`recipe.build_domains` over one file of two domains: the teacher-id check and both domains take the same
    loader entry (`domains.dataset.domain_examples`), so the file is parsed once, not once per reader."""
    from mopd_core import recipe as R
    from mopd_core.config import load_config
    from mopd_core.domains import dataset as D
    from tests.conftest import tiny_overrides

    src = tmp_path / "both.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"{i}+1=", "teacher_id": t, "answer": str(i + 1)}) + "\n"
                           for i in range(12) for t in ("math", "code")))
    cfg = load_config("tiny", tiny_overrides(tmp_path) + [
        f"data.domains=[{{name: math, source: '{src}', eval_size: 2}}, {{name: code, source: '{src}', eval_size: 2}}]",
        "sft.mix=null", "mopd.mix=null"])
    D._cached.cache_clear()
    doms = R.build_domains(cfg)
    assert D._cached.cache_info().misses == 1
    assert {e.teacher_id for e in doms["code"].eval_examples()} == {"code"}
