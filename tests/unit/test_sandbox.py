"""The code sandbox against hostile programs. Every test checks the *effect* (no file, no connection, no process
left, the machine still answers), not just a non-zero exit; OS-level layers are also tested with the audit hook
off, where this host has them (`sandbox_layers()`)."""

from __future__ import annotations

import os
import socket
import sys
import time
import uuid

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")

from mopd_core.domains import Example, get_verifier  # noqa: E402
from mopd_core.domains.sandbox import run_python_tests, run_sandboxed, sandbox_layers  # noqa: E402

AUDIT = [pytest.param(True, id="audit"), pytest.param(False, id="os-layers-only")]


def _layers() -> tuple[str, ...]:
    return sandbox_layers()


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # a process of another uid in that group still exists
        return False
    return False


def _no_process_in_group(pgid: int) -> bool:
    """No process on the machine has process-group id `pgid` (scan /proc; also catches zombies)."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after "(comm)": state, ppid, pgrp, ...
            return False
    return True


def test_benign_program_prints_the_right_answer():
    r = run_sandboxed("import sys\nx = int(sys.stdin.readline())\nprint(sorted(str(x * 3)))\n", stdin="41\n")
    assert r.ok and not r.timed_out and r.killed_reason is None, r
    assert r.stdout == "['1', '2', '3']\n"
    assert r.blocked == ()


def test_the_program_runs_unprivileged_in_a_private_empty_dir():
    r = run_sandboxed("import os, tempfile\nprint(os.getuid(), os.listdir('.'), os.getcwd() == tempfile.gettempdir())\n"
                      "print(sorted(os.environ))")
    assert r.ok, r
    uid, rest = r.stdout.split(" ", 1)
    if os.geteuid() == 0:
        assert int(uid) != 0 and "uid=" + uid in r.layers  # dropped privileges
    assert rest.startswith("['main.py'] True")
    env = eval(r.stdout.splitlines()[1])  # noqa: S307 - our own output
    assert not {"PYTHONPATH", "MLFLOW_TRACKING_URI", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY"} & set(env)
    assert set(env) <= {"HOME", "LANG", "LC_ALL", "PATH", "TEMP", "TMP", "TMPDIR"}


def test_failing_program_is_not_ok_and_reports_its_error():
    r = run_sandboxed("def f():\n    return 1 / 0\nf()\n")
    assert not r.ok and r.returncode == 1 and not r.timed_out
    assert "ZeroDivisionError" in r.stderr and 'File "main.py", line 2' in r.stderr


@pytest.mark.parametrize("audit", AUDIT)
def test_infinite_loop_is_killed_at_the_timeout(audit):
    t0 = time.monotonic()
    r = run_sandboxed("while True:\n    pass\n", timeout_s=1.0, audit_hook=audit)
    assert time.monotonic() - t0 < 1.0 + 3.0
    assert r.timed_out and not r.ok and r.killed_reason == "timeout"
    assert _group_gone(r.pid) and _no_process_in_group(r.pid)


FORK_BOMB = """
import os
n = 0
while True:
    try:
        os.fork()
        n += 1
    except Exception as e:
        print(type(e).__name__, n, flush=True)
        break
"""

SPAWN_BOMB = """
import subprocess, sys
while True:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
"""

PERSISTENT_FORK_BOMB = """
import os
while True:
    try:
        os.fork()
    except BaseException:
        pass
