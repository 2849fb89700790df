"""Faults through `mopd recipe` (a real subprocess of .venv/bin/mopd, local teachers): SIGKILL at a random
(seeded) step of SFT, of one expert (random domain), of MOPD, and during the final evaluation — one chain over
one run folder: each run is killed in the next stage, the run after it resumes. The last run must end with the
table, the final weights of every stage and every step's training metrics of the uninterrupted reference run
(same config and seed; bit-identical on one machine with one thread), each step logged exactly once (a resume
truncates the metrics after its checkpoint; a restart from scratch would log the early steps twice), and no
stage folder lost or set aside on the way. Kills wait on conditions (a metrics row, a stage.json status), never
on fixed sleeps."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess

import pytest

from tests.reliability.common import (DOMAINS, ROOT, SECRETS, STAGES, base_env, fault_overrides, finished_stages,
                                      last_step, mopd_cmd, run_cli, run_signature, sets, signature_diff,
                                      stage_folders, stage_status, wait_for)

pytestmark = [pytest.mark.timeout(1500)]

SFT_STEPS, RL_STEPS = 60, 12


def _plans() -> list[dict]:
    rng = random.Random("reliability/cli")
    return [
        {"case": "sft", "stage": "sft", "at": rng.randint(52, SFT_STEPS - 3)},  # TRL checkpoint at step 50
        {"case": "expert", "stage": f"expert-{rng.choice(DOMAINS)}", "at": rng.randint(4, RL_STEPS - 4)},
        {"case": "mopd", "stage": "student", "at": rng.randint(4, RL_STEPS - 4)},
        {"case": "eval", "stage": "evaluate", "at": None},
    ]


def _resume_point(stage_dir) -> int:
    """The step the next run resumes from: the newest complete checkpoint."""
    if (stage_dir / "trainer").exists():
        ck = [int(p.name.split("-")[1]) for p in (stage_dir / "trainer").glob("checkpoint-*")]
    else:
        ck = [int(p.name.split("-")[1]) for p in (stage_dir / "checkpoints").glob("step-*")
              if (p / "loop_state.pt").exists()]
    return max(ck, default=0)


@pytest.fixture(scope="module")
def cli_chain(reliability_tmp, cli_reference):
    out = reliability_tmp / "cli-chain"
    run = out / "f"
    args = ["recipe", "--config", "tiny", "--no-progress", *sets(fault_overrides(out))]
    env = base_env(**SECRETS)
    events = {}
    for i, plan in enumerate(_plans()):
        folders, done = stage_folders(run), finished_stages(run)
        log = out.parent / f"cli-chain-{i}.log"
        out.mkdir(parents=True, exist_ok=True)
        with log.open("w") as f:
            p = subprocess.Popen(mopd_cmd() + args, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        sd = run / plan["stage"]
        died = lambda: f"the recipe exited ({p.returncode}) before the kill" if p.poll() is not None else None  # noqa: E731
        try:
            if plan["at"] is None:  # evaluation: the student is finished, the table not yet written
                wait_for(lambda: stage_status(run / "student") == "done", 600, "the student to finish", poll=0.01,
                         abort=died)
            else:
                wait_for(lambda: stage_status(sd) == "running" and last_step(sd) >= plan["at"], 600,
                         f"{plan['stage']} step {plan['at']}", poll=0.01, abort=died)
            os.killpg(p.pid, signal.SIGKILL)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=60)
        ev = {**plan, "rc": p.returncode, "folders_before": folders, "done_before": done,
              "folders_after": stage_folders(run), "done_after": finished_stages(run), "log": log}
        if plan["at"] is None:
            ev["table_written"] = (run / "accuracy.json").exists()
        else:
            ev["killed_at"] = last_step(sd)
            ev["status"] = stage_status(sd)
            ev["resume_from"] = _resume_point(sd)
        events[plan["case"]] = ev
    final = run_cli(args, env=env, timeout=900)
    assert final.rc == 0, final.stderr[-3000:]
    return {"events": events, "run": run, "final": final, "signature": run_signature(run)}


@pytest.mark.parametrize("which", ["sft", "expert", "mopd", "eval"])
def test_cli_sigkill_then_rerun_matches_uninterrupted(cli_chain, cli_reference, which, case):
    case["category"] = "fault/cli"
    ev = cli_chain["events"][which]
    run = cli_chain["run"]
    assert ev["rc"] == -signal.SIGKILL, f"not killed: rc={ev['rc']}\n{ev['log'].read_text()[-2000:]}"
    if ev["at"] is None:
        where = "during the evaluation (student finished, table not written)"
        assert not ev["table_written"], "the evaluation finished before the kill landed"
    else:
        total = 60 if ev["stage"] == "sft" else 12
        where = f"in {ev['stage']} at step {ev['killed_at']} (planned {ev['at']}, checkpoint {ev['resume_from']})"
        assert ev["status"] == "running" and ev["at"] <= ev["killed_at"] < total, f"the kill missed: {ev}"
        assert 0 < ev["resume_from"] <= ev["killed_at"], f"no checkpoint before the kill: {ev}"
        # resumed, not restarted: every step exactly once, the ones before the checkpoint kept from the killed run
        steps = [r.get("step") for r in cli_chain["signature"]["metrics"][ev["stage"]]]
        assert steps == list(range(1, total + 1)), f"{ev['stage']} logged steps {steps}"
    lost = ev["folders_before"] - ev["folders_after"]
    assert not lost, f"stage folder lost: {lost}"
    assert ev["done_before"] <= ev["done_after"], "a finished stage is no longer finished"
    assert not [f for f in stage_folders(run) if "@" in f], "a stage folder was set aside under the same config"
    assert set(STAGES) <= finished_stages(run)
    diff = signature_diff(cli_reference["signature"], cli_chain["signature"])
    assert not diff, f"the rerun differs from the uninterrupted run: {diff}"
    case["message"] = f"SIGKILL {where}; rerun resumed → same table, weights and step metrics"
    case["detail"].update(injected=1, same_table=1)


def test_cli_rerun_after_the_chain_reuses_everything(cli_chain, case):
    """The final run of the chain evaluated and wrote the table; a further run retrains nothing."""
    case["category"] = "check/reuse"
    run = cli_chain["run"]
    stamps = {p: p.stat().st_mtime_ns for p in run.glob("*/final/model.safetensors")}
    again = run_cli(["recipe", "--config", "tiny", "--no-progress", *sets(fault_overrides(run.parent))],
                    in_process=True)
    assert again.rc == 0, again.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    acc = json.loads((run / "accuracy.json").read_text())["accuracy"]
    assert acc == cli_chain["signature"]["accuracy"]
    case["message"] = f"after 4 kills: a further run reuses all {len(stamps)} finished stages, same table"
