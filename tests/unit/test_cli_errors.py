"""The CLI's error policy: our named user errors are one line (exit 2); a plain ValueError is one line plus how
to see its traceback; MOPD_TRACEBACK=1 and every other exception keep the traceback."""

from __future__ import annotations

import pytest

from mopd_core import cli
from mopd_core.runtime.phases import ColocationError


def _raise(exc):
    def run(args):
        raise exc
    return run


def test_named_user_error_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_run", _raise(ColocationError("runtime.placement=colocated: phase 'train' needs…")))
    monkeypatch.delenv("MOPD_TRACEBACK", raising=False)
    assert cli.main(["config", "show"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: runtime.placement=colocated: phase 'train' needs…"


def test_plain_value_error_says_how_to_see_the_traceback(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_run", _raise(ValueError("too many values to unpack")))
    monkeypatch.delenv("MOPD_TRACEBACK", raising=False)
    assert cli.main(["config", "show"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: too many values to unpack") and "MOPD_TRACEBACK=1" in err and "\n" not in err


def test_traceback_on_request_and_for_bugs(monkeypatch):
    monkeypatch.setattr(cli, "_run", _raise(ValueError("boom")))
    monkeypatch.setenv("MOPD_TRACEBACK", "1")
    with pytest.raises(ValueError, match="boom"):
        cli.main(["config", "show"])
    monkeypatch.delenv("MOPD_TRACEBACK")
    monkeypatch.setattr(cli, "_run", _raise(KeyError("bug")))
    with pytest.raises(KeyError):
        cli.main(["config", "show"])
