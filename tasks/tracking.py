"""MLflow tracking and lineage (docs/orchestration.md), usable without Prefect (never imports it).

Everything goes through an explicit `MlflowClient` and explicit run ids: Prefect threads and Ray workers do not
share MLflow's fluent active-run stack, so a child run names its parent (`parent_run_id`) instead of relying on
one.

- store: `MLFLOW_TRACKING_URI`, else a SQLite file `mlflow.db` in the working directory with artifacts in
  `mlartifacts/` beside it (MLflow's own default artifact root would be `./mlruns` of whatever the cwd is);
- runs: one experiment per recipe name, a parent run per recipe run, a child run per stage; every run carries
  `mopd.host`/`mopd.pid` tags so a run whose process died (SIGKILL) is found and marked KILLED later;
- params: flattened stage config + input model references + code version + git sha + seed;
- metrics: a stage's `metrics.jsonl` (one row per step) → MLflow metrics at that step; PNG plots of them;
- models: a checkpoint dir is logged as run artifacts and registered as `<recipe>-<stage>` with the input
  references as `input.*` tags, so `lineage()` walks a student back to its SFT and experts;
- references: `models:/name/version`, `models:/name@alias` or a checkpoint dir → a local dir.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

PARENT_TAG = "mlflow.parentRunId"
RUN_NAME_TAG = "mlflow.runName"
INPUT_TAG_PREFIX = "input."
_PARAM_VALUE_MAX = 6000
_LOCK = threading.RLock()  # SQLite stores dislike concurrent writers; stages run in threads of one process
_CLIENTS: dict[str, Any] = {}
# The engine's source: what `code_version` hashes and where `git_sha` asks git (this module sits beside it).
PACKAGE_DIR = Path(__file__).resolve().parent.parent / "mopd_core"


class ModelRefError(ValueError):
    """A model reference that does not resolve: one line naming the reference."""


# ---------------------------------------------------------------- store and client


def tracking_uri() -> str:
    """`MLFLOW_TRACKING_URI`, else a SQLite file in the working directory."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"


def _artifact_root(uri: str) -> str | None:
    """Local stores get artifacts beside the DB file; servers decide themselves (None)."""
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts").as_uri()
    if uri.startswith("file:"):
        return None
    return None


def client(uri: str | None = None):
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow import MlflowClient

    uri = uri or tracking_uri()
    with _LOCK:
        if uri not in _CLIENTS:
            _CLIENTS[uri] = MlflowClient(tracking_uri=uri, registry_uri=uri)
        return _CLIENTS[uri]


def experiment_id(name: str, uri: str | None = None) -> str:
    c = client(uri)
    with _LOCK:
        exp = c.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        try:
            return c.create_experiment(name, artifact_location=_artifact_root(uri or tracking_uri()))
        except Exception:  # created concurrently
            exp = c.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id


def run_url(run_id: str, uri: str | None = None) -> str:
    """A link to the run in the MLflow UI when the store is a server, else a `mlflow ui` hint."""
    uri = uri or tracking_uri()
    run = client(uri).get_run(run_id)
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/#/experiments/{run.info.experiment_id}/runs/{run_id}"
    return f"{uri}#run={run_id} (open with: mlflow ui --backend-store-uri {uri})"


# ---------------------------------------------------------------- code identity


@functools.cache  # the source does not change under a running process: read it once, not per stage
def code_version() -> str:
    """Hash of the engine's source (`mopd_core/**/*.py`), logged as a param for provenance only — no part of any
    stage's identity (that is the engine's fingerprint with `RESULTS_VERSION`). Works without git."""
    h = hashlib.sha256()
    for p in sorted(PACKAGE_DIR.rglob("*.py")):
        h.update(str(p.relative_to(PACKAGE_DIR)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PACKAGE_DIR, capture_output=True, text=True,
                             timeout=10)
        sha = out.stdout.strip() if out.returncode == 0 else "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PACKAGE_DIR,
                               capture_output=True, text=True, timeout=10)
        return sha + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ---------------------------------------------------------------- runs


