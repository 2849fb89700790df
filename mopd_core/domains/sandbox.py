"""Run untrusted Python (model completions) in a locked-down child process.

The boundary is bubblewrap (`isolation="bwrap"`, the default): a maintained setuid-free sandbox that gives the
child its own user, network, PID, mount, IPC and UTS namespaces, all capabilities dropped, `--die-with-parent`,
`--new-session` (no TIOCSTI on our terminal). Its file system is built from nothing: /usr (+ the merged-/usr
links) and the interpreter's prefix bound read-only, this file as the runner, a fresh /proc and /dev, an empty
read-only /tmp, and a 64 MiB tmpfs at /sandbox as cwd, HOME and TMPDIR — no /etc, no home, no checkout, no run
folders. The environment is cleared (bwrap itself also starts with the minimal one, so /proc/1/environ holds no
secret). A seccomp filter (libseccomp through `pyseccomp`, where installed) refuses fork/vfork/clone of a new
process, namespaces, ptrace, keyrings, BPF, io_uring and the like. The program runs as uid 65534 of its user
namespace (mapped to the caller's uid).

Second layer, inside the boundary (what was the whole sandbox before):
1. Resource limits (RLIMIT_CPU, AS, FSIZE, NOFILE, NPROC = 0, CORE = 0) and a parent-side wall-clock timeout that
   SIGKILLs the PID namespace's init and the process group. Output lands in files the child cannot reopen, read
   back up to `max_output_bytes`; the run's config arrives through the fd of an unlinked file.
2. A Python audit hook installed before the user code: it refuses sockets, process creation and signals,
   ctypes, writes (and links/renames/chmods) outside the work dir, /proc, and the imports of the modules behind
   those (`_socket`, `_posixsubprocess`, `ctypes`, …). In test mode it also refuses frame and gc introspection
   and signal handlers, so the program cannot read the harness's per-run nonce and forge test results.

`isolation="none"` is the explicit opt-out for hosts without user namespaces (`check_isolation` logs a warning
each time): the child then gets only what util-linux `unshare` and a root caller can give (a dropped uid,
network/PID/mount namespaces where permitted) plus the second layer — not a security boundary, since audit
hooks are documented by Python as bypassable. `SandboxResult.layers` says which protections were active.

Remaining limits, stated plainly: assert-style tests run in the program's own process: a program written to
defeat them (e.g. objects whose `__eq__` is always True) can; run untrusted rewards through {input, output}
tests where that matters. The sandbox shares the host kernel (a kernel exploit is out of scope).

Platform: Linux (bubblewrap, POSIX resource limits).
"""

from __future__ import annotations

import os
import sys

# ============================ child side ====================================================================
# This file is also the child's entry script (`python -I -S -B sandbox.py --mopd-sandbox-runner cfg.json`).
# The code below runs before the rest of the module is even imported, with the standard library only, and
# must stay Python-3.8-compatible syntax (a system interpreter may run it).

_RUNNER_FLAG = "--mopd-sandbox-runner"
_SETUP_FAILED = 121

# Refused at import (the 'import' audit event) and purged from sys.modules before user code: the network, process
# creation without an audit event (_posixsubprocess), foreign calls, POSIX shared memory (bypasses `open`).
_BLOCKED_MODULES = frozenset({
    "_socket", "socket", "ssl", "_ssl", "asyncio", "_asyncio", "_posixsubprocess", "subprocess",
    "multiprocessing", "_multiprocessing", "pty", "ctypes", "_ctypes", "cffi", "_cffi_backend", "_posixshmem",
})
# Test mode also refuses signal handlers (a handler receives the interrupted frame).
_BLOCKED_MODULES_TESTS = _BLOCKED_MODULES | {"signal", "_signal"}
_DENY_EVENTS = frozenset({
    "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile",
    "os.kill", "os.killpg", "subprocess.Popen", "pty.spawn", "signal.pthread_kill", "resource.setrlimit",
    "resource.prlimit", "os.link", "os.symlink", "webbrowser.open", "sys.remote_exec",
})
_DENY_PREFIXES = ("socket.", "ctypes.", "http.client.", "urllib.", "ftplib.", "smtplib.", "poplib.", "imaplib.",
                  "nntplib.", "telnetlib.", "_winapi.", "winreg.", "msvcrt.")
# event -> (indices of path arguments, indices of dir_fd arguments)
_PATH_EVENTS = {
    "os.rename": ((0, 1), (2, 3)), "os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)),
    "os.mkdir": ((0,), (2,)), "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)), "os.truncate": ((0,), ()),
    "os.utime": ((0,), (3,)), "os.chflags": ((0,), ()), "os.lchflags": ((0,), ()), "os.setxattr": ((0,), ()),
    "os.removexattr": ((0,), ()),
}
# Test mode only: the ways to reach the harness's frames/objects (and so its nonce).
_INTROSPECTION_EVENTS = frozenset({
    "sys._getframe", "sys._getframemodulename", "sys._current_frames", "sys._current_exceptions",
    "sys.settrace", "sys.setprofile", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
})
_FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back", "f_locals", "f_globals"})


