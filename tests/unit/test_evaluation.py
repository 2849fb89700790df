"""Evaluation: greedy and mean@k accuracy on held-out prompts, the table and the plot."""

from __future__ import annotations

import pytest

from mopd_core.config import EvalConfig, ModelConfig
from mopd_core.domains import Example, MathDomain
from mopd_core.evaluation import accuracy_table, evaluate_model, plot_accuracy
from mopd_core.models import build_tiny, load_model, load_tokenizer



class _Const(MathDomain):
    kind = "const"

    def reward(self, example: Example, completion: str) -> float:
        return 1.0 if example.prompt[0] in "13579" else 0.0  # depends only on the prompt


def test_greedy_and_mean_at_k_use_the_domain_reward(tmp_path):
    path = build_tiny(ModelConfig(tiny={"hidden_size": 64, "num_layers": 1, "num_heads": 2,
                                        "intermediate_size": 64}), tmp_path / "m")
    model, tok = load_model(path).eval(), load_tokenizer(path)
    dom = _Const(name="m", eval_size=40)
    expect = sum(e.prompt[0] in "13579" for e in dom.eval_examples()) / 40
    res = evaluate_model(model, tok, {"m": dom}, EvalConfig(mean_at_k=3, batch_size=16), "cpu", 4)
    assert res["m"]["greedy"] == pytest.approx(expect)
    assert res["m"]["mean@3"] == pytest.approx(expect)
    assert 0 < expect < 1


def test_table_and_plot(tmp_path):
    res = {"sft": {"math": {"greedy": 0.5}, "code": {"greedy": 0.25}},
           "student": {"math": {"greedy": 0.875}}}
    t = accuracy_table(res, "greedy", ["math", "code"])
    assert t.splitlines()[0] == "| model | math | code |"
    assert "| sft | 50.0 | 25.0 |" in t and "| student | 87.5 | – |" in t
    p = plot_accuracy(res, tmp_path / "a.png")
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