"""


@pytest.mark.parametrize("audit", AUDIT)
@pytest.mark.parametrize("code", [FORK_BOMB, SPAWN_BOMB, PERSISTENT_FORK_BOMB], ids=["fork", "spawn", "persistent"])
def test_fork_bombs_are_contained(code, audit):
    t0 = time.monotonic()
    r = run_sandboxed(code, timeout_s=1.5, audit_hook=audit)
    assert time.monotonic() - t0 < 1.5 + 3.0
    if code is FORK_BOMB:  # it catches the error and reports how many forks succeeded
        assert r.stdout.split()[1:] == ["0"], r
        assert (r.blocked == ("os.fork",)) == audit
    else:
        assert not r.ok
    # nothing of it is left: not in its process group, not anywhere under its pid
    assert _group_gone(r.pid) and _no_process_in_group(r.pid)
    # and the machine still works: we can start a process, the sandbox still runs programs
    assert run_sandboxed("print(6 * 7)").stdout == "42\n"


def _write_attempts(targets: list[str]) -> str:
    lines = ["import os", "res = []"]
    for t in targets:
        lines += ["try:", f"    with open({t!r}, 'w') as f: f.write('pwned')", "    res.append('wrote')",
                  "except Exception as e:", "    res.append(type(e).__name__)",
                  "try:", f"    fd = os.open({t!r} + '.2', os.O_WRONLY | os.O_CREAT, 0o666)",
                  "    os.write(fd, b'pwned'); res.append('wrote')", "except Exception as e:",
                  "    res.append(type(e).__name__)"]
    lines.append("print(res)")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("audit", AUDIT)
def test_writes_outside_the_work_dir_do_not_happen(tmp_path, audit):
    if not audit and "mountns" not in _layers():
        pytest.skip("without a mount namespace, world-writable dirs are protected by the audit hook only")
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    for p in [tmp_path, *tmp_path.parents]:  # make the pytest dir reachable too, so permissions alone don't save us
        if str(p).startswith(("/tmp/", "/var/tmp/")) or str(p) in ("/tmp", "/var/tmp"):
            os.chmod(p, os.stat(p).st_mode | 0o001)
    targets = [str(open_dir / "evil.txt"), f"/tmp/mopd-evil-{uuid.uuid4().hex}"]
    if os.path.isdir("/var/tmp"):
        targets.append(f"/var/tmp/mopd-evil-{uuid.uuid4().hex}")
    if audit or any(x.startswith("uid=") for x in _layers()):  # our own files: permissions (dropped uid) or hook
        targets.append(os.path.abspath(f"mopd-evil-{uuid.uuid4().hex}.txt"))
    r = run_sandboxed(_write_attempts(targets), audit_hook=audit)
    assert r.ok, r
    assert ("open" in r.blocked) == audit  # with the hook on, the hook itself refused (not only the OS)
    assert "wrote" not in r.stdout, r.stdout
    for t in targets:
        assert not os.path.exists(t) and not os.path.exists(t + ".2"), t
    assert list(open_dir.iterdir()) == []


def test_escape_tricks_for_writing_are_refused(tmp_path):
    outside = f"/tmp/mopd-evil-{uuid.uuid4().hex}"
    code = f"""
import os, shutil
res = []
def attempt(name, fn):
    try:
        fn(); res.append(name + ':done')
    except Exception as e:
        res.append(name + ':' + type(e).__name__)
