"""Why the sampled-token reverse KL learns less per sample than TRL's full-vocabulary one: `benchmarks/kd_noise.py`.

At one student (the tiny recipe's SFT model, the start of every `vs_trl` run) and the math expert as teacher, it
draws `--seeds` independent batches exactly as a step of the MOPD stage does (32 prompts × 8 samples at the
rollout temperature) and takes, on each batch, the gradient of every objective below *at the same samples*:

- `sampled_rkl`: ours before this change — `A_t = clip(ℓᵀ(y_t) − ℓ^old(y_t), ±kd_clip)` on the sampled token,
  PPO-clip (`algorithms.policy_loss`), token mean;
- `sampled_rkl_noclip`: the same without `kd_clip` (is the clip cutting the signal?);
- `sampled_rkl_baseline`: the same minus the per-position baseline `E_{v~π}[ℓᵀ(v) − ℓ(v)] = −KL_t(π‖T)`
  (a control variate: still unbiased, is the noise the missing baseline?);
- `topk_rkl`: Open-MOPD's dense top-K reverse KL (`kd_top_k` of the student's candidates, `algorithms.
  topk_rkl_advantages` + `dense_policy_loss`);
- `exact_rkl`: the per-position reverse KL over the whole vocabulary, `Σ_v π(v)(ℓ(v) − ℓᵀ(v))` — TRL
  `DistillationTrainer` β = 1 and our `full_jsd` β = 1;
- `jsd_0.5`: the generalised JSD β = 0.5 over the whole vocabulary (TRL β = 0.5).

On policy (one minibatch) the per-position expectation of the sampled-token gradient is the exact reverse-KL
gradient at the same prefixes (`E_{y~π}[(ℓᵀ(y) − ℓ(y))∇ℓ(y)] = −∇KL_t(π‖T)`), so the two differ only in noise:
the sampled one carries the variance of one token drawn per position on top of the prefixes' own. Per objective
over the seeds: the gradient norm (the update clips at `mopd.grad_clip`), the noise-to-signal ratio
`E‖g − ḡ‖² / ‖ḡ‖²` (its own mean ḡ), the cosine of one batch's gradient with the expected exact gradient
(ḡ of `exact_rkl` over all seeds; the others' seeds are left out of it only by being other objectives), the
cosine of the objective's mean with that reference (bias), and the share of tokens where `kd_clip` and the PPO
clip bind.

    .venv/bin/python benchmarks/kd_noise.py --build-json runs/bench-peers/build.json --seeds 16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

OBJECTIVES = ("sampled_rkl", "sampled_rkl_noclip", "sampled_rkl_baseline", "topk_rkl", "exact_rkl", "jsd_0.5")


def _logits(model, batch, temperature: float):
    """`[B, T, V]` logits of the completion positions at `temperature` (position P−1+t predicts token t)."""
    from mopd_core.rollout import position_ids

    ids, am = batch.input_ids(), batch.attention_mask()
    T = batch.completion_ids.shape[1]
    out = model(input_ids=ids, attention_mask=am, position_ids=position_ids(am)).logits
    return out[:, -T - 1:-1].float() / temperature


def objective_loss(name: str, s_logits, t_logp, batch, kd_clip: float, top_k: int):
    """The loss of objective `name` on one batch (student logits with gradient, the teacher's log-probs fixed);
    returns `(loss, stats)`."""
    import torch

    from mopd_core import algorithms as alg

    mask = batch.completion_mask.float()
    bm = mask.bool()
    logp_all = torch.log_softmax(s_logits, -1)
    y = batch.completion_ids.long().unsqueeze(-1)
    logp = logp_all.gather(-1, y)[..., 0]
    t_y = t_logp.gather(-1, y)[..., 0]
    old = batch.behaviour_logp.float()
    stats = {}
    if name.startswith("sampled_rkl"):
        clip = None if name == "sampled_rkl_noclip" else kd_clip
        adv = alg.reverse_kl_advantages(t_y, old, mask, clip=clip)
        raw = (t_y - old)[bm]
        stats["kd_clip_frac"] = float((raw.abs() > kd_clip).float().mean())
        if name == "sampled_rkl_baseline":
            with torch.no_grad():
                p = logp_all.detach().exp()
                base = (p * (t_logp - logp_all.detach())).sum(-1)  # E_π[ℓᵀ − ℓ] = −KL_t(π‖T)
            adv = torch.where(bm, adv - base, torch.zeros_like(adv))
        loss, met = alg.policy_loss(logp, old, adv, mask)
        stats.update(ppo_clip_frac=met["clip_frac"], ratio_max=met["ratio_max"])
        return loss, stats
    if name == "topk_rkl":
        with torch.no_grad():
            cand = logp_all.detach().topk(top_k, -1).indices
            slot_ids, kd_valid, rl_slot = alg.candidate_slots(cand, batch.completion_ids)
            old_s = logp_all.detach().gather(-1, slot_ids)
            adv = alg.topk_rkl_advantages(old_s, t_logp.gather(-1, slot_ids), kd_valid, mask, clip=kd_clip)
        loss, met = alg.dense_policy_loss(logp_all.gather(-1, slot_ids), old_s, adv, kd_valid | rl_slot, mask)
        stats.update(ppo_clip_frac=met["clip_frac"])
        return loss, stats
    beta = 1.0 if name == "exact_rkl" else 0.5
    p = logp_all.exp()
    if beta == 1.0:
        per = (p * (logp_all - t_logp)).sum(-1)
    else:  # TRL GKD's JSD_β with M = β T + (1 − β) S
        log_m = torch.logsumexp(torch.stack([t_logp + torch.log(torch.tensor(beta)),
                                             logp_all + torch.log(torch.tensor(1 - beta))]), 0)
        per = beta * (t_logp.exp() * (t_logp - log_m)).sum(-1) + (1 - beta) * (p * (logp_all - log_m)).sum(-1)
    return torch.where(bm, per, torch.zeros_like(per)).sum() / mask.sum().clamp(min=1), stats


def measure(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from mopd_core import recipe as R
    from mopd_core.config import load_config
    from mopd_core.models import load_tokenizer
    from mopd_core.rollout import HFRollout
    from mopd_core.train.loop import sample_prompts

    b = json.loads(args.build_json.read_text())
    cfg = load_config("tiny", [f"output_dir={args.build_json.parent}", "name=build", "seed=0", "runtime.device=cpu",
                               f"runtime.num_threads={args.threads}"])
    R.setup_runtime(cfg)
    torch.set_num_threads(args.threads)
    domains = R.build_domains(cfg, ["math"])
    tok = load_tokenizer(b["sft"])
    student = AutoModelForCausalLM.from_pretrained(b["sft"], dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(b["experts"]["math"], dtype=torch.float32).eval()
    params = [p for p in student.parameters() if p.requires_grad]
    engine = HFRollout(student, tok, torch.device("cpu"), cfg.data.max_prompt_tokens)
    temp, mo = cfg.rollout.temperature, cfg.mopd
    opt = torch.optim.AdamW(params, lr=mo.lr, betas=mo.betas, weight_decay=mo.weight_decay)

    def batch_of(tag: str, seed: int):
        rng = random.Random(f"kd_noise/{tag}/{seed}")
        ex = sample_prompts(domains, [1.0], mo.prompts_per_step, rng)
        ex = [e for e in ex for _ in range(mo.group_size)]
        gen = torch.Generator().manual_seed(seed)
        batch = engine.generate(ex, max_new_tokens=cfg.rollout.max_new_tokens, temperature=temp, generator=gen)
        with torch.no_grad():
            return batch, torch.log_softmax(_logits(teacher, batch, temp), -1)

    out, done, t0 = {}, 0, time.perf_counter()
    for at in args.at_steps:
        # the student moves on between the measurements as TRL's β = 1 run would: exact reverse KL, AdamW, the
        # recipe's lr and grad clip, fresh batches (their own seeds)
        for step in range(done, at):
            batch, t_logp = batch_of("train", step)
            student.train()
            opt.zero_grad(set_to_none=True)
            objective_loss("exact_rkl", _logits(student, batch, temp), t_logp, batch, mo.kd_clip,
                           mo.kd_top_k)[0].backward()
            torch.nn.utils.clip_grad_norm_(params, mo.grad_clip)
            opt.step()
        done = at
        grads = {n: [] for n in OBJECTIVES}
        stats = {n: [] for n in OBJECTIVES}
        for seed in range(args.seeds):
            batch, t_logp = batch_of(f"measure{at}", seed)
            student.train()
            for name in OBJECTIVES:
                student.zero_grad(set_to_none=True)
                loss, st = objective_loss(name, _logits(student, batch, temp), t_logp, batch, mo.kd_clip,
                                          mo.kd_top_k)
                loss.backward()
                grads[name].append(torch.cat([p.grad.reshape(-1) for p in params]).double())
                stats[name].append(st)
        out[at] = summarise(grads, stats, mo.grad_clip)
        print(f"step {at}: {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def summarise(grads, stats, grad_clip: float) -> dict:
    import torch

    ref = torch.stack(grads["exact_rkl"]).mean(0)
    out = {}
    for name, gs in grads.items():
        G = torch.stack(gs)
        mean = G.mean(0)
        noise = float(((G - mean) ** 2).sum(1).mean() * len(gs) / max(len(gs) - 1, 1))  # unbiased E‖g − ḡ‖²
        cos = torch.nn.functional.cosine_similarity(G, ref.unsqueeze(0), dim=1)
        norms = G.norm(dim=1)
        row = {"grad_norm": [float(norms.mean()), float(norms.std())],
               "noise_to_signal": noise / float(mean.norm() ** 2),
               "cos_to_expected_exact": [float(cos.mean()), float(cos.std())],
               "bias_cos": float(torch.nn.functional.cosine_similarity(mean, ref, dim=0)),
               "clipped_by_grad_clip": float((norms > grad_clip).float().mean())}
        for k in sorted({k for s in stats[name] for k in s}):
            row[k] = sum(s[k] for s in stats[name]) / len(stats[name])
        out[name] = row
    return out


def render(res: dict) -> str:
    m = res["machine"]
    at = list(res["objectives"])
    lines = [f"# Gradient noise of the distillation objectives at the same samples ({m['cpu']}, {m['threads']} torch "
             f"thread, load average {res['load'][0]:.1f}–{res['load'][1]:.1f})", "",
             f"`benchmarks/kd_noise.py` — the tiny recipe's SFT student (seed 0) and its math expert, "
             f"{res['seeds']} independent batches of {res['prompts']} prompts × {res['group']} samples (a MOPD step's "
             f"batch), every objective's gradient on each batch at the same samples, at the SFT student (step 0) and "
             f"after {', '.join(str(a) for a in at if int(a))} steps of exact reverse-KL training (AdamW, lr "
             f"{res['lr']:g}, grad clip {res['grad_clip']:g}); {res['wall_s']:.0f} s. "
             "Reference direction: the mean over all batches of the exact reverse-KL gradient (what TRL β = 1 "
             "follows). Noise-to-signal `E‖g − ḡ‖² / ‖ḡ‖²` (each objective's own mean ḡ): how many times the "
             "gradient's noise exceeds its signal in squared norm; an optimizer step of N such batches averages "
             "it down N-fold. `cos(E[g], E[g_exact])` compares two means of 16 batches each, so it carries their "
             "noise too (the sampled-token objective's expectation is the exact one wherever `kd_clip` does not "
             "bind).", "",
             "| step | objective | grad norm | noise-to-signal | cos(g, E[g_exact]) one batch | "
             "cos(E[g], E[g_exact]) | "
             "batches with norm > grad_clip | kd_clip binds (tokens) | PPO clip binds | max ratio |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for a in at:
        for name, r in res["objectives"][a].items():
            kc = f"{r['kd_clip_frac']:.1%}" if "kd_clip_frac" in r else "–"
            pc = f"{r['ppo_clip_frac']:.1%}" if "ppo_clip_frac" in r else "–"
            rm = f"{r['ratio_max']:.4f}" if "ratio_max" in r else "–"
            lines.append(f"| {a} | `{name}` | {r['grad_norm'][0]:.3f} ± {r['grad_norm'][1]:.3f} | "
                         f"{r['noise_to_signal']:.2f} | {r['cos_to_expected_exact'][0]:.3f} ± "
                         f"{r['cos_to_expected_exact'][1]:.3f} | {r['bias_cos']:.3f} | {r['clipped_by_grad_clip']:.0%} "
                         f"| {kc} | {pc} | {rm} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build-json", type=Path, required=True, help="vs_trl's build.json (SFT + math expert)")
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--at-steps", type=lambda v: [int(x) for x in v.split(",")], default=[0, 10, 20],
                    help="measure at these steps of an exact reverse-KL run from the SFT student")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kd_noise")
    ap.add_argument("--render-only", action="store_true", help="rewrite the .md from the .json")
    args = ap.parse_args(argv)
    if args.render_only:
        res = json.loads(args.out.with_suffix(".json").read_text())
        args.out.with_suffix(".md").write_text(render(res))
        return 0
    import torch

    from tiny_recipe import machine_info

    load0, t0 = os.getloadavg()[0], time.perf_counter()
    objectives = measure(args)
    from mopd_core.config import load_config

    mo = load_config("tiny", []).mopd
    res = {"machine": {"cpu": machine_info()["cpu_model"] or "unknown", "threads": args.threads,
                       "torch": torch.__version__}, "seeds": args.seeds, "prompts": mo.prompts_per_step,
           "group": mo.group_size, "objectives": objectives, "wall_s": time.perf_counter() - t0, "lr": mo.lr,
           "grad_clip": mo.grad_clip,
           "load": [load0, os.getloadavg()[0]]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    args.out.with_suffix(".md").write_text(render(res))
    print(render(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
