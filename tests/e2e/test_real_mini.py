"""The real-data preset end to end (`configs/real_mini.yaml`: the tiny chat model over data/real_mini, the real
verifiers, `eval_sources` benchmarks): the full-recipe flow (ephemeral Prefect, SQLite MLflow) writes the
per-benchmark table, logs every completion's result to the evaluate run and publishes the benchmark and per-row
tables in the flow run; then `mopd recipe --config real_mini` on the same run folder reuses every stage and
prints the same table (one engine, one seed)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.e2e.helpers import PY, ROOT, drive, isolated_env, mlflow_client, runs_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

TRAINED = ("sft", "expert-math", "expert-code", "expert-if", "student")
BENCHES = {"math": ["mini-math"], "code": ["mini-lcb", "mini-leetcode"], "if": ["mini-ifeval"]}


@pytest.fixture(scope="module")
def flow_then_cli(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("realmini")
    env = isolated_env(tmp)
    ov = [f"output_dir={tmp / 'runs'}", "runtime.num_threads=1"]
    (flow,) = drive(tmp, [{"op": "run", "flow": "full-recipe", "kwargs": {"config": "real_mini", "overrides": ov}}],
                    env, timeout=800, tag="flow")
    stamps = _stamps(tmp)
    cli = subprocess.run([PY, "-m", "mopd_core.cli", "recipe", "--config", "real_mini",
                          *[a for o in ov for a in ("--set", o)]], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    return tmp, env, flow, cli, stamps, _stamps(tmp)


def _stamps(tmp) -> dict[str, int | None]:
    out = {}
    for st in TRAINED:
        f = tmp / "runs" / "real-mini" / st / "final" / "model.safetensors"
        out[st] = f.stat().st_mtime_ns if f.exists() else None
    return out


def test_flow_tracks_benchmarks_rows_and_publishes_tables(flow_then_cli):
    tmp, env, flow, *_ = flow_then_cli
    assert flow["ok"], (flow.get("error"), (tmp / "flow.log").read_text()[-4000:])
    run_dir = tmp / "runs" / "real-mini"
    head = (run_dir / "accuracy.md").read_text().splitlines()[0]
    assert head == ("| model | math | code | if | math/mini-math | code/mini-lcb | code/mini-leetcode | "
                    "if/mini-ifeval | total |"), head
    acc = json.loads((run_dir / "accuracy.json").read_text())
    s = acc["accuracy"]["student"]
    assert set(s["math"]) == {"score", "mini-math", "mini-math/mean@4", "mini-math/pass@2",
                              "mini-math/truncation_rate"}
    assert set(s["if"]) == {"score", "mini-ifeval", *(f"mini-ifeval/{m}" for m in (
        "prompt_strict", "inst_strict", "prompt_loose", "inst_loose", "truncation_rate"))}
    assert s["code"]["score"] == pytest.approx((s["code"]["mini-lcb"] + s["code"]["mini-leetcode"]) / 2)
    # per-row results: every model × benchmark × prompt × sample (eval_size 4 caps each benchmark's rows)
    rows = [json.loads(x) for x in (run_dir / "eval_rows.jsonl").read_text().splitlines()]
    per_model = 4 * 4 + 4 * 2 + 3 + 4  # mini-math n=4, mini-lcb n=2, mini-leetcode (3 rows), mini-ifeval
    models = {"base", "sft", "expert-math", "expert-code", "expert-if", "student"}
    assert {r["model"] for r in rows} == models and len(rows) == per_model * len(models)
    assert {r["benchmark"] for r in rows} == {b for bs in BENCHES.values() for b in bs}
    code = [r for r in rows if r["benchmark"] == "mini-lcb"]
    assert all(r["info"]["total"] >= 1 for r in code)  # the sandboxed tests ran on every completion
    # prompts as the data has them: verl's chat messages (math), plain strings (LiveCodeBench, IFEval)
    assert all(r["prompt"][-1]["role"] == "user" for r in rows if r["domain"] == "math")
    assert all(isinstance(r["prompt"], str) for r in rows if r["domain"] != "math")
    # MLflow: the evaluate run holds the rows and the scores as metrics ('@' is not allowed in a key)
    c = mlflow_client(env["MLFLOW_TRACKING_URI"])
    parent = flow["result"]["parent_run_id"]
    kids = {r.data.tags["mlflow.runName"]: r for r in runs_of(c, "real-mini")
            if r.data.tags.get("mlflow.parentRunId") == parent}
    ev = kids["evaluate"]
    arts = {a.path for a in c.list_artifacts(ev.info.run_id)}
    assert {"eval_rows.jsonl", "accuracy.json", "accuracy.md", "accuracy.png"} <= arts, arts
    got = c.download_artifacts(ev.info.run_id, "eval_rows.jsonl", str(tmp / "dl"))
    assert len(open(got).read().splitlines()) == len(rows)
    assert ev.data.metrics["accuracy/student/math/mini-math/mean_4"] == pytest.approx(s["math"]["mini-math/mean@4"])
    assert "accuracy/student/if/mini-ifeval/inst_loose" in ev.data.metrics
    # Prefect: the benchmark table (one row per model × benchmark) and the per-row table in the flow run
    arts = {a["key"]: a for a in flow["flow_run"]["artifacts"]}
    assert arts["real-mini-benchmarks"]["type"] == "table" and arts["real-mini-eval-rows"]["type"] == "table"
    bench = json.loads(arts["real-mini-benchmarks"]["data"])
    assert len(bench) == len(models) * 4 and {"model", "benchmark", "headline", "truncation_rate"} <= set(bench[0])


def test_cli_recipe_on_the_same_folder_reuses_every_stage_and_prints_the_same_table(flow_then_cli):
    tmp, _, flow, cli, before, after = flow_then_cli
    assert cli.returncode == 0, cli.stderr[-4000:]
    assert None not in before.values() and after == before  # no stage retrained: the flow's weights, untouched
    run_dir = tmp / "runs" / "real-mini"
    table = (run_dir / "accuracy.md").read_text().strip()
    assert table == flow["result"]["table"].strip() and table in cli.stdout
