"""Shared fixtures. Tests run offline, single-threaded (the CI box has 2 cores and OpenMP spin-waits under
contention), and write only under pytest's tmp dirs.

`make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadscope`): most long tests wait on
processes they started (vLLM servers, Prefect/MLflow servers, flow subprocesses), so a second worker fills the
other core. The hooks below make that safe: a test module is one work unit (its module-scoped servers and trained
stages are built once, on one worker), the reliability battery is one unit (its session fixtures serve all of its
modules), the longest units start first, and each worker keeps its own Prefect home."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

ROOT = Path(__file__).resolve().parents[1]
WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, … under xdist; None in a plain run
if WORKER:
    # Prefect's local state (a SQLite database, the ephemeral server) is per process: two workers on one
    # database lock each other out. Set before any test module imports prefect.
    os.environ["PREFECT_HOME"] = str(Path(os.environ.get("PREFECT_HOME", ROOT / ".prefect")) / WORKER)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# Work units that span several modules: their session-scoped fixtures must be built once per session.
_SHARED_UNITS = {"tests/reliability/": "reliability"}
# Modules whose tests are each a unit of their own (long tests that share only a cheap module fixture, built
# again on the other worker), except the tests named in _JOINT_UNITS, which share a module fixture.
_PER_TEST_UNITS = {"tests/integration/test_async_mopd.py"}
_JOINT_UNITS = {
    "tests/integration/test_async_mopd.py::test_async_k0_equals_sync": "async-k0-k1",
    "tests/integration/test_async_mopd.py::test_async_k1_runs_one_version_behind_with_teacher_servers": "async-k0-k1",
}
# The longest units first (longest-processing-time-first: both workers then finish close together), in order of
# their wall time: integration units as measured under `-n 2` on the 2-core box (distributed 870 s, async k=0/k=1
# 850, http faults 390, http teachers 374, the two async kill tests 280 and 227, cluster 191), the reliability
# battery from its report (8 min), the e2e modules by the flows and servers they run. The rest follow in
# collection order.
_LONGEST_FIRST = [
    "tests/e2e/test_deployments.py",
    "reliability",
    "tests/e2e/test_http_recipe.py",
    "tests/integration/test_distributed.py",
    "async-k0-k1",
    "tests/e2e/test_stage_identity.py",
    "tests/e2e/test_flows_local.py",
    "tests/integration/test_http_faults.py",
    "tests/integration/test_http_teachers.py",
    "tests/integration/test_async_mopd.py::test_async_trainer_killed_resumes_from_its_checkpoint",
    "tests/integration/test_async_mopd.py::test_async_student_server_killed_is_restarted",
    "tests/integration/test_cluster.py",
]


def unit_of(nodeid: str) -> str:
    """The work unit of a test (a string of its node id alone: xdist's controller sees no test objects)."""
    if nodeid in _JOINT_UNITS:
        return _JOINT_UNITS[nodeid]
    path = nodeid.split("::", 1)[0]
    if path in _PER_TEST_UNITS:
        return nodeid
    return next((unit for prefix, unit in _SHARED_UNITS.items() if path.startswith(prefix)), path)


def pytest_collection_modifyitems(config, items):
    rank = {unit: i for i, unit in enumerate(_LONGEST_FIRST)}
    # stable: a unit's tests stay together and in order; the workers all collect this same order
    items.sort(key=lambda it: rank.get(unit_of(it.nodeid), len(rank)))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: absent without it
def pytest_xdist_make_scheduler(config, log):
    """xdist's loadscope scheduler on our units (`unit_of`; xdist's own `xdist_group` suffix on node ids has no
    effect under pytest 9), in collection order (the longest first), and a worker is handed its next unit only
    when its current one is down to the test it is running: the stock scheduler hands it over two tests early, so
    a unit could wait behind the last two (long) tests of another while the other worker sits idle."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # keep the longest-first order (xdist would sort by test count)

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return unit_of(nodeid)

        def _reschedule(self, node):
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            if self._pending_of(self.assigned_work[node]) > 1:
                return
            self._assign_work_unit(node)

    return Units(config, log)


def tiny_overrides(tmp_path) -> list[str]:
    """A recipe small enough for seconds-long integration tests (a 2-layer, 64-wide model)."""
    return [
        f"output_dir={tmp_path}", "name=t", "runtime.device=cpu", "runtime.num_threads=1",
        "model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.num_heads=2",
        "model.tiny.intermediate_size=128",
        "sft.steps=6", "sft.batch_size=16", "sft.logging_steps=2",
        "expert.steps=3", "expert.prompts_per_step=4", "expert.group_size=4", "expert.save_every=2",
        "mopd.steps=3", "mopd.prompts_per_step=6", "mopd.group_size=2", "mopd.save_every=2",
        "rollout.max_new_tokens=6", "data.domains.math.eval_size=8", "data.domains.code.eval_size=8",
        "data.domains.if.eval_size=8",
    ]


class StageStopped(Exception):
    """Raised by `interrupted_mopd_stage` after its step: a stage cut short as a kill would, checkpoints kept."""


def interrupted_mopd_stage(cfg, student, teachers, stop_after: int) -> None:
    """`recipe.mopd_stage` stopped right after step `stop_after` (the loop's own `on_step` raising
    `StageStopped`): what a resumed stage then starts from. Raises `StageStopped`."""
    from mopd_core import recipe as R
    from mopd_core.train import loop as L

    orig = L.run_policy_loop

    def interrupted(**kw):
        def on_step(step, m):
            if step == stop_after:
                raise StageStopped
        return orig(**kw, on_step=on_step)

    L.run_policy_loop = interrupted
    try:
        R.mopd_stage(cfg, student, teachers, progress=False)
    finally:
        L.run_policy_loop = orig


def perturbed_teachers(cfg, sft_dir, tmp_path) -> dict:
    """Cheap stand-in teachers: the SFT weights plus a different small perturbation per domain."""
    from mopd_core.models import load_model, load_tokenizer

    out = {}
    for i, d in enumerate(cfg.domain_names()):
        m = load_model(sft_dir)
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=g))
        dst = tmp_path / f"teacher-{d}"
        m.save_pretrained(dst)
        load_tokenizer(sft_dir).save_pretrained(dst)
        out[d] = dst
    return out


@pytest.fixture
def tiny_cfg(tmp_path):
    from mopd_core.config import load_config

    return load_config("tiny", tiny_overrides(tmp_path))


from mopd_core.domains import MathDomain, register_domain  # noqa: E402


@register_domain("short")
class ShortDomain(MathDomain):
    """Test-only domain: math prompts, reward 1 when the completion has at most 2 characters — a signal an
    almost untrained model already gets sometimes, so a few RL steps on it really move the weights."""

    kind = "short"

    def reward(self, example, completion: str) -> float:
        return float(len(completion.strip()) <= 2)


def with_short_domain(cfg):
    from mopd_core.config import config_from_dict

    d = cfg.model_dump()
    d["data"]["domains"].append({"name": "short", "source": "synthetic:short", "weight": 1.0, "eval_size": 8})
    return config_from_dict(d)


def short_cfg(tmp_path, extra=()):
    """The integration recipe with the `short` domain (RL on it moves the weights within a few steps)."""
    from mopd_core.config import load_config

    return with_short_domain(load_config("tiny", tiny_overrides(tmp_path) + list(extra)))


@pytest.fixture(scope="module")
def short_sft_dir(tmp_path_factory):
    """One tiny SFT of `short_cfg` per test module that trains RL stages from it."""
    from mopd_core import recipe as R

    cfg = short_cfg(tmp_path_factory.mktemp("sft"))
    R.setup_runtime(cfg)
    torch.set_num_threads(1)
    return R.sft_stage(cfg, R.base_model(cfg), progress=False).model_dir
