"""Serving: the vLLM OpenAI server processes the teachers (`teachers.backend: http`) and the student
(`rollout.backend: served`) talk to — started, health-checked, restarted and stopped by one supervisor
(`VllmServers`), registered while they run (`live`) — below both `teachers` and `rollout`, which only speak HTTP
to them."""

from .servers import (VllmServer, VllmServers, free_port, live, live_groups, port_free, required_max_model_len,
                      resolve_python)
from .supervisor import ServerUnavailable, Supervisor

__all__ = ["ServerUnavailable", "Supervisor", "VllmServer", "VllmServers", "free_port", "live", "live_groups",
           "port_free", "required_max_model_len", "resolve_python"]
