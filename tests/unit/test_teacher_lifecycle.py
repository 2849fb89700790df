"""`mopd_core.teachers.lifecycle` without servers: the local backend builds in-process teachers through the
interface the loop and the phase scheduler use, a `TeacherSet` stops what it started even when releasing the
scorers fails, the manifest comes from wherever the teachers came from, and a wrong combination is one line
before anything loads."""

from __future__ import annotations

import json

import pytest

from mopd_core.config import ModelConfig
from mopd_core.models import build_tiny
from mopd_core.teachers import LocalTeacher, Teacher, TeacherError, TeacherRouter
from mopd_core.teachers import lifecycle as L
from mopd_core.serving import Supervisor
from mopd_core.teachers.http import HttpTeacher
from mopd_core.serving import VllmServers


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    small = ModelConfig(tiny={"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128})
    return build_tiny(small, tmp_path_factory.mktemp("m") / "tiny", seed=0)


def test_local_backend_builds_in_process_teachers(tiny_cfg, tiny_path):
    ts = L.open_teachers(tiny_cfg, {d: tiny_path for d in tiny_cfg.domain_names()}, tiny_path)
    with ts:
        assert ts.servers is None and ts.manifest() == {}
        assert set(ts.router.teachers) == set(tiny_cfg.domain_names())
        t = ts.router.teachers["math"]
        assert isinstance(t, LocalTeacher) and t.in_process and t.param_bytes > 0
        assert t.resident is (not tiny_cfg.teachers.offload)


def test_domain_routing_needs_a_teacher_per_domain_before_any_load(tiny_cfg, tmp_path):
    with pytest.raises(TeacherError, match="'code'"):  # the paths do not exist: nothing was loaded
        L.open_teachers(tiny_cfg, {"math": tmp_path / "nope", "if": tmp_path / "nope"}, tmp_path / "nope")


def test_endpoints_need_the_http_backend(tiny_cfg, tmp_path):
    with pytest.raises(TeacherError, match="teachers.backend=http"):
        L.open_teachers(tiny_cfg, {}, tmp_path, endpoints={"math": "http://127.0.0.1:1"})


class _Failing(Teacher):
    name = path = "x"
    stats: dict = {}

    def close(self) -> None:
        raise RuntimeError("client close failed")


class _Servers:
    stopped = False

    def stop(self) -> None:
        self.stopped = True


def test_a_teacher_set_stops_its_servers_even_when_closing_the_clients_fails():
    servers = _Servers()
    ts = L.TeacherSet(TeacherRouter({"x": _Failing()}), "http", servers=servers)
    with pytest.raises(RuntimeError, match="client close failed"):
        ts.close()
    assert servers.stopped


def test_manifest_of_every_source(tmp_path):
    assert L.manifest_of(None) == {} and L.manifest_of({}) == {}
    assert L.manifest_of({"math": "http://a", "code": {"url": "http://b", "model": "m"}}) == {
        "math": {"url": "http://a"}, "code": {"url": "http://b", "model": "m"}}
    p = tmp_path / "endpoints.json"
    p.write_text(json.dumps({"math": {"url": "http://a", "pid": 7}}))
    assert L.manifest_of(p) == L.manifest_of(str(p)) == {"math": {"url": "http://a", "pid": 7}}
    ts = L.TeacherSet(TeacherRouter({"x": _Failing()}), "http", source=str(p))
    assert ts.manifest() == {"math": {"url": "http://a", "pid": 7}}


def test_the_interfaces_are_implemented():
    """The loop, the scheduler and the http client ask these classes, never probe them."""
    assert issubclass(LocalTeacher, Teacher) and issubclass(HttpTeacher, Teacher)
    assert issubclass(VllmServers, Supervisor)
    assert not HttpTeacher.in_process and HttpTeacher.param_bytes == 0
    for name in ("manifest", "url_of", "log_of", "is_dead", "is_hung", "kill_hung", "restart"):
        assert getattr(VllmServers, name) is not getattr(Supervisor, name), name