def start_run(experiment: str, run_name: str, parent_run_id: str | None = None,
              tags: Mapping[str, str] | None = None, uri: str | None = None) -> str:
    """Create a run (a child when `parent_run_id` is given) and return its id. The run stays RUNNING until
    `end_run`; the host/pid tags let `reap_stale_runs` close it if this process dies first."""
    all_tags = {RUN_NAME_TAG: run_name, "mopd.host": socket.gethostname(), "mopd.pid": str(os.getpid()),
                **{k: str(v) for k, v in (tags or {}).items()}}
    if parent_run_id:
        all_tags[PARENT_TAG] = parent_run_id
    eid = experiment_id(experiment, uri)
    with _LOCK:
        return client(uri).create_run(eid, tags=all_tags, run_name=run_name).info.run_id


def end_run(run_id: str, status: str = "FINISHED", uri: str | None = None) -> None:
    with _LOCK:
        client(uri).set_terminated(run_id, status=status)


def set_tags(run_id: str, tags: Mapping[str, Any], uri: str | None = None) -> None:
    from mlflow.entities import RunTag

    with _LOCK:
        client(uri).log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


def _param_value(v: Any) -> str:
    s = v if isinstance(v, str) else json.dumps(v, default=str)
    return s[:_PARAM_VALUE_MAX]


def log_params(run_id: str, params: Mapping[str, Any], uri: str | None = None) -> None:
    from mlflow.entities import Param

    items = [Param(k, _param_value(v)) for k, v in sorted(params.items())]
    with _LOCK:
        for i in range(0, len(items), 100):
            client(uri).log_batch(run_id, params=items[i:i + 100])


