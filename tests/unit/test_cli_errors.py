"""The error policy: a `MopdError` (the user's input) is one line `error: …` and exit 2; anything else — a bug
(a plain ValueError from deep in the code), an infrastructure failure — keeps its traceback and exits 1.
Prefect retries `InfraError` and connection/timeout failures, never a `MopdError`."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mopd_core import cli
from mopd_core import errors as E
from mopd_core.runtime.phases import ColocationError

ROOT = Path(__file__).resolve().parents[2]


def _raise(exc):
    def run(args):
        raise exc
    return run


def _cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "mopd_core.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_user_error_is_one_line_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_run", _raise(ColocationError("runtime.placement=colocated: phase 'train' needs…")))
    monkeypatch.delenv("MOPD_TRACEBACK", raising=False)
    assert cli.main(["config", "show"]) == 2
    assert capsys.readouterr().err == "error: runtime.placement=colocated: phase 'train' needs…\n"


def test_user_error_message_with_newlines_is_still_one_line(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_run", _raise(E.ModelError("cannot load model:\n  header too small\n")))
    monkeypatch.delenv("MOPD_TRACEBACK", raising=False)
    assert cli.main(["config", "show"]) == 2
    assert capsys.readouterr().err == "error: cannot load model: header too small\n"


@pytest.mark.parametrize("exc", [ValueError("too many values to unpack"), KeyError("bug"),
                                 RuntimeError("CUDA error"), E.InfraError("tracking store down")])
def test_everything_else_keeps_its_traceback(monkeypatch, capsys, exc):
    """No catch-all: a plain ValueError is a bug until shown otherwise, an InfraError is no user mistake."""
    monkeypatch.setattr(cli, "_run", _raise(exc))
    monkeypatch.delenv("MOPD_TRACEBACK", raising=False)
    with pytest.raises(type(exc)) as e:
        cli.main(["config", "show"])
    assert e.value is exc and "error:" not in capsys.readouterr().err


def test_mopd_traceback_shows_it_for_user_errors_too(monkeypatch):
    err = E.ConfigError("mopd.steps: must be >= 0")
    monkeypatch.setattr(cli, "_run", _raise(err))
    monkeypatch.setenv("MOPD_TRACEBACK", "1")
    with pytest.raises(E.ConfigError) as e:
        cli.main(["config", "show"])
    assert e.value is err


def test_our_classes_are_in_their_family():
    from mopd_core.config import ConfigError
    from mopd_core.distributed.cluster import ClusterError
    from mopd_core.domains import DomainError
    from mopd_core.models import ModelError
    from mopd_core.rollout.engines import RolloutBackendError
    from mopd_core.teachers import TeacherError
    from mopd_core.teachers.http import TeacherRequestError, TeacherUnavailable
    from mopd_core.train.checkpoint import StageStateError
    from mopd_core.train.loop import NonFiniteLossError

    user = {ConfigError: E.ConfigError, DomainError: E.DataError, ModelError: E.ModelError,
            TeacherError: E.TeacherError, TeacherRequestError: E.TeacherError, StageStateError: E.StageStateError,
            ColocationError: E.PlacementError, ClusterError: E.PlacementError,
            RolloutBackendError: E.PlacementError, NonFiniteLossError: E.TrainingDivergedError,
            E.DiskFullError: E.MopdError}
    for cls, area in user.items():
        assert issubclass(cls, area) and issubclass(cls, E.MopdError), cls
        assert not issubclass(cls, (ValueError, E.InfraError)), cls  # a bare `except ValueError` never hides one
    for cls in (TeacherUnavailable, E.WorkerLostError, E.TrackingUnavailable):
        assert issubclass(cls, E.InfraError) and not issubclass(cls, E.MopdError), cls


def test_is_transient_retries_infra_never_user_errors():
    pytest.importorskip("prefect")
    from mopd_core.teachers.http import TeacherRequestError, TeacherUnavailable
    from tasks.common import ParameterError, is_transient

    retried = [TeacherUnavailable("teacher 'math' server died"), E.WorkerLostError("rank 1 gone"),
               E.TrackingUnavailable("mlflow down"), ConnectionRefusedError(), TimeoutError(),
               OSError(errno.ECONNRESET, "reset")]
    never = [E.ConfigError("x"), E.DataError("x"), E.ModelError("x"), TeacherRequestError("HTTP 400"),
             E.DiskFullError("disk full"), E.TrainingDivergedError("nan"), ParameterError("p"),
             OSError(errno.ENOSPC, "No space left on device"), PermissionError(errno.EACCES, "denied"),
             ValueError("a bug"), KeyError("a bug"), None]
    assert [is_transient(e) for e in retried] == [True] * len(retried)
    assert [is_transient(e) for e in never] == [False] * len(never)
    httpx = pytest.importorskip("httpx")
    assert is_transient(httpx.ConnectError("refused")) and is_transient(httpx.ReadTimeout("slow"))


def test_cli_subprocess_user_error_one_line_exit_2():
    p = _cli("stage", "eval", "--config", "tiny", "--teacher", "math=x")
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines()[-1] == ("error: --teacher is no option of `mopd stage eval` "
                                                 "(it takes --model)")
    assert "Traceback" not in p.stderr and len([ln for ln in p.stderr.splitlines() if ln.startswith("error:")]) == 1


@pytest.mark.parametrize("flag,value,needle", [
    ("--model", "sft", "--model 'sft' must look like NAME=PATH"),
    ("--model", "sft=", "--model 'sft=' must look like NAME=PATH"),
])
def test_bad_pairs_are_config_errors(monkeypatch, capsys, flag, value, needle):
    monkeypatch.delenv("MOPD_TRACEBACK", raising=False)
    assert cli.main(["stage", "eval", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {needle}") and err.count("\n") == 1


def test_deliberate_bug_inside_the_loop_prints_a_traceback(tmp_path):
    """Acceptance: a ValueError raised inside the training loop (a bug, not the user's input) reaches the
    terminal as a traceback with exit 1 — no `error:` line pretending it was a mistake of the user."""
    from mopd_core.config import load_config
    from mopd_core.models import build_tiny
    from tests.conftest import tiny_overrides

    cfg = load_config("tiny", tiny_overrides(tmp_path / "out"))
    init = build_tiny(cfg.model, tmp_path / "init")
    site = tmp_path / "site"
    site.mkdir()
    # the bug, injected into the child before the CLI runs: the first policy update raises
    (site / "sitecustomize.py").write_text(textwrap.dedent("""
        import mopd_core.train.update as update

        def policy_update(*args, **kwargs):
            raise ValueError("deliberate bug in the loop")

        update.policy_update = policy_update
    """))
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    sets = [a for o in tiny_overrides(tmp_path / "out") for a in ("--set", o)]
    p = _cli("stage", "expert", "--config", "tiny", *sets, "--no-progress", "--domain", "math", "--init", str(init),
             env=env)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback (most recent call last)" in p.stderr
    assert p.stderr.rstrip().endswith("ValueError: deliberate bug in the loop"), p.stderr[-2000:]
    assert "in run_policy_loop" in p.stderr  # the frames show where it was raised
    assert not any(ln.startswith("error:") for ln in p.stderr.splitlines())
