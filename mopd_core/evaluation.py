"""Held-out evaluation: per-domain accuracy (greedy, plus mean@k sampled), tables and plots."""

from __future__ import annotations

from typing import Mapping

import torch

from .config import EvalConfig
from .rollout import HFRollout


@torch.no_grad()
def evaluate_model(model, tokenizer, domains: Mapping[str, object], cfg: EvalConfig, device,
                   max_new_tokens: int, seed: int = 0, eval_size: int | None = None, *,
                   chat=None) -> dict[str, dict[str, float]]:
    """{domain: {"greedy": acc, "mean@k": acc}} on each domain's held-out prompts (never trained on). `chat`: the
    recipe's `data.chat` (or a `models.chat.PromptFormatter`) — prompts rendered and generation stopped exactly
    as in training rollouts; None = raw prompt strings."""
    engine = HFRollout(model, tokenizer, device, chat=chat)
    n = eval_size or cfg.eval_size
    out: dict[str, dict[str, float]] = {}
    gen = torch.Generator(device=device).manual_seed(seed + 7919)
    for name, dom in domains.items():
        exs = dom.eval_examples()[:n] if n else dom.eval_examples()
        res: dict[str, float] = {}
        if cfg.greedy:
            b = engine.generate(exs, max_new_tokens=max_new_tokens, greedy=True, batch_size=cfg.batch_size)
            res["greedy"] = sum(dom.rewards(exs, b.texts)) / len(exs)
        if cfg.mean_at_k:
            k = cfg.mean_at_k
            rep = [e for e in exs for _ in range(k)]
            b = engine.generate(rep, max_new_tokens=max_new_tokens, temperature=cfg.temperature, generator=gen,
                                batch_size=cfg.batch_size)
            res[f"mean@{k}"] = sum(dom.rewards(rep, b.texts)) / len(rep)
        out[name] = res
    return out


def accuracy_table(results: Mapping[str, Mapping[str, Mapping[str, float]]], metric: str = "greedy",
                   domains: list[str] | None = None) -> str:
    """Markdown table: one row per model, one column per domain (accuracy in %)."""
    domains = domains or sorted({d for r in results.values() for d in r})
    lines = ["| model | " + " | ".join(domains) + " |", "|---|" + "---:|" * len(domains)]
    for model, r in results.items():
        cells = [f"{100 * r[d][metric]:.1f}" if d in r and metric in r[d] else "–" for d in domains]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_accuracy(results: Mapping[str, Mapping[str, Mapping[str, float]]], path, metric: str = "greedy"):
    """Grouped bar chart, one group per domain, one bar per model; saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = sorted({d for r in results.values() for d in r})
    models = list(results)
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(domains), 3.6))
    width = 0.8 / max(1, len(models))
    for i, m in enumerate(models):
        vals = [100 * results[m].get(d, {}).get(metric, 0.0) for d in domains]
        ax.bar([j + i * width for j in range(len(domains))], vals, width, label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(domains))], domains)
    ax.set_ylabel(f"{metric} accuracy (%)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
