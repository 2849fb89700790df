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


def test_greedy_accuracy_scores_the_argmax_completion(tmp_path):
    """The greedy row is the argmax decode: a domain whose reward is 1 exactly for the completion transformers'
    own greedy `generate` gives (computed here, independently of our engine) must score 1.0 — a sampled
    completion of an untrained model almost never matches it."""
    import torch

    from mopd_core.models.chat import PromptFormatter

    path = build_tiny(ModelConfig(tiny={"hidden_size": 64, "num_layers": 1, "num_heads": 2,
                                        "intermediate_size": 64}), tmp_path / "m")
    model, tok = load_model(path).eval(), load_tokenizer(path)
    fmt = PromptFormatter(tok)
    stop = fmt.stop_ids(model.generation_config, tok)
    want: dict[str, str] = {}

    class _Argmax(MathDomain):
        kind = "argmax"

        def reward(self, example: Example, completion: str) -> float:
            return float(completion == want[example.prompt])

    dom = _Argmax(name="m", eval_size=12)
    with torch.no_grad():
        for e in dom.eval_examples():
            ids = torch.tensor([fmt.ids(e)])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                                 eos_token_id=stop, pad_token_id=stop[0])[0, ids.shape[1]:].tolist()
            n = next((i for i, t in enumerate(out) if t in stop), len(out))
            want[e.prompt] = tok.decode(out[:n], skip_special_tokens=True)
    res = evaluate_model(model, tok, {"m": dom}, EvalConfig(batch_size=16), "cpu", 6)
    assert res["m"]["greedy"] == 1.0
