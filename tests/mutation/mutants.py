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
    "tests/unit/test_roles.py",
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
    Mutant("eval_greedy_samples", "mopd_core/evaluation.py",
           "b = engine.generate(exs, max_new_tokens=max_new_tokens, greedy=True, batch_size=cfg.batch_size)",
           "b = engine.generate(exs, max_new_tokens=max_new_tokens, greedy=False, batch_size=cfg.batch_size)",
           "the held-out greedy accuracy is computed from samples at T=1 (the eval protocol's greedy row is not)",
           ["tests/unit/test_evaluation.py", "tests/unit/test_eval_protocol.py"]),
    Mutant("kd_clip_ignored", "mopd_core/algorithms/advantages.py",
           "diff = diff.clamp(min=-clip, max=clip)",
           "diff = diff.clamp(min=-1e9, max=1e9)",
           "mopd.kd_clip not applied to the distillation advantage (one wild teacher token dominates a batch)"),
    Mutant("sampler_temperature_ignored", "mopd_core/rollout/__init__.py",
           "lg = logits.float() / temperature",
           "lg = logits.float()",
           "the sampler ignores rollout.temperature, so the behaviour log-probs are of another distribution than "
           "the trainer's", ["tests/unit/test_models_rollout.py", "tests/unit/test_rollout_engines.py"]),
    Mutant("loop_adv_sign_flip", "mopd_core/train/roles/objective.py",
           "return adv + self.cfg.w_kd * a_kd, None",
           "return -(adv + self.cfg.w_kd * a_kd), None",
           "the sign of the step's whole advantage flipped where the objective role forms it (MOPD)"),
    Mutant("loop_rl_sign_flip", "mopd_core/train/roles/objective.py",
           "adv = adv + self.cfg.w_rl * a_rl[:, None] * mask",
           "adv = adv - self.cfg.w_rl * a_rl[:, None] * mask",
           "the reward advantage enters with the wrong sign (expert RL pushes away from rewarded samples)"),
    Mutant("loop_ignores_w_kd", "mopd_core/train/roles/objective.py",
           "return adv + self.cfg.w_kd * a_kd, None",
           "return adv + a_kd, None",
           "the objective role ignores mopd.w_kd (every distillation weight acts as 1)",
           ["tests/unit/test_roles.py"]),
    Mutant("resume_without_optimizer_state", "mopd_core/train/roles/updater.py",
           'self.opt.load_state_dict(st["optimizer"])',
           "self.opt.load_state_dict(self.opt.state_dict())",
           "a resumed stage starts from fresh AdamW moments (the checkpoint's optimizer state not restored)"),
    Mutant("lora_merged_copy_not_refreshed", "mopd_core/train/roles/weight_sync.py",
           "n = refresh_merged(self.merged, model)",
           "n = 0",
           "LoRA: the rollout engine keeps sampling from the stale merged copy (weights not handed to the sampler)",
           ["tests/integration/test_lora_stage.py"]),
]
