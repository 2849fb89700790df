"""The engine's shape as a test (docs/architecture.md): every import of the package — top-level or inside a
function — is read with `ast` and checked against an explicit layer order, so a lower module that reaches up fails
here naming both modules; no two modules (nor two packages of `mopd_core`) import each other, directly or round a
longer circle; and no `hasattr`/`getattr` probes an object of ours (give the interface the method or the field
instead). The checkers are plain functions over a source tree, so the tests at the bottom plant each violation in
a small fake package and expect it found. The tree also passes `ruff check` with the rules in pyproject.toml."""

from __future__ import annotations

import ast
import io
import re
import shutil
import subprocess
import sys
import tokenize
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Engine layers, lowest first. A module may import its own layer and the ones below; never one above. Every module
# of mopd_core must be placed here (the longest matching prefix decides), so a new one is placed on purpose.
ENGINE_LAYERS: list[list[str]] = [
    ["mopd_core.errors", "mopd_core.config", "mopd_core.runtime"],  # runtime: the device layer + phase scheduler
    ["mopd_core.models", "mopd_core.domains"],
    ["mopd_core.serving"],  # vLLM server processes: start, health, restart, stop — for teachers and the student
    ["mopd_core.rollout", "mopd_core.teachers", "mopd_core.algorithms", "mopd_core.weights", "mopd_core.evaluation"],
    ["mopd_core.stages"],  # what a stage is (plan, identity, folder record): below the code that runs one
    ["mopd_core.train"],
    ["mopd_core.distributed"],
    ["mopd_core.recipe", "mopd_core.preflight"],
    ["mopd_core.cli"],
]
FORBIDDEN_IN_ENGINE = ("tasks", "flows", "prefect", "mlflow")  # orchestration (MLflow lives in tasks/tracking.py)

# Violations other branches are removing while this check lands (helpers "stageplan": recipe/preflight/cli/tasks,
# "roles": train/weights). Each entry is reported as a failure once it is gone, so the list only shrinks: empty
# it as those branches merge. Circles: the set of modules; probes: (file, the call as `ast.unparse` writes it).
PENDING_CIRCLES: list[frozenset[str]] = []
PENDING_PROBES: list[tuple[str, str]] = []

# A `hasattr`/`getattr` is allowed only (a) on a module object — its first argument a name bound by an `import`
# statement of the file (`getattr(torch, dtype)`) or an `import_module(…)` call — or (b) when a comment on the
# call's lines says `lib: <library>` and, for a version check, the version (`# lib: transformers<4.50 has no …`):
# a library object whose shape we cannot declare. An object of ours never needs one: its class declares the field
# or the method.
ALLOW_COMMENT = re.compile(r"#.*\blib:\s*[A-Za-z]")
PROBES = ("getattr", "hasattr")


# -- the checkers (plain functions of a source tree, also run on planted trees below) -------------------------------

def modules(root: Path, package: str) -> dict[str, Path]:
    out = {}
    for p in sorted((root / package).rglob("*.py")):
        parts = p.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def imports_of(module: str, path: Path, known) -> set[str]:
    """Absolute names of every module `module` imports, at top level or inside a function (`from pkg import sub`
    counts as `pkg.sub` when that is a module in `known`)."""
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
                out.add(sub if sub in known else mod)
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    return {m: {i for i in imports_of(m, p, mods) if i in mods and i != m} for m, p in mods.items()}


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Every set of nodes that reach each other (strongly connected components of more than one node)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def package_graph(graph: dict[str, set[str]], depth: int = 2) -> dict[str, set[str]]:
    """The module graph seen from packages (`mopd_core.rollout.served` → `mopd_core.rollout`): two packages that
    import each other through any of their modules form a circle even when no two modules do."""
    def pkg(m):
        return ".".join(m.split(".")[:depth])

    out: dict[str, set[str]] = defaultdict(set)
    for a, bs in graph.items():
        out[pkg(a)].update(pkg(b) for b in bs if pkg(b) != pkg(a))
    return dict(out)


def describe(circle: frozenset[str], graph: dict[str, set[str]]) -> str:
    edges = [f"{a} → {b}" for a in sorted(circle) for b in sorted(graph.get(a, ())) if b in circle]
    return "{" + ", ".join(sorted(circle)) + "}: " + "; ".join(edges)