class _SandboxViolation(PermissionError):
    """Raised in the child by the audit hook."""


class _IntrospectionBlocked(AttributeError, ValueError):
    """Refused frame access; also an AttributeError/ValueError so that stdlib fallbacks (namedtuple, enum,
    typing all catch ValueError around sys._getframe) keep working."""


def _make_resolver():
    """A symlink-resolving abspath built only from functions captured now, so that a program that monkeypatches
    os / os.path / builtins cannot fool the audit hook."""
    _fspath, _lstat, _readlink, _getcwd = os.fspath, os.lstat, os.readlink, os.getcwd
    _isinstance, _int, _bytes = isinstance, int, bytes
    S_IFMT, S_IFLNK = 0o170000, 0o120000

    def resolve(p):
        if _isinstance(p, _int):
            return None
        p = _fspath(p)
        if _isinstance(p, _bytes):
            p = p.decode("utf-8", "surrogateescape")
        if not p.startswith("/"):
            p = _getcwd() + "/" + p
        todo = p.split("/")[::-1]
        out = []
        links = 0
        while todo:
            part = todo.pop()
            if part == "" or part == ".":
                continue
            if part == "..":
                if out:
                    out.pop()
                continue
            cur = "/" + "/".join(out + [part])
            try:
                mode = _lstat(cur).st_mode
            except:  # noqa: E722 - no name lookups in the hook path
                out.append(part)
                continue
            if mode & S_IFMT == S_IFLNK:
                links += 1
                if links > 40:
                    return cur
                target = _readlink(cur)
                if target.startswith("/"):
                    out = []
                todo.extend(target.split("/")[::-1])
            else:
                out.append(part)
        return "/" + "/".join(out)

    return resolve


def _make_hook(work, run_dir, readable, ctl, protect_frames):
    resolve = _make_resolver()
    _stat = os.stat
    _isinstance, _int, _str, _len = isinstance, int, str, len
    violation, introspection = _SandboxViolation, _IntrospectionBlocked
    blocked_modules = _BLOCKED_MODULES_TESTS if protect_frames else _BLOCKED_MODULES
    deny_events, deny_prefixes = _DENY_EVENTS, _DENY_PREFIXES
    path_events, intro_events, frame_attrs = dict(_PATH_EVENTS), _INTROSPECTION_EVENTS, _FRAME_ATTRS
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    no_dir_fd = (None, -1, -100)
    W, R = work + "/", run_dir + "/"
    readable = tuple(d + "/" for d in readable)  # inside run_dir: the interpreter bind mounts
    reported = set()

    def deny(event, what, cls=violation):
        if event not in reported:
            reported.add(event)
            ctl("blocked " + event)
        raise cls("sandbox: " + what + " is not allowed")

    def inside(r):
        return r == work or r.startswith(W)

    def check_path(event, p, write):
        r = resolve(p)
        if r is None:
            return
        if r == "/proc" or r.startswith("/proc/"):
            deny(event, event + " on " + r)
        if r.startswith(R) and not inside(r) and not (not write and r.startswith(readable)):
            deny(event, event + " on the sandbox's own files")
        if write and not inside(r) and r != "/dev/null":
            deny(event, event + " outside the sandbox dir (" + r + ")")
        return r

    def hook(event, args):
        if event == "open":
            path, mode, flags = args[0], args[1], args[2]
            if _isinstance(path, _int):
                return
            writing = ((_isinstance(mode, _str) and ("w" in mode or "a" in mode or "x" in mode or "+" in mode))
                       or (_isinstance(flags, _int) and flags & write_flags != 0))
            r = check_path("open", path, writing)
            if mode is None and r is not None and not inside(r):
                try:  # os.open of a directory outside: its fd would allow dir_fd-relative writes
                    is_dir = _stat(r).st_mode & 0o170000 == 0o040000
                except:  # noqa: E722
                    is_dir = False
                if is_dir:
                    deny("open", "os.open of a directory outside the sandbox dir (" + r + ")")
        elif event == "import":
            name = args[0]
            if _isinstance(name, _str) and name.split(".")[0] in blocked_modules:
                deny("import " + name, "import " + name)
        elif event in deny_events or event.startswith(deny_prefixes):
            deny(event, event)
        elif event in path_events:
            paths, dir_fds = path_events[event]
            for i in dir_fds:
                if i < _len(args) and args[i] not in no_dir_fd:
                    deny(event, event + " with dir_fd")
            for i in paths:
                if i < _len(args):
                    check_path(event, args[i], True)
        elif protect_frames:
            if event in intro_events:
                deny(event, event, introspection)
            elif event == "object.__getattr__" and _len(args) > 1 and args[1] in frame_attrs:
                deny("frame access", "frame access (" + _str(args[1]) + ")", introspection)

    return hook


