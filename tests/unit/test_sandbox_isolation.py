"""The sandbox's boundary is checked before any stage: a host where bubblewrap is missing or cannot create its
namespaces gets one line naming the fix (as the `code_tests` verifier's pre-flight `check_ready`, a
`DomainError`), and the explicit opt-out `isolation: none` runs but warns every time it is checked."""

from __future__ import annotations

import logging
import sys

import pytest

from mopd_core.domains import DomainError, get_verifier
from mopd_core.domains import sandbox as sbx
from mopd_core.errors import MopdError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")


@pytest.fixture
def fresh_plans(monkeypatch):
    """Probe again under the test's conditions, and keep the session's plans afterwards."""
    monkeypatch.setattr(sbx, "_PLANS", {})


def test_missing_bubblewrap_is_one_line_naming_the_install(fresh_plans, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on PATH
    monkeypatch.setattr(sbx, "_BWRAP_PATHS", (str(tmp_path / "bwrap"),))
    with pytest.raises(sbx.SandboxError) as e:
        sbx.check_isolation("bwrap")
    msg = str(e.value)
    assert "\n" not in msg and "apt-get install -y bubblewrap" in msg and "isolation: none" in msg
    with pytest.raises(DomainError) as e:  # what pre-flight sees (check_stage -> domains -> check_ready)
        get_verifier("code_tests").check_ready()
    assert isinstance(e.value, MopdError) and "\n" not in str(e.value)
    assert str(e.value).startswith("verifier code_tests cannot run here: bubblewrap (bwrap) is not installed")


def test_no_user_namespaces_names_the_sysctl_and_the_opt_out(fresh_plans, monkeypatch, tmp_path):
    # a stand-in bwrap that fails the way bubblewrap does where user namespaces are off
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --help ] && exit 0\n"
                    "echo 'bwrap: No permissions to creating new namespace, likely because the kernel does not "
                    "allow non-privileged user namespaces.' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(DomainError) as e:
        get_verifier("code_tests").check_ready()
    msg = str(e.value)
    assert "\n" not in msg and "No permissions to creating new namespace" in msg
    assert "user.max_user_namespaces" in msg and "isolation: none" in msg


def test_the_opt_out_runs_and_warns_at_every_check(caplog):
    v = get_verifier("code_tests", isolation="none")
    with caplog.at_level(logging.WARNING, logger="mopd"):
        v.check_ready()
        v.check_ready()  # a second stage: warned again
    warned = [r for r in caplog.records if "isolation=none" in r.getMessage()]
    assert len(warned) == 2 and "WITHOUT the bubblewrap boundary" in warned[0].getMessage()
    assert "bwrap" not in sbx.sandbox_layers("none")
    r = sbx.run_python_tests("def f(x):\n    return 2 * x\n", ["assert f(2) == 4", "assert f(2) == 5"],
                             isolation="none")
    assert r.passed == (True, False) and "bwrap" not in r.result.layers


def test_bad_isolation_value_is_a_one_line_domain_error():
    with pytest.raises(DomainError, match=r"isolation must be one of bwrap, none \(got 'docker'\)"):
        get_verifier("code_tests", isolation="docker")


def test_default_is_the_bubblewrap_boundary():
    layers = sbx.check_isolation()
    assert {"bwrap", "userns", "netns", "pidns", "mountns", "cap-drop", "rlimits", "audit"} <= set(layers)
    r = sbx.run_sandboxed("print(open('/proc/self/status').read().count('CapEff:\\t0000000000000000'))",
                          audit_hook=False)
    assert r.stdout == "1\n", r  # no capability left in the child


def test_recipe_refuses_before_any_stage_and_writes_nothing(fresh_plans, monkeypatch, tmp_path, capsys):
    from mopd_core.cli import main

    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setattr(sbx, "_BWRAP_PATHS", ())
    out = tmp_path / "runs"
    try:
        rc = main(["recipe", "--config", "real_mini", "--no-progress", "--set", f"output_dir={out}"])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: verifier code_tests cannot run here: bubblewrap (bwrap) is not installed")
    assert not out.exists()