def _comments(src: str) -> dict[int, str]:
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string
    return out


def attr_probes(path: Path) -> list[tuple[int, str]]:
    """Every `hasattr`/`getattr` call of the file that is neither on an imported module nor marked `# lib: …`:
    (line, the call's source)."""
    src = path.read_text()
    tree = ast.parse(src, str(path))
    module_names = {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                    for a in n.names}
    comments = _comments(src)
    bad = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PROBES
                and node.args):
            continue
        first = node.args[0]
        if isinstance(first, ast.Name) and first.id in module_names:
            continue
        if isinstance(first, ast.Call) and ast.unparse(first.func).split(".")[-1] == "import_module":
            continue  # a module imported by name
        lines = range(node.lineno, (node.end_lineno or node.lineno) + 1)
        if any(ALLOW_COMMENT.search(comments.get(n, "")) for n in lines):
            continue
        bad.append((node.lineno, ast.unparse(node)))
    return sorted(bad)


def upward_imports(mods: dict[str, Path], layer_of) -> list[str]:
    bad = []
    for m, p in mods.items():
        for i in sorted(imports_of(m, p, mods)):
            if i in mods and i != m and layer_of(i) > layer_of(m):
                bad.append(f"{m} (layer {layer_of(m)}) imports {i} (layer {layer_of(i)})")
    return bad


def layer_in(layers: list[list[str]], module: str) -> int | None:
    best, layer = "", None
    for i, names in enumerate(layers):
        for n in names:
            if (module == n or module.startswith(n + ".")) and len(n) > len(best):
                best, layer = n, i
    return layer


# -- this repository ------------------------------------------------------------------------------------------------

ENGINE = modules(ROOT, "mopd_core")
ALL = {**ENGINE, **modules(ROOT, "tasks"), **modules(ROOT, "flows")}


def _layer(module: str) -> int:
    layer = layer_in(ENGINE_LAYERS, module)
    if layer is None and module != "mopd_core":
        pytest.fail(f"{module} is in no layer of tests/unit/test_layers.py ENGINE_LAYERS — place it there")
    return layer if layer is not None else 0


def _top(name: str) -> str:
    return name.split(".")[0]


def test_every_engine_module_has_a_layer():
    for m in ENGINE:
        _layer(m)


def test_the_engine_never_imports_orchestration():
    bad = [f"{m} imports {i}" for m, p in ENGINE.items() for i in sorted(imports_of(m, p, ALL))
           if _top(i) in FORBIDDEN_IN_ENGINE]
    assert not bad, bad


def test_engine_imports_point_down_only():
    bad = upward_imports({m: p for m, p in ENGINE.items() if m != "mopd_core"}, _layer)
    assert not bad, bad


def test_algorithms_import_no_other_engine_module():
    bad = [f"{m} imports {i}" for m, p in ENGINE.items() if m.startswith("mopd_core.algorithms")
           for i in sorted(imports_of(m, p, ALL))
           if _top(i) == "mopd_core" and not i.startswith("mopd_core.algorithms")]
    assert not bad, bad


def test_tasks_never_import_flows_and_tracking_never_imports_prefect():
    bad = [f"{m} imports {i}" for m, p in modules(ROOT, "tasks").items() for i in sorted(imports_of(m, p, ALL))
           if _top(i) == "flows"]
    bad += [f"tasks.tracking imports {i}" for i in sorted(imports_of("tasks.tracking", ALL["tasks.tracking"], ALL))
            if _top(i) == "prefect"]
    assert not bad, bad


def _found_circles() -> tuple[list[frozenset[str]], dict[str, set[str]]]:
    graph = import_graph(ALL)
    return circles(graph) + circles(package_graph(graph)), graph


def test_no_import_circles_counting_function_level_imports():
    """No module imports another that imports it back (directly or round a longer circle), with imports inside
    functions counted: a lazy import only hides a circle. Packages of the engine neither (`rollout` ⇄ `teachers`
    through any of their modules)."""
    found, graph = _found_circles()
    pkg = package_graph(graph)
    bad = [describe(c, graph if c in circles(graph) else pkg) for c in found if c not in PENDING_CIRCLES]
    assert not bad, "import circles: " + " | ".join(bad)