def _runner_mounts(cfg):
    """In the child's private mount namespace, as (namespace) root: read-only world-writable dirs, a tmpfs work
    dir, and the interpreter's prefix bind-mounted where the dropped uid can read it. Returns the path map."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384

    def mount(src, tgt, fstype, flags, data=None):
        enc = lambda s: None if s is None else s.encode()  # noqa: E731
        if libc.mount(enc(src), enc(tgt), enc(fstype), flags, enc(data)) != 0:
            e = ctypes.get_errno()
            raise OSError(e, "mount %s: %s" % (tgt, os.strerror(e)))

    def bind_ro(src, tgt, noexec):
        mount(src, tgt, None, MS_BIND | MS_REC)
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
        try:
            mount(None, tgt, None, flags | (MS_NOEXEC if noexec else 0))
        except OSError:  # a locked noexec inherited from the parent namespace must be kept
            mount(None, tgt, None, flags | MS_NOEXEC)

    for d in cfg["ro_dirs"]:
        bind_ro(d, d, noexec=False)
    opts = "size=%dm,nr_inodes=2048,mode=0700" % cfg["work_mb"]
    if cfg["drop"]:
        opts += ",uid=%d,gid=%d" % tuple(cfg["drop"])
    mount("tmpfs", cfg["work"], "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, opts)
    path_map = []
    if cfg["remap"]:
        prefixes = sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)})
        for prefix, mnt in zip(prefixes, cfg["mountpoints"]):
            bind_ro(prefix, mnt, noexec=False)
            path_map.append((prefix, mnt))
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith("ctypes.") or m == "_ctypes"]:
        del sys.modules[name]
    return path_map


def _runner_remap(path_map):
    def remap(p):
        for old, new in path_map:
            if isinstance(p, str) and (p == old or p.startswith(old + "/")):
                return new + p[len(old):]
        return p

    sys.path[:] = [remap(p) for p in sys.path]
    for m in list(sys.modules.values()):
        path = getattr(m, "__path__", None)
        if isinstance(path, list):
            path[:] = [remap(p) for p in path]
    sys.path_importer_cache.clear()


def _runner_setup(cfg):
    import resource

    work, drop = cfg["work"], cfg["drop"]
    path_map = _runner_mounts(cfg) if cfg["mounts"] else []
    main_py = os.path.join(work, "main.py")  # a readable copy, for tracebacks
    with open(main_py, "w", encoding="utf-8") as f:
        f.write(cfg["code"])
    if drop:
        os.chown(main_py, drop[0], drop[1])
    for name, soft, hard in cfg["rlimits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if drop:
        uid, gid = drop
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        if (os.getuid(), os.geteuid(), os.getgid(), os.getegid()) != (uid, uid, gid, gid):
            raise RuntimeError("privilege drop to %d:%d did not take" % (uid, gid))
        try:
            os.setuid(0)
        except PermissionError:
            pass
        else:
            raise RuntimeError("root could be regained after the privilege drop")
    os.chdir(work)
    os.environ.pop("PWD", None)  # bwrap --chdir sets it; the program's environment stays the minimal one
    if path_map:
        _runner_remap(path_map)


def _runner_read_cfg(fd):
    """The run's config from the inherited fd of an already unlinked file (nothing on disk to read back)."""
    import json

    chunks = []
    while True:
        b = os.read(fd, 1 << 16)
        if not b:
            break
        chunks.append(b)
    os.close(fd)
    cfg = json.loads(b"".join(chunks).decode("utf-8"))
    for extra in cfg.get("close_fds") or ():  # e.g. bwrap's seccomp pipe
        try:
            os.close(extra)
        except OSError:
            pass
    return cfg


def _runner_main(cfg_fd):
    _write = os.write
    try:
        cfg = _runner_read_cfg(int(cfg_fd))
        nonce, ctl_fd = cfg.pop("nonce"), cfg["ctl_fd"]
    except BaseException as e:
        _write(2, ("mopd sandbox: cannot read its config: %r\n" % (e,)).encode())
        os._exit(_SETUP_FAILED)

    def ctl(msg):
        try:
            _write(ctl_fd, (nonce + " " + msg + "\n").encode("utf-8", "replace"))
        except:  # noqa: E722 - no name lookups after user code ran
            pass

    try:
        _runner_setup(cfg)
        import builtins
        import collections  # noqa: F401  - pre-imported: the hook would refuse what their import does
        import functools  # noqa: F401
        import types

        code, tests, mode = cfg["code"], tuple(cfg.get("tests") or ()), cfg["mode"]
        blocked = _BLOCKED_MODULES_TESTS if mode == "tests" else _BLOCKED_MODULES
        for name in list(sys.modules):
            if name.split(".")[0] in blocked:
                del sys.modules[name]
        mod = types.ModuleType("__main__")
        mod.__file__ = "main.py"
        mod.__builtins__ = builtins
        if cfg["audit"]:
            sys.addaudithook(_make_hook(cfg["work_real"], cfg["run_dir"], cfg["mountpoints"], ctl,
                                        mode == "tests"))
    except BaseException as e:
        _write(2, ("mopd sandbox: setup failed: %s: %s\n" % (type(e).__name__, e)).encode())
        os._exit(_SETUP_FAILED)

    sys.modules["__main__"] = mod
    sys.argv[:] = ["main.py"]
    cfg = None
    if mode == "script":
        ctl("started")
        try:
            exec(compile(code, "main.py", "exec"), mod.__dict__)
        except SystemExit:
            raise
        except BaseException as e:  # noqa: BLE001 - print it without this runner's frame, exit 1 like python
            tb = e.__traceback__
            if tb is not None and tb.tb_next is not None:
                tb = tb.tb_next
                e.__traceback__ = tb
            sys.__excepthook__(type(e), e, tb)
            raise SystemExit(1) from None
        return

    # test mode: run the program, then each assert in its namespace; report through the nonce'd control fd.
    # Only locals from here on: the program may have replaced builtins.
    _exec, _compile, _range, _excepthook, _exit = exec, compile, range, sys.__excepthook__, os._exit
    _out, _err = sys.__stdout__, sys.__stderr__
    ns = mod.__dict__
    n = len(tests)

    def report(e):
        try:
            tb = e.__traceback__
            if tb is not None and tb.tb_next is not None:
                tb = e.__traceback__ = tb.tb_next  # without this runner's frame
            _excepthook(type(e), e, tb)
        except:  # noqa: E722
            pass

    ctl("started")
    try:
        _exec(_compile(code, "main.py", "exec"), ns)
    except BaseException as e:  # noqa: BLE001 - SystemExit too: the tests still run (and fail)
        report(e)
    for i in _range(n):
        ok = False
        try:
            _exec(_compile(tests[i], "<test %d>" % i, "exec"), ns)
            ok = True
        except BaseException as e:  # noqa: BLE001
            report(e)
        ctl("test %d %d" % (i, 1 if ok else 0))
    ctl("done")
    for stream in (_out, _err):
        try:
            stream.flush()
        except:  # noqa: E722
            pass
    _exit(0)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == _RUNNER_FLAG:
    _runner_main(sys.argv[2])
    sys.exit(0)

