"""What a client of a served model asks of the process that runs its server, and the error when a server is gone."""

from __future__ import annotations

from ..errors import InfraError


class ServerUnavailable(InfraError):
    """A server did not answer (after retries) — transient failures exhausted or the process died, its restarts
    spent. Infrastructure, not the user's input: Prefect retries the stage (it resumes). Teachers raise it under
    its public name `teachers.http.TeacherUnavailable`."""


class Supervisor:
    """What an `HttpTeacher` or a `ServedRollout` asks of the process that runs its server (`VllmServers`): whether
    the server died or hangs, and to kill or restart it (which may move it to another URL)."""

    def manifest(self) -> dict[str, dict]:
        raise NotImplementedError

    def url_of(self, teacher_id: str) -> str | None:
        raise NotImplementedError

    def log_of(self, teacher_id: str) -> str | None:
        raise NotImplementedError

    def is_dead(self, teacher_id: str) -> bool:
        raise NotImplementedError

    def is_hung(self, teacher_id: str, timeout_s: float = 10.0) -> bool:
        raise NotImplementedError

    def kill_hung(self, teacher_id: str) -> None:
        raise NotImplementedError

    def restart(self, teacher_id: str) -> str:
        """Start the server again; returns its URL."""
        raise NotImplementedError
