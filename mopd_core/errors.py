"""The errors a user can cause (bad config, data, model, teacher, stage folder, placement, diverged training).
The CLI prints them as one line and exits 2; everything else is a bug and keeps its traceback. A *plain*
ValueError/FileNotFoundError is treated as a user error too (many library checks raise them for bad input) but
may also be a bug deep in a library, so the CLI says how to see its traceback (`MOPD_TRACEBACK=1`)."""

from __future__ import annotations


def _collect() -> tuple[type[BaseException], ...]:
    from .config import ConfigError
    from .domains import DomainError
    from .models import ModelError
    from .rollout.engines import RolloutBackendError
    from .distributed.cluster import ClusterError
    from .runtime.phases import ColocationError
    from .teachers import TeacherError
    from .train.checkpoint import StageStateError
    from .train.loop import NonFiniteLossError
    from .weights.buckets import BucketError
    from .weights.plan import TransferPlanError

    return (ConfigError, DomainError, ModelError, TeacherError, StageStateError, NonFiniteLossError, ColocationError,
            ClusterError, RolloutBackendError, BucketError, TransferPlanError)


def __getattr__(name: str):
    if name == "NAMED_ERRORS":  # our own classes: always a message written for the user
        return _collect()
    if name == "USER_ERRORS":
        return _collect() + (ValueError, FileNotFoundError)
    raise AttributeError(name)