# ============================ parent side ===================================================================

import errno  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import secrets  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import stat  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Sequence  # noqa: E402

_NOBODY = 65534
_RUNNER_PATH = os.path.abspath(__file__)
log = logging.getLogger("mopd")


class SandboxError(RuntimeError):
    """The sandbox cannot be set up on this host (never raised for what the code itself does)."""


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run.

    ok: exited 0 within the time limit. killed_reason: "timeout", "cpu_limit", "output_limit" (output cut at
    max_output_bytes, or the FSIZE limit hit), "signal <NAME>" or None. blocked: audit-hook refusals (event names).
    layers: the protections that were active. pid: the child's pid = its process-group/session id.
    """

    ok: bool
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    killed_reason: str | None
    wall_s: float
    truncated: bool = False
    blocked: tuple[str, ...] = ()
    layers: tuple[str, ...] = ()
    pid: int | None = None


@dataclass(frozen=True)
class TestRunResult:
    """Per-test outcome of `run_python_tests` (a test that never reported counts as failed)."""

    __test__ = False  # not a pytest class

    passed: tuple[bool, ...]
    result: SandboxResult

    @property
    def fraction(self) -> float:
        return sum(self.passed) / len(self.passed) if self.passed else 0.0


@dataclass(frozen=True)
class _Plan:
    prefix: tuple[str, ...]  # bwrap/unshare argv (empty: no namespaces)
    interpreter: str
    mounts: bool
    remap: bool
    drop: tuple[int, int] | None
    layers: tuple[str, ...]
    bwrap: bool = False  # the child sees the bwrap sandbox's own paths (work dir `_BWRAP_WORK`)
    seccomp: bytes | None = None  # BPF program bwrap loads before the interpreter starts (`--seccomp FD`)


ISOLATIONS = ("bwrap", "none")
_PLANS: dict[str, _Plan] = {}
_PLAN_LOCK = threading.Lock()
_BWRAP_WORK = "/sandbox"  # a size-capped private tmpfs: cwd, HOME and TMPDIR of the program (/tmp: empty, read-only)
_BWRAP_RUNNER = "/.mopd/sandbox.py"  # this file, the only part of the checkout bound into the sandbox
_BWRAP_TMP_MB = 64
_BWRAP_PATHS = ("/usr/bin/bwrap", "/bin/bwrap")  # besides $PATH (a cleared PATH in services)
_OPT_OUT = "or opt out per code domain with verifier_args {isolation: none} (no security boundary)"
_USERNS_FIX = ("bubblewrap needs user namespaces: enable them (sysctl -w user.max_user_namespaces=15000, and "
               "kernel.unprivileged_userns_clone=1 where that sysctl exists; in Docker --security-opt "
               "seccomp=unconfined), " + _OPT_OUT)
# Refused (EPERM) by the seccomp filter: new processes (threads stay allowed: clone with CLONE_THREAD), other
# namespaces, tracing other processes, kernel keyrings/modules/BPF, io_uring (its operations bypass seccomp).
_SECCOMP_DENY = (
    "fork", "vfork", "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp", "mount", "umount2",
    "pivot_root", "chroot", "unshare", "setns", "keyctl", "add_key", "request_key", "bpf", "perf_event_open",
    "userfaultfd", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
    "swapon", "swapoff", "acct", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "iopl", "ioperm",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "open_by_handle_at", "name_to_handle_at", "syslog",
    "quotactl", "move_pages", "migrate_pages", "mbind", "fanotify_init", "lookup_dcookie",
)
_CLONE_THREAD = 0x00010000


def _child_env(work: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "TMP": work, "TEMP": work,
            "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


def _seccomp_filter() -> bytes | None:
    """The seccomp BPF program, built with libseccomp (through pyseccomp, its ctypes binding) rather than by hand;
    None where libseccomp is missing (the other layers still hold; `layers` then lacks "seccomp")."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError, RuntimeError):
        return None
    f = sc.SyscallFilter(sc.ALLOW)
    for name in _SECCOMP_DENY:
        try:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        except (OSError, ValueError, RuntimeError):  # not a syscall of this architecture
            continue
    f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_THREAD, 0))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # its flags sit behind a pointer: glibc falls back to clone
    f.add_rule(sc.ERRNO(errno.EACCES), "socket", sc.Arg(0, sc.NE, socket.AF_UNIX))
    with tempfile.TemporaryFile() as t:
        f.export_bpf(t)
        t.seek(0)
        return t.read()


