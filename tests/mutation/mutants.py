"""The planted wiring bugs of the mutation check (`tests/mutation/run.py`). Each is one textual replacement that
must match today's code exactly once (`tests/unit/test_mutants.py` checks it, so a refactor that moves the code
fails fast and names the mutant to update), and stands for a real bug a loop/objective/routing change could make.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    old: str
    new: str
    bug: str
    tests: list[str] = field(default_factory=list)  # empty = FAST_SUBSET


# The fast subset every mutant runs against (≈1–2 min on 2 cores): the learning tests, the stage behaviour tests
# (resume equals uninterrupted, routing), the objective's float64 references and the evaluation protocol.
FAST_SUBSET = [
    "tests/integration/test_learning.py",
    "tests/unit/test_algorithms.py",
    "tests/unit/test_objectives.py",
    "tests/unit/test_eval_protocol.py",
    "tests/integration/test_stages.py",
]

MUTANTS: list[Mutant] = [
    Mutant("rkl_adv_swapped", "mopd_core/algorithms/advantages.py",
           "diff = teacher_logp.detach() - behaviour_logp.detach()",
           "diff = behaviour_logp.detach() - teacher_logp.detach()",
           "student and teacher log-probs swapped where the distillation advantage is formed (a sign flip of A^D)"),
    Mutant("grpo_no_baseline", "mopd_core/algorithms/advantages.py",
           "centred = g - g.mean(dim=1, keepdim=True)",
           "centred = g - 0 * g.mean(dim=1, keepdim=True)",
           "the group baseline dropped from the GRPO advantage (raw rewards)"),
    Mutant("combine_ignores_w_kd", "mopd_core/algorithms/advantages.py",
           "d = w_kd * kd_advantages.detach()",
           "d = kd_advantages.detach()",
           "combine_advantages ignores w_kd"),
    Mutant("ppo_ratio_inverted", "mopd_core/algorithms/loss.py",
           "log_ratio = torch.where(bmask, logp - anchor.detach().to(logp.dtype), zero)",
           "log_ratio = torch.where(bmask, anchor.detach().to(logp.dtype) - logp, zero)",
           "the PPO ratio inverted (π_old/π_θ): the gradient of every token points the wrong way"),
    Mutant("ppo_min_to_max", "mopd_core/algorithms/loss.py",
           "per_token = -torch.minimum(unclipped, clipped)",
           "per_token = -torch.maximum(unclipped, clipped)",
           "the pessimistic min of PPO-clip replaced by max (the trust region no longer binds)"),
    Mutant("loss_mask_ignored", "mopd_core/algorithms/loss.py",
           "n_tokens = bmask.sum()",
           "n_tokens = bmask.numel() + 0 * bmask.sum()",
           "the token mean divides by every position, padding included (the loss scale depends on padding)"),
    Mutant("logp_position_shift", "mopd_core/rollout/__init__.py",
           "hidden = last_hidden_state(model, ids, am, position_ids(am))[:, -T - 1:-1][mask]",
           "hidden = last_hidden_state(model, ids, am, position_ids(am))[:, -T:][mask]",
           "completion log-probs read one position late (the mask/logit alignment shifted by one)"),
    Mutant("sampler_logp_of_other_token", "mopd_core/rollout/__init__.py",
           "lp = logp.gather(-1, tok[:, None]).squeeze(-1)",
           "lp = logp.gather(-1, tok.roll(1, 0)[:, None]).squeeze(-1)",
           "the behaviour log-prob recorded for another row's token (sampler and batch disagree)"),
    Mutant("routing_wrong_teacher", "mopd_core/teachers/__init__.py",
           "index = torch.tensor([self.names.index(t) for t in tids], device=dev)",
           "index = torch.tensor([(self.names.index(t) + 1) % len(self.names) for t in tids], device=dev)",
           "each sample scored by the next domain's teacher (domain routing off by one)"),
    Mutant("eval_seed_ignored", "mopd_core/evaluation.py",
           "gen = torch.Generator(device=device).manual_seed(_seed_of(seed, b.domain, spec.name))",
           "gen = torch.Generator(device=device)",
           "benchmark sampling no longer seeded by (seed, domain, benchmark): evaluation stops being reproducible"),
    Mutant("kd_clip_ignored", "mopd_core/algorithms/advantages.py",
           "diff = diff.clamp(min=-clip, max=clip)",
           "diff = diff.clamp(min=-1e9, max=1e9)",
           "mopd.kd_clip not applied to the distillation advantage (one wild teacher token dominates a batch)"),
    Mutant("sampler_temperature_ignored", "mopd_core/rollout/__init__.py",
           "lg = logits.float() / temperature",
           "lg = logits.float()",
           "the sampler ignores rollout.temperature, so the behaviour log-probs are of another distribution than "
           "the trainer's", ["tests/unit/test_models_rollout.py", "tests/unit/test_rollout_engines.py"]),
]
