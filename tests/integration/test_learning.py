"""Training learns: short RL and distillation runs whose outcome a broken wiring cannot reach.

The other stage tests check keys, finiteness and exact repeats; these check *direction and size*. The judge is
independent of the training loop: held-out prompts (the domain's eval set, never trained on), completions
sampled by transformers' own `generate` from the saved checkpoint, the domain's verifier, and the exact
full-vocabulary reverse KL of student to teacher computed here in float64 — so a sign flip, swapped arguments
where the advantage is formed, a mask shifted by one, an ignored `w_kd` or stale weights in the sampler all end
below the bars (the mutation check, `tests/mutation/`, plants such bugs and expects these tests to fail).

Sizes: the 64-wide integration model, the test-only `short` domain (reward 1 when the completion has at most two
characters: the SFT model gets it about a fifth of the time at T=1, so the signal is dense enough for 12 steps).
The bars below sit well inside what a correct wiring reaches on seed 0 and well outside what the planted bugs of
`tests/mutation/` reach (`benchmarks/results/mutants.md` names which test kills each).
"""

from __future__ import annotations

import pytest
import torch

from mopd_core import recipe as R
from mopd_core.models import load_model, load_tokenizer
from mopd_core.models.chat import PromptFormatter
from tests.conftest import perturbed_teachers, short_cfg

STEPS, LR, PROMPTS, GROUP = 12, 3e-3, 8, 8
N_EVAL, K = 32, 4  # held-out prompts × samples each


def _train_cfg(cfg):
    c = cfg.model_copy(deep=True)
    for s in (c.expert, c.mopd):
        s.steps, s.lr, s.prompts_per_step, s.group_size = STEPS, LR, PROMPTS, GROUP
        # the bars were set for these 12 steps at a constant rate; the preset's MOPD cosine decay is for its 300
        s.min_lr_ratio, s.lr_schedule = 0.0, "constant"  # in this order: each assignment is validated
    return c


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """SFT (6 steps) → RL expert on `short` → a distilled student (reward term off), shared by the tests."""
    tmp = tmp_path_factory.mktemp("learn")
    cfg = short_cfg(tmp)
    R.setup_runtime(cfg)
    torch.set_num_threads(1)
    sft = R.sft_stage(cfg, R.base_model(cfg), progress=False)
    expert = R.expert_stage(_train_cfg(cfg), "short", sft.model_dir, progress=False)
    teachers = perturbed_teachers(cfg, sft.model_dir, tmp)
    teachers["short"] = expert.model_dir
    mc = _train_cfg(cfg)
    mc.mopd.w_rl, mc.mopd.w_kd, mc.mopd.mix = 0.0, 1.0, {"short": 1.0}
    # the seeds' sampled-token objective (the planted bugs of tests/mutation/ sit on its path) and the default,
    # the dense top-K reverse KL
    students = {}
    for kd_loss in ("sampled_rkl", "topk_rkl"):
        mc.mopd.kd_loss = kd_loss
        students[kd_loss] = R.mopd_stage(mc, sft.model_dir, teachers, progress=False,
                                         stage_name=f"student-{kd_loss}").model_dir
    return cfg, sft.model_dir, expert.model_dir, students


def _held_out(cfg):
    dom = R.build_domains(cfg, ["short"])["short"]
    return dom, dom.eval_examples()[:N_EVAL]


@torch.no_grad()
def _judge(cfg, model_dir, teacher_dir=None, seed=1234):
    """(mean sampled reward, mean exact reverse KL to `teacher_dir` per completion token) on held-out prompts,
    K samples each at T=1 by `transformers.generate`, everything in float64."""
    dom, examples = _held_out(cfg)
    tok = load_tokenizer(model_dir)
    fmt = PromptFormatter(tok, cfg.data.chat)
    model = load_model(model_dir).double().eval()
    teacher = load_model(teacher_dir).double().eval() if teacher_dir else None
    stop = fmt.stop_ids(model.generation_config, tok)
    torch.manual_seed(seed)
    rewards, kl_sum, kl_tokens = [], 0.0, 0
    for ex in examples:
        ids = torch.tensor([fmt.ids(ex)])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_p=1.0,
                             top_k=0, max_new_tokens=cfg.rollout.max_new_tokens, num_return_sequences=K,
                             eos_token_id=stop, pad_token_id=stop[0])
        for row in out:
            comp = row[ids.shape[1]:].tolist()
            n = next((i + 1 for i, t in enumerate(comp) if t in stop), len(comp))  # tokens up to and with EOS
            text = tok.decode([t for t in comp[:n] if t not in stop], skip_special_tokens=True)
            rewards.append(dom.reward(ex, text))
            if teacher is not None:
                seq = row[: ids.shape[1] + n].unsqueeze(0)
                ls = torch.log_softmax(model(input_ids=seq).logits[0, ids.shape[1] - 1: -1], -1)
                lt = torch.log_softmax(teacher(input_ids=seq).logits[0, ids.shape[1] - 1: -1], -1)
                kl_sum += float((ls.exp() * (ls - lt)).sum())
                kl_tokens += n
    return sum(rewards) / len(rewards), (kl_sum / kl_tokens if teacher is not None else None)


def test_expert_rl_raises_the_held_out_reward(runs):
    cfg, sft, expert, _ = runs
    before, _ = _judge(cfg, sft)
    after, _ = _judge(cfg, expert)
    assert before < 0.35, before  # the premise: the SFT model rarely stops within two characters
    assert after >= 0.6 and after - before >= 0.3, (before, after)


@pytest.mark.parametrize("kd_loss", ["sampled_rkl", "topk_rkl"])
def test_distillation_closes_the_teacher_gap(runs, kd_loss):
    """`w_rl=0`: only the teacher's signal trains the student, so a reward rise is the distillation's own."""
    cfg, sft, expert, students = runs
    student = students[kd_loss]
    r_sft, kl_sft = _judge(cfg, sft, expert)
    r_student, kl_student = _judge(cfg, student, expert)
    r_teacher, _ = _judge(cfg, expert)
    assert kl_sft > 0.3, kl_sft  # the premise: a real gap to close
    assert kl_student <= 0.35 * kl_sft, (kl_sft, kl_student)
    # the student recovers most of the teacher's reward headroom on prompts it never trained on
    assert r_student - r_sft >= 0.6 * (r_teacher - r_sft) and r_teacher - r_sft >= 0.3, (r_sft, r_student, r_teacher)