def _bwrap_system_binds(interpreter: str) -> list[str]:
    """Read-only: /usr (with the merged-/usr links or dirs), and the interpreter's prefix where it lies elsewhere
    (pyenv under /root, conda, /opt). Nothing else of the host: no /etc, no home, no checkout, no run folders."""
    out = ["--ro-bind", "/usr", "/usr"]
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(d):
            out += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            out += ["--ro-bind", d, d]
    roots: list[str] = []
    for p in (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.path.dirname(interpreter))):
        r = os.path.realpath(p)
        if r not in ("/", "/usr") and not r.startswith("/usr/") and r not in roots:
            roots.append(r)
    for r in roots:
        out += ["--ro-bind", r, r]
    return out


def _bwrap_plan(bwrap: str) -> _Plan:
    interpreter = os.path.realpath(os.environ.get("MOPD_SANDBOX_PYTHON") or sys.executable)
    helptext = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10).stdout
    argv = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--uid", str(_NOBODY), "--gid", str(_NOBODY), "--hostname", "sandbox"]
    if "--disable-userns" in helptext:  # bubblewrap >= 0.8: no nested user namespace (seccomp refuses it too)
        argv.append("--disable-userns")
    argv += _bwrap_system_binds(interpreter)
    argv += ["--ro-bind", _RUNNER_PATH, _BWRAP_RUNNER, "--proc", "/proc", "--dev", "/dev"]
    if "--size" in helptext:  # bubblewrap >= 0.7; older: the work dir's disk use is bounded by time x FSIZE only
        argv += ["--size", str(_BWRAP_TMP_MB << 20)]
    argv += ["--tmpfs", _BWRAP_WORK, "--dir", "/tmp",
             "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", _BWRAP_WORK, "--clearenv"]
    for k, v in _child_env(_BWRAP_WORK).items():
        argv += ["--setenv", k, v]
    bpf = _seccomp_filter()
    layers = ("bwrap", "userns", "netns", "pidns", "mountns", "ipcns", "cap-drop", "tmpfs", "rlimits", "audit",
              f"uid={_NOBODY}") + (("seccomp",) if bpf else ())
    return _Plan(tuple(argv), interpreter, mounts=False, remap=False, drop=None, layers=layers, bwrap=True,
                 seccomp=bpf)


def _nobody_ids() -> tuple[int, int]:
    try:
        import pwd

        pw = pwd.getpwnam("nobody")
        return pw.pw_uid, pw.pw_gid
    except (ImportError, KeyError):
        return _NOBODY, _NOBODY


def _readable_by(path: str, uid: int, gid: int) -> bool:
    """Whether `uid`/`gid` (no supplementary groups) can traverse to `path` and read/traverse it."""
    path = os.path.realpath(path)
    parts = path.split("/")
    for i in range(1, len(parts) + 1):
        d = "/".join(parts[:i]) or "/"
        try:
            st = os.stat(d)
        except OSError:
            return False
        shift = 6 if st.st_uid == uid else 3 if st.st_gid == gid else 0
        need = (stat.S_IXOTH | stat.S_IROTH) if i == len(parts) else stat.S_IXOTH
        if ((st.st_mode >> shift) & need) != need:
            return False
    return True


def _base_tmp(drop: tuple[int, int] | None) -> str:
    base = tempfile.gettempdir()
    if drop and not _readable_by(base, *drop):
        base = "/tmp"
    return base


def _ro_dirs() -> list[str]:
    out: list[str] = []
    for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue", tempfile.gettempdir()):
        r = os.path.realpath(d)
        if os.path.isdir(r) and r not in out and r != "/":
            out.append(r)
    return out