open('inside.txt', 'w').write('x')
attempt('symlink', lambda: os.symlink({outside!r}, 'link'))
attempt('rename', lambda: os.rename('inside.txt', {outside!r}))
attempt('copy', lambda: shutil.copy('inside.txt', {outside!r}))
attempt('dirfd', lambda: os.open('evil', os.O_WRONLY | os.O_CREAT, dir_fd=os.open('/tmp', os.O_RDONLY)))
attempt('mkdir', lambda: os.mkdir({outside!r}))
attempt('chdir', lambda: (os.chdir('/tmp'), open({os.path.basename(outside)!r}, 'w').write('x')))
print(res)
"""
    r = run_sandboxed(code)
    assert r.ok, r
    assert ":done" not in r.stdout, r.stdout
    assert {"os.symlink", "os.rename", "open", "os.mkdir"} <= set(r.blocked)  # refused by the hook itself
    assert not os.path.exists(outside) and not os.path.exists("/tmp/evil")


def test_monkeypatching_os_path_does_not_fool_the_hook():
    outside = f"/tmp/mopd-evil-{uuid.uuid4().hex}"
    code = (f"import os, posixpath\nhome = os.getcwd()\nfor m in (os.path, posixpath):\n"
            f"    m.realpath = m.abspath = m.normpath = lambda p: home + '/x'\n"
            f"os.getcwd = lambda: home\nopen({outside!r}, 'w').write('x')\n")
    r = run_sandboxed(code)
    assert not r.ok and r.blocked == ("open",), r  # the hook refused, not only the OS
    assert not os.path.exists(outside)


@pytest.mark.parametrize("audit", AUDIT)
def test_network_calls_never_reach_a_local_server(audit):
    if not audit and "netns" not in _layers():
        pytest.skip("no network namespace on this host: the audit hook is the only network guard")
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    code = f"""
import socket
res = []
for fn in (lambda: socket.create_connection(('127.0.0.1', {port}), timeout=1),
           lambda: socket.getaddrinfo('example.com', 80),
           lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', {port}))):
    try:
        fn(); res.append('connected')
    except Exception as e:
        res.append(type(e).__name__)
print(res)
"""
    try:
        r = run_sandboxed(code, timeout_s=5.0, audit_hook=audit)
        assert "connected" not in r.stdout, r
        if audit:
            assert not r.ok and "import socket" in r.blocked
        srv.setblocking(False)
        with pytest.raises(BlockingIOError):
            srv.accept()  # the server never saw a connection
    finally:
        srv.close()


@pytest.mark.parametrize("audit", AUDIT)
def test_memory_bomb_fails_inside_the_limit(audit):
    r = run_sandboxed("x = bytearray(2 * 1024 ** 3)\nprint('allocated', len(x))\n", memory_mb=256, audit_hook=audit)
    assert not r.ok and "allocated" not in r.stdout
    assert "MemoryError" in r.stderr
    r = run_sandboxed("blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 1024 ** 2))\n", memory_mb=256,
                      timeout_s=5.0, audit_hook=audit)
    assert not r.ok and not r.timed_out and "MemoryError" in r.stderr


def test_output_is_truncated_at_the_cap():
    r = run_sandboxed("import sys\nwhile True:\n    sys.stdout.write('y' * 4096)\n", max_output_bytes=1000,
                      timeout_s=3.0)
    assert len(r.stdout) == 1000 and r.truncated and r.killed_reason in ("output_limit", "timeout")
    assert not r.ok


def test_processes_signals_and_ctypes_are_refused():
    code = """
res = []
def attempt(name, fn):
    try:
        fn(); res.append(name + ':done')
    except Exception as e:
        res.append(name + ':' + type(e).__name__)
import os
attempt('system', lambda: os.system('touch /tmp/mopd-evil-system'))
attempt('kill', lambda: os.kill(1, 9))
attempt('exec', lambda: os.execv('/bin/sh', ['sh']))
attempt('ctypes', lambda: __import__('ctypes'))
attempt('posixsubprocess', lambda: __import__('_posixsubprocess'))
print(res)
"""
    r = run_sandboxed(code)
    assert r.ok and ":done" not in r.stdout, r
    assert {"os.system", "os.kill", "os.exec", "import ctypes", "import _posixsubprocess"} <= set(r.blocked)
    assert not os.path.exists("/tmp/mopd-evil-system")


# ---- test harness (assert-style tests) and the code_tests verifier -----------------------------------------

SQUARE_TESTS = ["assert f(2) == 4", "assert f(3) == 9", "assert f(0) == 0", "assert f(-1) == 1"]


def test_assert_tests_count_each_test():
    assert run_python_tests("def f(x):\n    return x * x\n", SQUARE_TESTS).passed == (True, True, True, True)
    assert run_python_tests("def f(x):\n    return x + x\n", SQUARE_TESTS).passed == (True, False, True, False)
    r = run_python_tests("def f(x):\n    while x == 3:\n        pass\n    return x * x\n", SQUARE_TESTS, timeout_s=1.0)
    assert r.passed == (True, False, False, False) and r.result.timed_out  # tests after a hang count as failed


FORGE = "\nfor i in range(4):\n    ctl('test %d 1' % i)\nimport os\nos._exit(0)\n"  # report all passed, skip the rest


@pytest.mark.parametrize("cheat", [
    "import sys\nsys.exit(0)",
    "import os\nos._exit(0)",
    "import os\nfor fd in range(3, 64):\n    try:\n"
    "        os.write(fd, b''.join(b'x test %d 1\\n' % i for i in range(4)))\n"
    "    except OSError:\n        pass\nos._exit(0)",
    "import sys\nctl = sys._getframe(1).f_locals['ctl']" + FORGE,
    "try:\n    1 / 0\nexcept ZeroDivisionError as e:\n"
    "    ctl = e.__traceback__.tb_frame.f_back.f_locals['ctl']" + FORGE,
    "import gc\nctl = [o for o in gc.get_objects() if getattr(o, '__name__', '') == 'ctl'][0]" + FORGE,
    "import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.compile = lambda *a, **k: None",
], ids=["sys.exit", "os._exit", "forged-lines", "getframe", "tb_frame", "gc", "patch-builtins"])
def test_programs_cannot_forge_test_results(cheat):
    r = run_python_tests(cheat + "\ndef f(x):\n    return -7\n", SQUARE_TESTS)
    assert r.passed == (False, False, False, False), r


def _code_example(tests) -> Example:
    return Example(prompt="Write f(x) returning x squared.", teacher_id="code", fields={"tests": tests})


def test_code_tests_verifier_reward_fraction():
    v = get_verifier("code_tests")
    ex = _code_example(SQUARE_TESTS)
    correct = "Here you go:\n```python\ndef f(x):\n    return x * x\n```\n"
    partial = "```python\ndef f(x):\n    return x + x\n```"
    hostile = ("```python\nimport os\nopen('/tmp/mopd-evil-verifier', 'w').write('x')\nwhile True:\n    os.fork()\n"
               "def f(x):\n    return x * x\n```")
    assert v(ex, correct) == 1.0
    assert v(ex, partial) == 0.5
    assert v(ex, hostile) == 0.0
    assert not os.path.exists("/tmp/mopd-evil-verifier")
    assert v.batch([ex, ex, ex], [correct, partial, hostile]) == [1.0, 0.5, 0.0]


def test_code_tests_verifier_with_stdin_stdout_cases():
    v = get_verifier("code_tests")
    ex = _code_example([{"input": "3 4\n", "output": "7\n"}, {"input": "10 -2\n", "output": "8"},
                        "assert add(1, 1) == 2"])
    good = "def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))\n"
    wrong = "def add(a, b):\n    return a * b\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))\n"
    assert v(ex, good) == 1.0
    assert v(ex, wrong) == 0.0  # 12, -20, and 1*1 != 2


def test_dataset_domain_with_code_tests_scores_through_the_sandbox(tmp_path):
    import json

    from mopd_core.domains import build_domain

    rows = [{"prompt": f"Write f(x) returning x*{k}.", "teacher_id": "py", "tests": [f"assert f(2) == {2 * k}",
                                                                                   f"assert f(5) == {5 * k}"]}
            for k in range(1, 11)]
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dom = build_domain("py", str(path), eval_size=2, verifier="code_tests")
    ev = dom.eval_examples()
    k = [int(e.prompt.split("*")[1].rstrip(".")) for e in ev]
    outs = [f"def f(x):\n    return x * {k[0]}\n", "def f(x):\n    return 10 if x == 2 else 0\n"]
    expected = [1.0, 0.5 if k[1] == 5 else 0.0]
    assert dom.rewards(ev, outs) == expected