def stage_params(recipe, sections: Iterable[str], inputs: Mapping[str, str] | None = None,
                 extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Flattened config sections + `input.<name>` references + seed + code version + git sha."""
    from mopd_core.config import flatten

    dump = recipe.model_dump(mode="json")
    out: dict[str, Any] = {"name": recipe.name, "seed": recipe.seed, "code_version": code_version(),
                           "git_sha": git_sha()}
    for s in sections:
        val = dump[s]
        if isinstance(val, dict):
            out.update(flatten(val, f"{s}."))
        else:
            out[s] = val
    for k, v in (inputs or {}).items():
        out[f"{INPUT_TAG_PREFIX}{k}"] = v
    out.update(extra or {})
    return out


def read_metrics(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.exists():
        return []
    rows = []
    for line in p.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a half-written last line of a killed process
                continue
    return rows


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def log_metric_rows(run_id: str, rows: Iterable[Mapping[str, Any]], prefix: str = "",
                    uri: str | None = None) -> int:
    """Each row's numeric values as metrics at `row['step']`; returns the number of values logged."""
    import time

    from mlflow.entities import Metric

    ts = int(time.time() * 1000)
    batch = []
    for i, row in enumerate(rows):
        step = int(row.get("step", i))
        for k, v in row.items():
            if k == "step" or not _finite(v):
                continue
            batch.append(Metric(_metric_key(prefix + k), float(v), ts, step))
    with _LOCK:
        for i in range(0, len(batch), 1000):
            client(uri).log_batch(run_id, metrics=batch[i:i + 1000])
    return len(batch)


def _metric_key(k: str) -> str:
    # MLflow keys allow alphanumerics, _ - . space / ; '@' (mean@k) is not among them
    return "".join(c if (c.isalnum() or c in "_-./ ") else "_" for c in k)


def log_metrics_file(run_id: str, path: str | Path, uri: str | None = None) -> int:
    return log_metric_rows(run_id, read_metrics(path), uri=uri)


def log_eval(run_id: str, results: Mapping[str, Mapping[str, float]], prefix: str = "final_eval",
             uri: str | None = None) -> None:
    """{domain: {"greedy": acc}} → `final_eval/<domain>/greedy`."""
    rows = [{"step": 0, **{f"{prefix}/{d}/{m}": v for d, r in results.items() for m, v in r.items()}}]
    log_metric_rows(run_id, rows, uri=uri)


def log_artifact(run_id: str, path: str | Path, artifact_path: str | None = None, uri: str | None = None) -> None:
    with _LOCK:
        client(uri).log_artifact(run_id, str(path), artifact_path)


def log_text(run_id: str, text: str, artifact_file: str, uri: str | None = None) -> None:
    with _LOCK:
        client(uri).log_text(run_id, text, artifact_file)


def log_datasets(run_id: str, recipe, domains: Iterable[str], context: str = "training",
                 uri: str | None = None) -> None:
    """The stage's training data as MLflow dataset inputs: one per domain (source, params, seed → digest)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    wanted = set(domains)
    inputs = []
    for spec in recipe.data.domains:
        if spec.name not in wanted:
            continue
        desc = {"uri": spec.source, "params": spec.params, "seed": recipe.seed, "verifier": spec.verifier}
        digest = hashlib.sha256(json.dumps(desc, sort_keys=True, default=str).encode()).hexdigest()[:12]
        kind = "synthetic" if spec.source.startswith("synthetic:") else "local"
        cols = [{"name": "prompt", "type": "string"}, {"name": "teacher_id", "type": "string"},
                {"name": "answer", "type": "string"}]
        inputs.append(DatasetInput(
            Dataset(name=f"{spec.name}-{context}", digest=digest, source_type=kind,
                    source=json.dumps(desc, default=str), schema=json.dumps({"mlflow_colspec": cols}),
                    profile=json.dumps({"weight": spec.weight, "eval_size": spec.eval_size})),
            tags=[InputTag("mlflow.data.context", context)]))
    if inputs:
        with _LOCK:
            client(uri).log_inputs(run_id, datasets=inputs)


# ---------------------------------------------------------------- plots


# file → (key prefix, title[, key suffix]): a prefix ending in "/" plots every key under it (minus the suffix)
_PLOTS = {
    "reward": ("reward/", "reward per domain"),
    "teacher_token_frac": ("teacher_token_frac/", "teacher token fraction"),
    "reverse_kl": ("reverse_kl/", "reverse KL (ℓ^old − ℓᵀ) per teacher"),
    "teacher_score_s": ("teacher/", "teacher scoring seconds per step", "/score_s"),
    "phase_memory": ("mem/", "MiB held on the device per phase", "/resident_mb"),
    # async placement: how busy each thread was per step and how stale the samples were
    "async_busy": ("async/", "async: busy (producers) / idle (trainer) fraction per step", "_frac"),
    "async_staleness": ("async/staleness_", "async: weight versions behind the trainer"),
    "loss": ("loss", "loss"),
    # MOPD: (student − SFT) / (expert − SFT) per domain at each mid-training eval
    "recovery": ("recovery/", "recovery per domain (student − SFT) / (expert − SFT)"),
}


def plot_metrics(rows: list[dict], out_dir: str | Path) -> list[Path]:
    """PNG line plots of the step metrics present: reward per domain, teacher token fraction, reverse KL and
    scoring seconds per teacher, memory held per phase, loss. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for fname, (key, title, *suffix) in _PLOTS.items():
        end = suffix[0] if suffix else ""
        keys = sorted({k for r in rows for k in r if (k.startswith(key) and k.endswith(end) if key.endswith("/")
                                                      else k == key) and _finite(r[k])})
        if not keys:
            continue
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for k in keys:
            pts = [(r.get("step", i), r[k]) for i, r in enumerate(rows) if _finite(r.get(k))]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 30 else None,
                    label=k.removeprefix(key).removesuffix(end) or k)
        ax.set_xlabel("step")
        ax.set_title(title)
        if len(keys) > 1 or key.endswith("/"):
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{fname}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def log_plots(run_id: str, paths: Iterable[Path], uri: str | None = None) -> None:
    for p in paths:
        log_artifact(run_id, p, "plots", uri)


# ---------------------------------------------------------------- models and references


def registered_name(recipe_name: str, stage: str) -> str:
    """`<recipe>-sft`, `<recipe>-expert-<domain>`, `<recipe>-student`."""
    return f"{recipe_name}-{stage}"


