"""The layer order (DESIGN §2, docs/architecture.md) as a test: every import of the package — top-level or inside
a function — is read with `ast` and checked against an explicit order, so a lower module that reaches up (the
`runtime ⇄ train` and `tasks.stages ⇄ tasks.teachers` cycles of the past) fails here naming both modules. The
tree also passes `ruff check` with the rules in pyproject.toml."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Engine layers, lowest first. A module may import its own layer and the ones below; never one above. Every module
# of mopd_core must be placed here (the longest matching prefix decides), so a new one is placed on purpose.
ENGINE_LAYERS: list[list[str]] = [
    ["mopd_core.errors", "mopd_core.config", "mopd_core.runtime"],  # runtime: the device layer + phase scheduler
    ["mopd_core.models", "mopd_core.domains"],
    ["mopd_core.rollout", "mopd_core.teachers", "mopd_core.algorithms", "mopd_core.weights", "mopd_core.evaluation"],
    ["mopd_core.stages"],  # what a stage is (plan, identity, folder record): below the code that runs one
    ["mopd_core.train"],
    ["mopd_core.distributed"],
    ["mopd_core.recipe", "mopd_core.preflight"],
    ["mopd_core.cli"],
]
FORBIDDEN_IN_ENGINE = ("tasks", "flows", "prefect", "mlflow")  # orchestration (MLflow lives in tasks/tracking.py)


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for p in sorted((ROOT / package).rglob("*.py")):
        parts = p.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


ALL = {**_modules("mopd_core"), **_modules("tasks"), **_modules("flows")}


def _imports(module: str, path: Path) -> set[str]:
    """Absolute names of every module `module` imports (`from pkg import sub` counts as `pkg.sub` when that
    is a module of ours)."""
    is_pkg = path.name == "__init__.py"
    pkg = module.split(".") if is_pkg else module.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = pkg[:len(pkg) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.add(sub if sub in ALL else mod)
    return out


def _layer(module: str) -> int:
    best, layer = "", None
    for i, names in enumerate(ENGINE_LAYERS):
        for n in names:
            if (module == n or module.startswith(n + ".")) and len(n) > len(best):
                best, layer = n, i
    if layer is None and module != "mopd_core":
        pytest.fail(f"{module} is in no layer of tests/unit/test_layers.py ENGINE_LAYERS — place it there")
    return layer if layer is not None else 0


def _top(name: str) -> str:
    return name.split(".")[0]


def test_every_engine_module_has_a_layer():
    for m in _modules("mopd_core"):
        _layer(m)


def test_the_engine_never_imports_orchestration():
    bad = [f"{m} imports {i}" for m, p in _modules("mopd_core").items() for i in sorted(_imports(m, p))
           if _top(i) in FORBIDDEN_IN_ENGINE]
    assert not bad, bad


def test_engine_imports_point_down_only():
    bad = []
    for m, p in _modules("mopd_core").items():
        for i in sorted(_imports(m, p)):
            if _top(i) == "mopd_core" and i != "mopd_core" and _layer(i) > _layer(m):
                bad.append(f"{m} (layer {_layer(m)}) imports {i} (layer {_layer(i)})")
    assert not bad, bad


def test_algorithms_import_no_other_engine_module():
    bad = [f"{m} imports {i}" for m, p in _modules("mopd_core").items() if m.startswith("mopd_core.algorithms")
           for i in sorted(_imports(m, p)) if _top(i) == "mopd_core" and not i.startswith("mopd_core.algorithms")]
    assert not bad, bad


def test_tasks_never_import_flows_and_tracking_never_imports_prefect():
    bad = [f"{m} imports {i}" for m, p in _modules("tasks").items() for i in sorted(_imports(m, p))
           if _top(i) == "flows"]
    bad += [f"tasks.tracking imports {i}" for i in sorted(_imports("tasks.tracking", ALL["tasks.tracking"]))
            if _top(i) == "prefect"]
    assert not bad, bad


def test_no_import_cycles_between_modules_of_tasks_and_flows():
    graph = {m: {i for i in _imports(m, p) if i in ALL and i != m and _top(i) in ("tasks", "flows")}
             for m, p in ALL.items() if _top(m) in ("tasks", "flows")}
    cycles = []

    def visit(m, stack):
        for n in sorted(graph.get(m, ())):
            if n in stack:
                cycles.append(" → ".join(stack[stack.index(n):] + [n]))
            elif len(stack) < len(graph):
                visit(n, stack + [n])

    for m in sorted(graph):
        visit(m, [m])
    assert not cycles, sorted(set(cycles))


def test_the_layer_check_sees_a_violation(tmp_path):
    """The checks above can fail: a lazy import of train inside a runtime function is found."""
    p = tmp_path / "phases.py"
    p.write_text("def f():\n    from ..train.loop import policy_update\n")
    found = _imports("mopd_core.runtime.phases", p)
    assert "mopd_core.train.loop" in found and _layer("mopd_core.train.loop") > _layer("mopd_core.runtime.phases")


def _ruff() -> list[str] | None:
    exe = Path(sys.executable).with_name("ruff")
    if exe.exists():
        return [str(exe)]
    return [shutil.which("ruff")] if shutil.which("ruff") else None


def test_ruff_check_passes():
    cmd = _ruff()
    if cmd is None:
        pytest.skip("ruff is not installed (it is in the dev extra: pip install -e '.[dev]')")
    p = subprocess.run([*cmd, "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
