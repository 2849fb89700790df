"""The sparse-reward domain of configs/tiny_sparse.yaml: `caps` ("caps:qwxyz=" → "QWXYZ", exact match) — answers
recomputed here, the reward given only to a fully right answer, the weak demonstrator's per-letter slip at the
rate asked for (so a sample from a model that learned it is right ~(1 − r)^length of the time), one-line errors."""

from __future__ import annotations

import random
import re

import pytest

from mopd_core.config import load_config
from mopd_core.domains import DomainError, Example, build_domain


def test_answers_are_the_prompt_in_capitals_and_generation_is_deterministic():
    dom = build_domain("caps", "synthetic:caps", {"length": 6}, eval_size=50, seed=3)
    exs = dom.train_examples(300, random.Random(0)) + dom.eval_examples()
    for e in exs:
        m = re.fullmatch(r"caps:([a-z]{6})=", e.prompt)
        assert m and e.answer == m[1].upper() and e.teacher_id == "caps", e
    again = build_domain("caps", "synthetic:caps", {"length": 6}, eval_size=50, seed=3)
    other = build_domain("caps", "synthetic:caps", {"length": 6}, eval_size=50, seed=4)
    assert again.eval_examples() == dom.eval_examples() != other.eval_examples()
    assert not {e.prompt for e in dom.eval_examples()} & {e.prompt for e in dom.train_examples(2000, random.Random(1))}


def test_reward_only_for_the_whole_answer():
    dom = build_domain("caps", "synthetic:caps", eval_size=10, seed=0)
    ex = Example(prompt="caps:qwxyz=", teacher_id="caps", answer="QWXYZ")
    assert dom.reward(ex, "QWXYZ") == 1.0 and dom.reward(ex, " QWXYZ\n") == 1.0
    for wrong in ("QWXYz", "qWXYZ", "qwxyz", "QWXY", "QWXYZZ", "QWXYZ.", ""):
        assert dom.reward(ex, wrong) == 0.0, wrong


def test_weak_demonstrator_slips_each_letter_independently_at_its_rate():
    rate, length, n = 0.6, 5, 4000
    dom = build_domain("caps", "synthetic:caps", {"length": length, "weak_tasks": ["caps"], "weak_rate": rate},
                       eval_size=10, seed=0)
    exs = dom.train_examples(n, random.Random(0))
    demos = [e.fields.get("completion", e.answer) for e in exs]
    assert all(d.upper() == e.answer for d, e in zip(demos, exs))  # only the case slips, never a letter
    lower = sum(c.islower() for d in demos for c in d) / (n * length)
    assert abs(lower - rate) < 0.02, lower
    right = sum(dom.reward(e, d) for d, e in zip(demos, exs)) / n  # a fully right demonstration: (1 − r)^length
    assert abs(right - (1 - rate) ** length) < 0.006, right
    clean = build_domain("caps", "synthetic:caps", eval_size=10, seed=0)
    assert all("completion" not in e.fields for e in clean.train_examples(200, random.Random(0)))


@pytest.mark.parametrize("params,key", [({"length": 0}, "length"), ({"length": "5"}, "length"),
                                        ({"weak_rate": 1.5}, "weak_rate"), ({"weak_tasks": ["upper"]}, "weak_tasks"),
                                        ({"letters": 5}, "letters")])
def test_bad_params_fail_in_one_line_naming_the_field(params, key):
    with pytest.raises(DomainError) as e:
        build_domain("caps", "synthetic:caps", params, eval_size=10)
    msg = str(e.value)
    assert key in msg and "\n" not in msg, msg


def test_the_preset_loads_with_the_weak_demonstrator_on_and_fits_its_budgets():
    cfg = load_config("tiny_sparse")
    assert cfg.domain_names() == ["caps"] and cfg.model == load_config("tiny").model
    (spec,) = cfg.data.domains
    dom = build_domain(spec.name, spec.source, spec.params, eval_size=spec.eval_size, seed=cfg.seed)
    assert spec.params["weak_rate"] > 0.5  # SFT's greedy answer keeps a lowercase letter: headroom for RL
    exs = dom.train_examples(500, random.Random(0))
    assert max(len(e.answer) for e in exs) + 1 <= cfg.rollout.max_new_tokens  # EOS included
    assert max(len(e.prompt) for e in exs) <= cfg.data.max_prompt_tokens