def log_model(run_id: str, model_dir: str | Path, name: str, tags: Mapping[str, Any] | None = None,
              aliases: Iterable[str] = (), uri: str | None = None) -> str:
    """Log a checkpoint dir as the run's `model` artifacts and register it as a new version of `name` whose
    tags carry the lineage. Returns `models:/name/version`."""
    from mlflow.exceptions import MlflowException

    c = client(uri)
    with _LOCK:
        c.log_artifacts(run_id, str(model_dir), "model")
        try:
            c.create_registered_model(name, tags={"mopd.kind": "checkpoint"})
        except MlflowException as e:
            if "already exists" not in str(e) and "RESOURCE_ALREADY_EXISTS" not in str(e):
                raise
        src = f"{c.get_run(run_id).info.artifact_uri.rstrip('/')}/model"
        mv = c.create_model_version(name, source=src, run_id=run_id,
                                    tags={k: str(v) for k, v in (tags or {}).items()})
        for a in aliases:
            c.set_registered_model_alias(name, a, mv.version)
    return f"models:/{name}/{mv.version}"


def is_model_uri(ref: str) -> bool:
    return str(ref).startswith("models:/")


def parse_model_uri(ref: str) -> tuple[str, str | None, str | None]:
    """models:/name/3 → (name, "3", None); models:/name@alias → (name, None, alias)."""
    body = str(ref).removeprefix("models:/").strip("/")
    if "@" in body:
        name, alias = body.rsplit("@", 1)
        return name, None, alias
    if "/" in body:
        name, version = body.rsplit("/", 1)
        return name, version, None
    raise ModelRefError(f"model reference '{ref}': expected models:/<name>/<version> or models:/<name>@<alias>")


def model_version(ref: str, uri: str | None = None):
    """The ModelVersion a `models:/` reference names (alias or `latest` resolved); ModelRefError if none."""
    from mlflow.exceptions import MlflowException

    name, version, alias = parse_model_uri(ref)
    c = client(uri)
    try:
        if alias:
            return c.get_model_version_by_alias(name, alias)
        if version == "latest":
            vs = c.search_model_versions(f"name='{name}'")
            if not vs:
                raise ModelRefError(f"model reference '{ref}': registered model '{name}' has no versions")
            return max(vs, key=lambda v: int(v.version))
        return c.get_model_version(name, version)
    except MlflowException as e:
        raise ModelRefError(f"model reference '{ref}' does not exist in {uri or tracking_uri()}: "
                            f"{str(e).splitlines()[0]}") from None


def alias_version(name: str, alias: str, uri: str | None = None) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        return client(uri).get_model_version_by_alias(name, alias).version
    except MlflowException:
        return None


def set_alias(name: str, alias: str, version: str, uri: str | None = None) -> None:
    with _LOCK:
        client(uri).set_registered_model_alias(name, alias, str(version))


def canonical_ref(ref: str, uri: str | None = None) -> str:
    """`models:/name@alias` → `models:/name/<version>`; a checkpoint dir → its absolute path. Checks that it
    exists (ModelRefError naming the reference otherwise) without downloading anything."""
    if is_model_uri(ref):
        mv = model_version(ref, uri)
        return f"models:/{mv.name}/{mv.version}"
    p = Path(ref).expanduser()
    if not p.is_dir():
        raise ModelRefError(f"model reference '{ref}' is neither a models:/ URI nor an existing checkpoint dir")
    if not (p / "config.json").exists():
        raise ModelRefError(f"model reference '{ref}': {p} has no config.json — not a checkpoint dir")
    return str(p.resolve())


def resolve_model_ref(ref: str, cache_dir: str | Path, uri: str | None = None) -> tuple[Path, str]:
    """A model reference → (local checkpoint dir, canonical reference). Registry versions are downloaded once
    into `cache_dir/<name>/v<version>` (reused afterwards)."""
    canon = canonical_ref(ref, uri)
    if not is_model_uri(canon):
        return Path(canon), canon
    import mlflow.artifacts

    name, version, _ = parse_model_uri(canon)
    dest = Path(cache_dir) / name / f"v{version}"
    if (dest / "config.json").exists():
        return dest, canon
    mv = model_version(canon, uri)
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir(parents=True)
    got = Path(mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(tmp),
                                                   tracking_uri=uri or tracking_uri()))
    if not (got / "config.json").exists():
        raise ModelRefError(f"model reference '{ref}': its artifacts ({mv.source}) hold no config.json")
    import shutil

    if not dest.exists():  # else downloaded concurrently
        got.rename(dest)
    shutil.rmtree(tmp, ignore_errors=True)
    return dest, canon


