"""Soak: the tiny recipe (tiny_overrides-sized) five times through the `full-recipe/tiny` deployment, each run
retraining every stage (`refresh: [all]`), on the battery's services. Every run completes with the same table
and the same final weights of every stage; afterwards no process the services started is left (the set of
processes carrying the battery's environment marker is the one before the soak) and no listening port is left;
every socket those processes listen on — sampled during the runs too — is bound to the loopback interface."""

from __future__ import annotations

import threading
import time

import pytest

from tests.conftest import tiny_overrides
from tests.reliability.common import (STAGES, file_sha, is_loopback, listening, pids_with_env, run_signature,
                                      signature_diff)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

RUNS = 5


class _Sampler(threading.Thread):
    """Listening sockets of the services' process tree, every half second, while the soak runs."""

    def __init__(self, mark: str):
        super().__init__(daemon=True)
        self.mark, self.seen, self.stop_ = mark, set(), threading.Event()

    def run(self) -> None:
        while not self.stop_.is_set():
            self.seen |= {a for _, a in listening(pids_with_env(self.mark))}
            self.stop_.wait(0.5)


@pytest.fixture(scope="module")
def soak(services, reliability_tmp):
    out = reliability_tmp / "soak"
    ov = [o for o in tiny_overrides(out) if not o.startswith("name=")] + ["name=s"]
    params = {"overrides": ov, "refresh": ["all"], "concurrent_experts": False}
    before_pids = pids_with_env(services.mark)
    before_ports = listening(before_pids)
    sampler = _Sampler(services.mark)
    sampler.start()
    runs = []
    t0 = time.monotonic()
    try:
        for _ in range(RUNS):
            t = time.monotonic()
            fr = services.create_run("full-recipe/tiny", params)
            state = services.wait_final(fr, timeout=600)
            sig = run_signature(out / "s") if state == "COMPLETED" else None
            mtimes = {s: (out / "s" / s / "final" / "model.safetensors").stat().st_mtime_ns for s in STAGES} \
                if sig else {}
            runs.append({"flow_run": fr, "state": state, "signature": sig, "wall_s": time.monotonic() - t,
                         "mtimes": mtimes, "tasks": services.task_runs(fr)})
    finally:
        sampler.stop_.set()
        sampler.join(5)
    wall = time.monotonic() - t0
    # flow-run processes exit when their run ends, and the worker closes the loopback listener it opens for
    # each run (Prefect's attempt control channel, prefect/runner/_control_channel.py) only once its own
    # bookkeeping of that run is done, which can be after the API already says COMPLETED: give the process and
    # port sets up to a minute to settle
    deadline = time.monotonic() + 60
    while (((after_pids := pids_with_env(services.mark)) - before_pids
            or listening(after_pids) != before_ports) and time.monotonic() < deadline):
        time.sleep(0.5)
    return {"runs": runs, "wall_s": wall, "before_pids": before_pids, "after_pids": after_pids,
            "before_ports": before_ports, "after_ports": listening(after_pids), "seen": sampler.seen,
            "dir": out / "s"}


def test_soak_runs_complete_with_identical_tables(soak, case):
    case["category"] = "soak"
    runs = soak["runs"]
    states = [r["state"] for r in runs]
    case["detail"].update(runs=len(runs))
    assert states == ["COMPLETED"] * RUNS, states
    first = runs[0]["signature"]
    same = [not signature_diff(first, r["signature"]) for r in runs]
    case["detail"].update(identical=sum(same))
    assert all(same), [signature_diff(first, r["signature"]) for r in runs]
    # each run retrained (refresh: all): new weight files, not a cached result
    for a, b in zip(runs, runs[1:]):
        assert all(b["mtimes"][s] > a["mtimes"][s] for s in STAGES), "a soak run did not retrain"
        assert all(b["tasks"].get(t) != "Cached" for t in ("sft", "mopd", "evaluate")), b["tasks"]
    acc = first["accuracy"]
    case["message"] = (f"{RUNS} runs of full-recipe/tiny (refresh all), {soak['wall_s']:.0f} s; all COMPLETED with "
                       f"the same table, weights of {len(STAGES)} stages and step metrics (student "
                       f"{ {d: v['greedy'] for d, v in acc['student'].items()} })")


def test_soak_leaves_no_process_or_port(soak, case):
    case["category"] = "soak"
    assert soak["after_pids"] == soak["before_pids"], (
        f"processes left: {sorted(soak['after_pids'] - soak['before_pids'])}, "
        f"gone: {sorted(soak['before_pids'] - soak['after_pids'])}")
    assert soak["after_ports"] == soak["before_ports"], (soak["before_ports"], soak["after_ports"])
    case["message"] = (f"{len(soak['before_pids'])} service processes before and after, the same "
                       f"{len(soak['before_ports'])} listening sockets; no flow-run or teacher process left")


def test_every_service_listens_on_loopback_only(soak, services, case):
    case["category"] = "soak"
    addrs = {a for _, a in soak["before_ports"]} | soak["seen"]
    assert any(a.endswith(f":{services.pport}") for a in addrs) and any(a.endswith(f":{services.mport}")
                                                                       for a in addrs), addrs
    bad = sorted(a for a in addrs if not is_loopback(a))
    assert not bad, f"listening beyond the loopback interface: {bad}"
    case["message"] = f"every listening socket of the services and flow runs on loopback: {sorted(addrs)}"


def test_soak_weights_are_files_of_this_run(soak, case):
    """The signature hashes the files the runs wrote (not a cache): the student's final model exists and is
    the one hashed."""
    case["category"] = "check/soak"
    p = soak["dir"] / "student" / "final" / "model.safetensors"
    assert file_sha(p) == soak["runs"][-1]["signature"]["weights"]["student"]
    case["message"] = "the compared weights are the run folder's files"