def _candidate_plans() -> list[_Plan]:
    """`isolation: none`: the best this host offers without bubblewrap (util-linux unshare, a dropped uid)."""
    root = os.geteuid() == 0
    drop = _nobody_ids() if root else None
    unshare = shutil.which("unshare") or next((p for p in ("/usr/bin/unshare", "/bin/unshare")
                                               if os.access(p, os.X_OK)), None)
    user = [] if root else ["--user", "--map-root-user"]
    own = os.path.realpath(sys.executable)
    own_ok = drop is None or _readable_by(os.path.dirname(os.__file__), *drop)
    interpreters = []
    for p in (os.environ.get("MOPD_SANDBOX_PYTHON"), own, "/usr/bin/python3", "/usr/local/bin/python3",
              shutil.which("python3")):
        if p and os.path.isfile(p) and os.path.realpath(p) not in interpreters:
            interpreters.append(os.path.realpath(p))
    plans = []
    base_layers = ("tmpdir", "rlimits", "audit") + ((f"uid={drop[0]}",) if drop else ())
    if unshare:
        full = (unshare, *user, "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc")
        layers = base_layers + ("netns", "pidns", "mountns")
        plans.append(_Plan(full, own, True, bool(drop) and not own_ok, drop, layers))
        for interp in interpreters:
            if interp != own or own_ok:
                plans.append(_Plan((unshare, *user, "--net"), interp, False, False, drop, base_layers + ("netns",)))
    for interp in interpreters:
        if interp != own or own_ok:
            plans.append(_Plan((), interp, False, False, drop, base_layers))
    return plans


_PROBE_CODE = "import math, heapq\nprint('mopd-sandbox-probe', math.isqrt(49), heapq.nsmallest(1, [3, 1]))\n"


def _probe(plan: _Plan) -> str | None:
    """None if `plan` runs a program, else why not (one line)."""
    try:
        r, _ = _execute(plan, _PROBE_CODE, mode="script", stdin="", tests=(), timeout_s=10.0, memory_mb=512,
                        max_output_bytes=4096, audit=True)
    except (SandboxError, OSError) as e:
        return str(e)
    if r.ok and "mopd-sandbox-probe 7 [1]" in r.stdout:
        return None
    return (r.stderr.strip().splitlines() or ["rc=" + str(r.returncode)])[-1][:200]


def _probe_bwrap() -> _Plan:
    bwrap = shutil.which("bwrap") or next((p for p in _BWRAP_PATHS if os.access(p, os.X_OK)), None)
    if bwrap is None:
        raise SandboxError("bubblewrap (bwrap) is not installed; model-written code runs inside it: apt-get install "
                           "-y bubblewrap (dnf/apk: bubblewrap), " + _OPT_OUT)
    plan = _bwrap_plan(bwrap)
    why = _probe(plan)
    if why is not None:
        raise SandboxError(f"bubblewrap cannot set up the sandbox here ({why}); {_USERNS_FIX}")
    return plan


def _probe_unshare() -> _Plan:
    tried = []
    for plan in _candidate_plans():
        why = _probe(plan)
        if why is None:
            return plan
        tried.append(f"{' '.join(plan.prefix[1:]) or 'no namespaces'} + {plan.interpreter}: {why}")
    raise SandboxError("no working sandbox configuration on this host (" + "; ".join(tried) + "); as root the "
                       "sandboxed interpreter must be readable by uid 65534: set MOPD_SANDBOX_PYTHON to a "
                       "world-readable python3, or allow `unshare --mount`")


def _get_plan(isolation: str = "bwrap") -> _Plan:
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {', '.join(ISOLATIONS)} (got {isolation!r})")
    plan = _PLANS.get(isolation)
    if plan is not None:
        return plan
    with _PLAN_LOCK:
        if isolation not in _PLANS:
            if sys.platform != "linux":
                raise SandboxError(f"the code sandbox needs Linux (namespaces, resource limits); this is "
                                   f"{sys.platform}")
            _PLANS[isolation] = _probe_bwrap() if isolation == "bwrap" else _probe_unshare()
        return _PLANS[isolation]


def sandbox_layers(isolation: str = "bwrap") -> tuple[str, ...]:
    """The protections this host supports (probes once per isolation; raises SandboxError if none works)."""
    return _get_plan(isolation).layers


def check_isolation(isolation: str = "bwrap") -> tuple[str, ...]:
    """Pre-flight of the code sandbox, before any stage: probes `isolation` once (SandboxError, one line naming
    the fix, where it cannot be set up) and warns on every call with `none` — the opt-out must stay visible in
    each stage's log. Returns the active layers."""
    layers = sandbox_layers(isolation)
    if isolation == "none":
        log.warning("code sandbox: isolation=none — model-written code runs WITHOUT the bubblewrap boundary "
                    "(only %s); use it only on hosts without user namespaces", ", ".join(layers))
    return layers


def run_sandboxed(code: str, *, stdin: str = "", timeout_s: float = 5.0, memory_mb: int = 512,
                  max_output_bytes: int = 65536, audit_hook: bool = True, isolation: str = "bwrap") -> SandboxResult:
    """Run `code` as a Python program (its `__main__`) in the sandbox; see the module docstring.

    `timeout_s` bounds the wall time of the whole child (start-up included); `memory_mb` its address space;
    stdout/stderr are cut at `max_output_bytes` each (then `truncated`). `audit_hook=False` leaves only the
    OS-level layers (for testing them); never use it for real rewards. `isolation`: "bwrap" (the boundary) or
    "none" (the explicit opt-out, see `check_isolation`).
    """
    _check_args(timeout_s, memory_mb, max_output_bytes)
    result, _ = _execute(_get_plan(isolation), code, mode="script", stdin=stdin, tests=(), timeout_s=timeout_s,
                         memory_mb=memory_mb, max_output_bytes=max_output_bytes, audit=audit_hook)
    return result