def test_no_hasattr_or_getattr_on_objects_of_ours():
    """An object of ours declares what it can do (a field, a method, a capability flag on its base class): asking
    `hasattr(teacher, "hidden")` hides the interface and breaks silently when a name changes. On a library's object
    a probe may stay with a comment naming the library (and the version, for a version check)."""
    found = [(str(p.relative_to(ROOT)), line, call) for p in ALL.values() for line, call in attr_probes(p)]
    bad = [f"{f}:{line}: {call}" for f, line, call in found if (f, call) not in PENDING_PROBES]
    assert not bad, "give the interface the method/field, or mark a library object `# lib: <library> <version>`: " \
        + "; ".join(bad)


def test_pending_lists_only_shrink():
    """Each allow-listed violation still exists; one that is gone must leave the list (so it cannot come back)."""
    found, _ = _found_circles()
    probes = {(str(p.relative_to(ROOT)), call) for p in ALL.values() for _, call in attr_probes(p)}
    gone = [sorted(c) for c in PENDING_CIRCLES if c not in found]
    gone += [e for e in PENDING_PROBES if e not in probes]
    assert not gone, f"fixed: remove these from tests/unit/test_layers.py PENDING_*: {gone}"


# -- the checkers can fail: each violation planted in a fake package -------------------------------------------------

def _tree(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return modules(root, "pkg")


def test_planted_function_level_circle_is_found(tmp_path):
    mods = _tree(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from . import b\n",
                            "pkg/b.py": "def f():\n    from .a import x\n", "pkg/c.py": "from .a import y\n"})
    assert circles(import_graph(mods)) == [frozenset({"pkg.a", "pkg.b"})]


def test_planted_longer_circle_and_package_circle_are_found(tmp_path):
    mods = _tree(tmp_path, {"pkg/__init__.py": "", "pkg/r/__init__.py": "", "pkg/t/__init__.py": "",
                            "pkg/r/served.py": "def f():\n    from ..t.serving import S\n",
                            "pkg/t/serving.py": "from ..t import score\n",
                            "pkg/t/score.py": "from ..r.batch import B\n", "pkg/r/batch.py": "",
                            "pkg/x.py": "from .y import a\n", "pkg/y.py": "from .z import a\n",
                            "pkg/z.py": "def g():\n    import pkg.x\n"})
    graph = import_graph(mods)
    assert circles(graph) == [frozenset({"pkg.x", "pkg.y", "pkg.z"})]  # no two modules of r and t import each other
    assert frozenset({"pkg.r", "pkg.t"}) in circles(package_graph(graph))  # but the packages do


def test_planted_upward_import_is_found(tmp_path):
    mods = _tree(tmp_path, {"pkg/__init__.py": "", "pkg/low.py": "def f():\n    from .high import g\n",
                            "pkg/high.py": "from .low import f\n"})
    layers = [["pkg.low"], ["pkg.high"]]
    assert upward_imports(mods, lambda m: layer_in(layers, m)) == ["pkg.low (layer 0) imports pkg.high (layer 1)"]


def test_planted_probe_on_our_object_is_found(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import torch\nimport vllm.envs as venv\nfrom .teachers import Teacher\n\n"
                 "def f(t: Teacher, worker, dtype):\n"
                 "    if hasattr(t, 'hidden'):\n"                                  # ours: found
                 "        return getattr(t,\n            'scores_any_ids', False)\n"  # ours, two lines: found
                 "    x = getattr(torch, dtype)\n"                                    # a module: allowed
                 "    y = getattr(venv, 'disable_envs_cache', None)\n"                # a module imported as: allowed
                 "    w = getattr(importlib.import_module('a.b'), 'C')\n"              # a module by name: allowed
                 "    z = getattr(worker, 'device', None)  # lib: vllm 0.11 worker\n"  # marked: allowed
                 "    return getattr(worker, 'model_runner')  # the worker\n")         # a comment without lib: found
    assert attr_probes(p) == [(6, "hasattr(t, 'hidden')"), (7, "getattr(t, 'scores_any_ids', False)"),
                              (13, "getattr(worker, 'model_runner')")]


def test_the_layer_check_sees_a_lazy_import_of_this_tree(tmp_path):
    """A lazy import of train inside a runtime function is found and placed above it."""
    p = tmp_path / "phases.py"
    p.write_text("def f():\n    from ..train.loop import policy_update\n")
    found = imports_of("mopd_core.runtime.phases", p, ALL)
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
