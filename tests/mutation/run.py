"""Plants each wiring bug of `mutants.py` in a copy of the tree and runs the fast learning/behaviour subset
against it: a mutant is *killed* when at least one test fails (the report names which). Before the mutants, the
unchanged copy must pass the same subset, so a red baseline is reported as such instead of as kills.

    .venv/bin/python -m tests.mutation.run                 # all mutants → benchmarks/results/mutants.{json,md}
    .venv/bin/python -m tests.mutation.run --only adv_sign_flip,kd_weight_ignored --out /tmp/m

Why not mutmut/cosmic-ray: they mutate operators at random across the tree and need hours on two cores; the
bugs that matter here are wiring bugs in a few places (which tensor goes where), so the list is targeted and
each mutant says what real bug it stands for. `tests/unit/test_mutants.py` keeps the list applicable: every
mutant's text must occur exactly once in today's code.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.mutation.mutants import FAST_SUBSET, MUTANTS, Mutant

ROOT = Path(__file__).resolve().parents[2]
COPY = ("mopd_core", "tasks", "flows", "tests", "configs", "data", "benchmarks", "pyproject.toml")
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "node_modules", ".pytest_cache")


def _copy_tree(dst: Path) -> None:
    for name in COPY:
        src = ROOT / name
        (shutil.copytree(src, dst / name, ignore=IGNORE) if src.is_dir() else shutil.copy2(src, dst / name))


def _apply(root: Path, m: Mutant) -> None:
    path = root / m.file
    text = path.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"error: mutant {m.id}: its text occurs {text.count(m.old)} times in {m.file} (must be "
                         f"once); update tests/mutation/mutants.py to today's code")
    path.write_text(text.replace(m.old, m.new))


def _failed_tests(xml: Path) -> list[str]:
    if not xml.exists():
        return []
    out = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            out.append(f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}")
    return out


def _run_subset(root: Path, tests: list[str], timeout: float) -> dict:
    xml = root / "junit.xml"
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.time()
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                            f"--junitxml={xml}", *tests], cwd=root, env=env, capture_output=True, text=True,
                           timeout=timeout)
        rc, tail = r.returncode, (r.stdout + r.stderr)[-1500:]
    except subprocess.TimeoutExpired:
        rc, tail = -1, f"timed out after {timeout:.0f} s"
    return {"rc": rc, "seconds": round(time.time() - t0, 1), "failed": _failed_tests(xml), "tail": tail}


def run(mutants: list[Mutant], timeout: float) -> dict:
    results = []
    with tempfile.TemporaryDirectory(prefix="mopd-mutants-") as tmp:
        base = Path(tmp) / "baseline"
        _copy_tree(base)
        baseline = _run_subset(base, FAST_SUBSET, timeout)
        print(f"baseline: rc={baseline['rc']} in {baseline['seconds']} s", flush=True)
        if baseline["rc"] != 0:
            return {"baseline": baseline, "mutants": []}
        for m in mutants:
            root = Path(tmp) / m.id
            _copy_tree(root)
            _apply(root, m)
            res = _run_subset(root, m.tests or FAST_SUBSET, timeout)
            killed = res["rc"] not in (0, 5) and bool(res["failed"])
            results.append({"id": m.id, "file": m.file, "bug": m.bug, "killed": killed,
                            "killed_by": res["failed"], "seconds": res["seconds"],
                            **({} if killed else {"tail": res["tail"]})})
            print(f"{m.id}: {'killed by ' + ', '.join(res['failed']) if killed else 'SURVIVED'} "
                  f"({res['seconds']} s)", flush=True)
            shutil.rmtree(root, ignore_errors=True)
    return {"baseline": {k: baseline[k] for k in ("rc", "seconds")}, "mutants": results}


def _markdown(report: dict) -> str:
    ms = report["mutants"]
    lines = ["# Mutation check: planted wiring bugs against the fast subset", "",
             f"{report['date']} · {report['machine']} · commit `{report['commit']}` · command "
             "`.venv/bin/python -m tests.mutation.run` (`make mutants`)", "",
             f"Fast subset (baseline green in {report['baseline']['seconds']} s): "
             + ", ".join(f"`{t}`" for t in FAST_SUBSET), "",
             f"**{sum(m['killed'] for m in ms)} of {len(ms)} mutants killed.**", "",
             "| mutant | where | the bug it stands for | killed by | s |", "|---|---|---|---|---:|"]
    for m in ms:
        by = "<br>".join(f"`{t}`" for t in m["killed_by"]) if m["killed"] else "**survived**"
        lines.append(f"| `{m['id']}` | `{m['file']}` | {m['bug']} | {by} | {m['seconds']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated mutant ids (default: all)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/mutants"), help="report path stem")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per subset run")
    a = ap.parse_args(argv)
    wanted = [x for x in a.only.split(",") if x]
    unknown = sorted(set(wanted) - {m.id for m in MUTANTS})
    if unknown:
        print(f"error: --only names unknown mutants {unknown}; known: {[m.id for m in MUTANTS]}", file=sys.stderr)
        return 2
    report = run([m for m in MUTANTS if not wanted or m.id in wanted], a.timeout)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    report.update(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), commit=commit,
                  machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                          f"load {os.getloadavg()[0]:.1f}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    if report["mutants"]:
        out.with_suffix(".md").write_text(_markdown(report))
    else:
        print(f"error: the unchanged tree fails the fast subset:\n{report['baseline'].get('tail', '')}",
              file=sys.stderr)
        return 1
    return 0 if all(m["killed"] for m in report["mutants"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