def run_python_tests(code: str, tests: Sequence[str], *, timeout_s: float = 5.0, memory_mb: int = 512,
                     max_output_bytes: int = 65536, isolation: str = "bwrap") -> TestRunResult:
    """Run `code`, then each test statement (e.g. "assert f(2) == 4") in its namespace, in one sandboxed process.

    Each test reports pass/fail through a control channel tagged with a per-run secret; tests the process never
    reached (it exited, hung or crashed first) count as failed.
    """
    _check_args(timeout_s, memory_mb, max_output_bytes)
    tests = tuple(tests)
    if not all(isinstance(t, str) for t in tests):
        raise TypeError("run_python_tests: tests must be strings (Python statements)")
    result, passed = _execute(_get_plan(isolation), code, mode="tests", stdin="", tests=tests, timeout_s=timeout_s,
                              memory_mb=memory_mb, max_output_bytes=max_output_bytes, audit=True)
    return TestRunResult(tuple(passed), result)


def _check_args(timeout_s: float, memory_mb: int, max_output_bytes: int) -> None:
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s <= 3600):
        raise ValueError(f"timeout_s must be in (0, 3600] (got {timeout_s!r})")
    if not (isinstance(memory_mb, int) and 32 <= memory_mb <= 1 << 20):
        raise ValueError(f"memory_mb must be an int >= 32 (got {memory_mb!r})")
    if not (isinstance(max_output_bytes, int) and max_output_bytes >= 0):
        raise ValueError(f"max_output_bytes must be an int >= 0 (got {max_output_bytes!r})")


def _read_capped(path: str, cap: int) -> tuple[bytes, bool]:
    try:
        with open(path, "rb") as f:
            data = f.read(cap + 1)
    except OSError:
        return b"", False
    return data[:cap], len(data) > cap


def _rlimits(timeout_s: float, memory_mb: int, max_output_bytes: int) -> list:
    cpu = max(1, math.ceil(timeout_s)) + 1
    fsize = max(max_output_bytes + 1, 1 << 16)
    return [("RLIMIT_CORE", 0, 0), ("RLIMIT_CPU", cpu, cpu + 1), ("RLIMIT_AS", memory_mb << 20, memory_mb << 20),
            ("RLIMIT_FSIZE", fsize, fsize), ("RLIMIT_NOFILE", 64, 64), ("RLIMIT_NPROC", 0, 0)]


def _prepare_run_dir(plan: _Plan, run_dir: str) -> tuple[str, list[str]]:
    """The host-side work dir (the child's, without bwrap) and the legacy interpreter mount points."""
    work = os.path.join(run_dir, "work")
    os.mkdir(work, 0o700)
    mountpoints = []
    if plan.remap:
        for i in range(2):
            mountpoints.append(os.path.join(run_dir, f"py{i}"))
            os.mkdir(mountpoints[-1], 0o755)
    if plan.drop:
        os.chmod(run_dir, 0o711)  # traversable, not listable; its files stay 0600 root
        os.chown(work, *plan.drop)
    return work, mountpoints