def lineage(ref: str, uri: str | None = None, _depth: int = 0) -> dict:
    """Walk a registered model version back through its `input.*` tags:
    {"ref": "models:/t-student/1", "run_id": …, "inputs": {"init": {...}, "teacher.math": {...}}}."""
    node: dict[str, Any] = {"ref": ref, "inputs": {}}
    if not is_model_uri(ref) or _depth > 8:
        return node
    mv = model_version(ref, uri)
    node.update(ref=f"models:/{mv.name}/{mv.version}", run_id=mv.run_id, tags=dict(mv.tags))
    for k, v in sorted(mv.tags.items()):
        if k.startswith(INPUT_TAG_PREFIX):
            node["inputs"][k.removeprefix(INPUT_TAG_PREFIX)] = lineage(v, uri, _depth + 1)
    return node


# ---------------------------------------------------------------- stale runs, champion


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (killed child not yet reaped) is dead too
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


def reap_stale_runs(experiment: str, is_alive: Callable[[Any], bool | None] | None = None,
                    uri: str | None = None) -> list[str]:
    """Mark KILLED every RUNNING run of the experiment whose process is gone: `is_alive(run)` decides when it
    returns a bool (e.g. from the orchestrator's state); otherwise a run started on this host whose pid no longer
    exists is dead. Returns the ids it closed."""
    c = client(uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return []
    host = socket.gethostname()
    closed = []
    for run in c.search_runs([exp.experiment_id], "attributes.status = 'RUNNING'", max_results=1000):
        alive = is_alive(run) if is_alive else None
        if alive is None:
            tags = run.data.tags
            if tags.get("mopd.host") != host or not tags.get("mopd.pid", "").isdigit():
                continue
            alive = int(tags["mopd.pid"]) != os.getpid() and _pid_alive(int(tags["mopd.pid"]))
            if int(tags["mopd.pid"]) == os.getpid():
                alive = True
        if not alive:
            with _LOCK:
                c.set_tag(run.info.run_id, "mopd.killed", "process gone; closed by a later run")
                c.set_terminated(run.info.run_id, status="KILLED")
            closed.append(run.info.run_id)
    return closed


def champion_deltas(new: Mapping[str, float], champion: Mapping[str, float], tolerance: float
                    ) -> tuple[dict[str, float], list[str]]:
    """Per-domain accuracy deltas new − champion (fractions) and the domains that dropped by more than
    `tolerance`, as messages naming domain and delta."""
    deltas = {d: new[d] - champion[d] for d in new if d in champion}
    bad = [f"domain '{d}': {100 * new[d]:.1f}% vs champion {100 * champion[d]:.1f}% "
           f"(delta {100 * dv:+.1f} points, tolerance {100 * tolerance:.1f})"
           for d, dv in deltas.items() if dv < -tolerance - 1e-12]
    return deltas, bad


class MetricsTail:
    """Streams a stage's `metrics.jsonl` into a run while the stage trains (a background thread re-reads the
    file every `every_s` and logs the rows of steps not logged yet); `close()` logs the rest. Works with the
    engine's resume, which truncates the file to the checkpoint's step and appends."""

    def __init__(self, run_id: str, path: str | Path, every_s: float = 5.0, uri: str | None = None):
        self.run_id, self.path, self.every_s, self.uri = run_id, Path(path), every_s, uri
        self.logged_step = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"metrics-tail-{run_id[:8]}", daemon=True)
        self._thread.start()

    def _flush(self) -> None:
        rows = [r for r in read_metrics(self.path) if int(r.get("step", -1)) > self.logged_step]
        if rows:
            log_metric_rows(self.run_id, rows, uri=self.uri)
            self.logged_step = max(int(r.get("step", -1)) for r in rows)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self._flush()
            except Exception:  # noqa: BLE001 - a tracking hiccup must not kill training; close() retries
                pass

    def close(self) -> list[dict]:
        self._stop.set()
        self._thread.join(timeout=30)
        self._flush()
        return read_metrics(self.path)
