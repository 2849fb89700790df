"""The errors a user can cause (bad config, data, model, teacher, stage folder, diverged training). The CLI
prints them as one line and exits 2; everything else is a bug and keeps its traceback."""

from __future__ import annotations


def _collect() -> tuple[type[BaseException], ...]:
    from .config import ConfigError
    from .domains import DomainError
    from .models import ModelError
    from .teachers import TeacherError
    from .train.checkpoint import StageStateError
    from .train.loop import NonFiniteLossError

    return (ConfigError, DomainError, ModelError, TeacherError, StageStateError, NonFiniteLossError, ValueError,
            FileNotFoundError)



def __getattr__(name: str):
    if name == "USER_ERRORS":
        return _collect()
    raise AttributeError(name)