def _spawn(plan: _Plan, cfg: dict, run_dir: str, work: str, files: tuple, deadline: float
           ) -> tuple[subprocess.Popen, bool]:
    """Start the child (config through the fd of an unlinked file, bwrap's seccomp program through a pipe) and
    wait for it; returns the process and whether it timed out."""
    fin, fout, ferr, fctl = files
    prefix, keep = list(plan.prefix), [fctl.fileno()]
    if plan.seccomp:
        sec_r, sec_w = os.pipe()
        os.write(sec_w, plan.seccomp)
        os.close(sec_w)
        prefix += ["--seccomp", str(sec_r)]
        keep.append(sec_r)
        cfg["close_fds"] = [sec_r]
    cfg_path = os.path.join(run_dir, "cfg.json")
    fd = os.open(cfg_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    cfg_fd = os.open(cfg_path, os.O_RDONLY)
    os.unlink(cfg_path)
    keep.append(cfg_fd)
    runner = _BWRAP_RUNNER if plan.bwrap else _RUNNER_PATH
    argv = [*prefix, plan.interpreter, "-I", "-S", "-B", "-X", "utf8", runner, _RUNNER_FLAG, str(cfg_fd)]
    try:
        proc = subprocess.Popen(argv, stdin=fin, stdout=fout, stderr=ferr, cwd=work,
                                env=_child_env(cfg["work"]), pass_fds=tuple(keep), start_new_session=True,
                                close_fds=True)
    finally:
        for k in keep[1:]:
            os.close(k)
    return proc, _wait(proc, deadline, forks=plan.bwrap or "--fork" in plan.prefix)


def _parse_ctl(raw: bytes, nonce: str, n_tests: int) -> tuple[bool, list[str], list[bool]]:
    started, blocked, passed = False, [], [False] * n_tests
    for line in raw.decode("utf-8", "replace").splitlines():
        tag, _, msg = line.partition(" ")
        if tag != nonce:
            continue
        if msg == "started":
            started = True
        elif msg.startswith("blocked "):
            blocked.append(msg[len("blocked "):])
        elif msg.startswith("test "):
            parts = msg.split()
            if len(parts) == 3 and parts[1].isdigit() and int(parts[1]) < n_tests:
                passed[int(parts[1])] = parts[2] == "1"
    return started, blocked, passed


def _execute(plan: _Plan, code: str, *, mode: str, stdin: str, tests: tuple[str, ...], timeout_s: float,
             memory_mb: int, max_output_bytes: int, audit: bool) -> tuple[SandboxResult, list[bool]]:
    """One sandboxed run; returns the result and, in test mode, each test's outcome."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a str (got {type(code).__name__})")
    nonce = secrets.token_hex(16)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mopd-sbx-", dir=_base_tmp(plan.drop),
                                     ignore_cleanup_errors=True) as run_dir:
        run_dir = os.path.realpath(run_dir)
        work, mountpoints = _prepare_run_dir(plan, run_dir)
        paths = {k: os.path.join(run_dir, k) for k in ("stdin", "stdout", "stderr", "ctl")}
        with open(paths["stdin"], "w", encoding="utf-8") as f:
            f.write(stdin)
        with open(paths["stdin"], "rb") as fin, open(paths["stdout"], "wb") as fout, \
                open(paths["stderr"], "wb") as ferr, open(paths["ctl"], "wb") as fctl:
            inner = {"work": _BWRAP_WORK, "work_real": _BWRAP_WORK, "run_dir": os.path.dirname(_BWRAP_RUNNER)} \
                if plan.bwrap else {"work": work, "work_real": work, "run_dir": run_dir}
            cfg = {"nonce": nonce, "ctl_fd": fctl.fileno(), "code": code, "tests": list(tests), "mode": mode,
                   **inner, "drop": list(plan.drop) if plan.drop else None,
                   "rlimits": _rlimits(timeout_s, memory_mb, max_output_bytes), "mounts": plan.mounts,
                   "remap": plan.remap, "mountpoints": mountpoints, "ro_dirs": [] if plan.bwrap else _ro_dirs(),
                   "work_mb": 64, "audit": bool(audit)}
            proc, timed_out = _spawn(plan, cfg, run_dir, work, (fin, fout, ferr, fctl), t0 + timeout_s)
        wall = time.monotonic() - t0
        out, out_cut = _read_capped(paths["stdout"], max_output_bytes)
        err, err_cut = _read_capped(paths["stderr"], max_output_bytes)
        ctl_raw, _ = _read_capped(paths["ctl"], 1 << 20)
    rc = proc.returncode
    started, blocked, passed = _parse_ctl(ctl_raw, nonce, len(tests))
    if not started and not timed_out:  # never score a program 0 because the sandbox itself broke
        raise SandboxError(f"the sandbox failed to start (rc={rc}): "
                           f"{' | '.join(err.decode('utf-8', 'replace').strip().splitlines()[-3:])}")
    truncated = out_cut or err_cut
    reason = None
    if timed_out:
        reason = "timeout"
    elif rc is not None and rc < 0:
        reason = {signal.SIGXCPU: "cpu_limit", signal.SIGXFSZ: "output_limit"}.get(-rc) or _signal_name(-rc)
    elif truncated:
        reason = "output_limit"
    result = SandboxResult(
        ok=(rc == 0 and not timed_out), returncode=rc,
        stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"), timed_out=timed_out,
        killed_reason=reason, wall_s=wall, truncated=truncated, blocked=tuple(dict.fromkeys(blocked)),
        layers=plan.layers if audit else tuple(x for x in plan.layers if x != "audit"), pid=proc.pid)
    return result, passed


def _signal_name(sig: int) -> str:
    try:
        return f"signal {signal.Signals(sig).name}"
    except ValueError:
        return f"signal {sig}"


def _exited(pid: int) -> bool:
    """Whether child `pid` has exited, without reaping it (so its pid/pgid cannot be reused yet)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    if int(f.read().rsplit(b")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _wait(proc: subprocess.Popen, deadline: float, forks: bool) -> bool:
    """Wait for the child until `deadline`. On timeout kill it: with `unshare --fork` first the namespace's init
    (which takes every process of the PID namespace with it, and which unshare then reaps), so nothing is left
    as an orphan. Finally SIGKILL the whole process group before reaping the leader, so that the group id
    cannot have been reused in between."""
    timed_out = False
    delay = 0.001
    while not _exited(proc.pid):
        now = time.monotonic()
        if now >= deadline:
            timed_out = True
            break
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, 0.02)
    if timed_out and forks:
        for kid in _children(proc.pid):
            try:
                os.kill(kid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        until = time.monotonic() + 2.0
        while not _exited(proc.pid) and time.monotonic() < until:
            time.sleep(0.002)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    return timed_out
