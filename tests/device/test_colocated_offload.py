"""The colocated phase schedule on an accelerator, where offloading moves real bytes (on CPU it moves nothing, so
the CPU test — tests/integration/test_colocated.py — cannot tell an offload that happens from one that does not):
the same tiny MOPD stage (`recipe.mopd_stage`, 2 steps, three teachers built from different seeds) colocated with
offloading (optimizer state and gradients to the host after each update, one teacher on the device at a time) and
disaggregated without it. The optimizer state must leave the device after the update (the device's allocated bytes
drop by at least its size before the next rollout) and come back for the next one, and no number may change:
losses, gradient norms, reverse KL and the final weights bit for bit."""

from __future__ import annotations

import json
import os

import pytest
import torch

from device_common import record, require

# deterministic cuBLAS (read when this process creates its first handle): the two stages must be bit-identical
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = pytest.mark.device


def _rows(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_colocated_offload_round_trips_the_optimizer_state_and_changes_no_number(tmp_path):
    kind = require()
    for mod in ("pydantic", "datasets", "yaml"):
        pytest.importorskip(mod, reason=f"the MOPD stage needs `{mod}` (pip install -e .)")
    from mopd_core import recipe as R
    from mopd_core.config import load_config
    from mopd_core.models import build_tiny, load_model
    from tests.conftest import tiny_overrides

    over = [o for o in tiny_overrides(tmp_path / "runs") if not o.startswith(("runtime.device", "model.tiny"))]
    over += [f"runtime.device={kind}", "model.tiny.hidden_size=256", "model.tiny.num_heads=4",
             "model.tiny.num_layers=2", "model.tiny.intermediate_size=512", "mopd.steps=2", "mopd.save_every=1"]
    cfg = load_config("tiny", over)
    R.setup_runtime(cfg)
    base = R.base_model(cfg)
    teachers = {d: build_tiny(cfg.model, tmp_path / f"teacher-{d}", seed=1 + i)
                for i, d in enumerate(cfg.domain_names())}
    out = {}
    for placement, offload in (("colocated", True), ("disaggregated", False)):
        c = cfg.model_copy(update={"output_dir": str(tmp_path / placement)}, deep=True)
        c.runtime.placement, c.teachers.offload = placement, offload
        R.setup_runtime(c)
        out[placement] = R.mopd_stage(c, base, teachers, progress=False)
    co, dis = (_rows(out[p].stage_dir / "metrics.jsonl") for p in ("colocated", "disaggregated"))
    for a, b in zip(co, dis):
        for k in ("loss", "grad_norm", "reverse_kl/math", "reverse_kl/code", "reverse_kl/if"):
            assert a[k] == b[k], (k, a[k], b[k])
    sa = load_model(out["colocated"].model_dir).state_dict()
    sb = load_model(out["disaggregated"].model_dir).state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)

    def events(p):
        return _rows(out[p].stage_dir / "phases.jsonl")

    def at(evs, step, phase, where):
        return next(e for e in evs if e["step"] == step and e["phase"] == phase and e["at"] == where)

    ev_co, ev_dis = events("colocated"), events("disaggregated")
    upd = at(ev_co, 1, "train", "updated")  # weights + gradients + AdamW state on the device
    state_mb = upd["optim_mb"] + upd["grads_mb"]
    assert upd["optim_mb"] == pytest.approx(2 * upd["weights_mb"], rel=1e-3)  # AdamW moments (+ step counters)
    nxt = at(ev_co, 2, "rollout", "start")
    # the round trip: gone from the device before the next rollout (measured, not the bookkeeping) ...
    drop = upd["device_allocated_mb"] - nxt["device_allocated_mb"]
    assert drop >= 0.99 * state_mb, (drop, state_mb)
    # ... back for the next update
    assert at(ev_co, 2, "train", "start")["optim_mb"] == pytest.approx(upd["optim_mb"])
    # without offloading the state stays where it is
    kept = at(ev_dis, 1, "train", "updated")["device_allocated_mb"] - at(ev_dis, 2, "rollout", "start")[
        "device_allocated_mb"]
    assert kept < 0.5 * state_mb, (kept, state_mb)
    record("colocated_offload", kind=kind, state_mb=state_mb, device_drop_mb=drop, kept_drop_mb=kept,
           loss=[r["loss"] for r in co], score_peak_mb={p: max(e.get("device_peak_mb", 0) for e in evs
                                                               if e["phase"] == "score")
                                                      for p, evs in (("colocated", ev_co), ("disaggregated", ev_dis))})
