"""`rollout.backend: hf_graphed` with the decode step really captured (CUDA graph / NPU graph): the same samples
and log-probs as the eager `HFRollout` for one seed in float64 (stop ids and ignore_eos), and under bf16 autocast
over float32 master weights — the trainer's configuration — a graph captured before an in-place update samples
from the updated weights (the autocast weight-cast cache is off during capture). The CPU twin, uncaptured, is
tests/unit/test_graphed_sampler.py; the 1.7B-shape speed is perf_checks.py `sampling`."""

from __future__ import annotations

import pytest
import torch

from device_common import record
from mopd_core.rollout import HFRollout
from mopd_core.rollout.graphed import GraphedRollout

pytestmark = pytest.mark.device


def _model(device, dtype):
    from transformers import Qwen3Config, AutoModelForCausalLM

    cfg = Qwen3Config(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=3, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").eval()


def _prompts(device, B=8, P=12):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 96, (B, P), generator=g)
    lens = torch.randint(3, P + 1, (B,), generator=g)
    mask = (torch.arange(P)[None] >= (P - lens)[:, None]).long()
    return (ids * mask).to(device), mask.to(device)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_captured_step_gives_the_eager_samples_in_float64(accelerator, ignore_eos):
    model = _model(accelerator, torch.float64)
    ids, mask = _prompts(accelerator)
    stops = [] if ignore_eos else [3, 4, 5, 6]  # several stop ids: rows stop at different steps
    kw = dict(max_new_tokens=40, eos_id=stops, pad_id=0)
    a = HFRollout(model, None, accelerator)._sample(ids, mask, **kw,
                                                    generator=torch.Generator(accelerator).manual_seed(0))
    eng = GraphedRollout(model, None, accelerator, ignore_eos=ignore_eos)
    assert eng.capture  # a device graph on this accelerator
    b = eng._sample(ids, mask, **kw, generator=torch.Generator(accelerator).manual_seed(0))
    assert eng.decoder.graph is not None and eng.decoder.capture_s > 0
    frac = float((a[0] == b[0]).float().mean()) if a[0].shape == b[0].shape else 0.0
    record("graphed_sampler_float64", ignore_eos=ignore_eos, identical_fraction=frac,
           max_abs_logp_diff=float((a[2] - b[2]).abs().max()) if a[2].shape == b[2].shape else None,
           capture_s=eng.decoder.capture_s)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    torch.testing.assert_close(b[2], a[2], rtol=0, atol=1e-9)
    assert bool(b[1].all()) == ignore_eos
    # a second call reuses the graph and still agrees
    c = eng._sample(ids, mask, **kw, generator=torch.Generator(accelerator).manual_seed(0))
    assert eng.builds == 1 and torch.equal(c[0], b[0])


def test_a_graph_under_autocast_samples_the_updated_weights(accelerator):
    from mopd_core.rollout import RolloutBatch, completion_logprobs

    model = _model(accelerator, torch.float32)  # float32 master weights, bf16 compute: the trainer's setup
    ids, mask = _prompts(accelerator)
    kw = dict(max_new_tokens=24, eos_id=[], pad_id=0)
    eng = GraphedRollout(model, None, accelerator)

    def scored(c_ids):
        """The model's log-probs of the sampled tokens (teacher-forced, the trainer's forward)."""
        with torch.no_grad(), torch.autocast(accelerator, dtype=torch.bfloat16):
            return completion_logprobs(model, RolloutBatch(ids, mask, c_ids, torch.ones_like(c_ids),
                                                           torch.zeros(c_ids.shape, device=c_ids.device)))

    def sample():  # each phase its own autocast region, as the loop runs them (a region caches its weight casts)
        with torch.autocast(accelerator, dtype=torch.bfloat16):
            return eng._sample(ids, mask, **kw, generator=torch.Generator(accelerator).manual_seed(0))

    sample()  # captured here
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)  # an optimizer-like in-place update after the capture
    c_ids, _, c_lp = sample()
    new = scored(c_ids)
    with torch.no_grad():
        for p in model.parameters():
            p.div_(1.5)
    old = scored(c_ids)
    assert eng.builds == 1  # the same graph, replayed
    # decode positions only (token 0 comes from the uncaptured prefill)
    gap = float((c_lp - new)[:, 1:].abs().max())
    moved = float((old - new)[:, 1:].abs().max())
    record("graphed_sampler_autocast", max_abs_logp_vs_scorer=gap, logp_moved_by_update=moved)
    assert gap < 0.1 * moved
