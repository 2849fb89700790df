"""Two families of errors, told apart by who can fix them.

`MopdError` — the user's input is wrong (config, data, model, teacher, stage folder, placement, a diverged run,
a full disk). The message is one line naming the field/file and the fix; the CLI prints `error: <message>` and
exits 2 (no traceback; `MOPD_TRACEBACK=1` shows it anyway); Prefect never retries it.

`InfraError` — infrastructure failed under a correct input (a teacher server died or stopped answering after its
restarts, a Ray worker was lost, the tracking store is unreachable). Prefect retries it (`tasks.common.
is_transient`); the CLI keeps its traceback, like every other exception (a plain `ValueError` from deep in a
library is a bug until shown otherwise).

    MopdError                               user-facing, exit 2, never retried
      ConfigError         config.ConfigError          bad preset/override/field, output_dir unusable
      DataError                                        bad dataset row/file, prompt over data.max_prompt_tokens
        DomainError       domains.DomainError          (a domain's source, params, rows)
      ModelError          models.ModelError            checkpoint dir: config.json, weights, tokenizer, context
      TeacherError        teachers.TeacherError        teacher config, routing, HTTP 4xx (TeacherRequestError),
                                                       unreachable endpoint at pre-flight
      StageStateError     train.checkpoint.StageStateError  stage folder ahead of the config
      PlacementError                                   device/memory/cluster cannot host the request
        ColocationError   runtime.phases.ColocationError
        ClusterError      distributed.cluster.ClusterError   (bad cluster.* input)
        RolloutBackendError  rollout.engines.RolloutBackendError
      TrainingDivergedError                            NaN/inf loss or gradient
        NonFiniteLossError   train.loop.NonFiniteLossError
      DiskFullError                                    ENOSPC before or while writing a checkpoint
    InfraError                              retried by Prefect, traceback at the CLI
      ServerUnavailable   serving.ServerUnavailable    a vLLM server died/hung/5xx after retries and restarts
                          (teachers raise it as teachers.http.TeacherUnavailable)
      WorkerLostError                                  a Ray worker died or never answered
      PipelineStalledError  runtime.staleness.PipelineStalledError  async: no samples within the timeout
      TrackingUnavailable                              the MLflow tracking store cannot be reached
    (neither: programming errors, kept as ValueError/RuntimeError — weights.buckets.BucketError,
     weights.transports.TransportError: their inputs come from our own code)

This module imports nothing from the package, so every layer may raise these.
"""

from __future__ import annotations


class MopdError(Exception):
    """A mistake in the user's input; the message is one line naming the field/file and the fix."""


class ConfigError(MopdError):
    """A bad configuration: the message is one line naming the field and the fix."""


class DataError(MopdError):
    """Bad data: names the source file (and row), the field and the fix."""


class ModelError(MopdError):
    """Bad model or tokenizer input; one line naming the path and the fix."""


class TeacherError(MopdError):
    """Bad teacher configuration (unknown id, tokenizer mismatch, a request the server rejects…); one line naming
    teacher and fix."""


class StageStateError(MopdError):
    """The stage folder does not fit the request; one line naming the folder and the fix."""


class PlacementError(MopdError):
    """The devices, memory or cluster cannot host what the config asks for; one line naming the field and fix."""


class TrainingDivergedError(MopdError):
    """Training produced a NaN/inf loss or gradient; the last good checkpoint is kept untouched."""


class DiskFullError(MopdError):
    """Not enough free disk for a checkpoint (found before training, or ENOSPC while writing one); the previous
    checkpoint and final/ are left intact."""


class InfraError(Exception):
    """Infrastructure failed under a correct input (server, worker, tracking store); Prefect retries it."""


class WorkerLostError(InfraError):
    """A Ray worker died or stopped answering."""


class TrackingUnavailable(InfraError):
    """The MLflow tracking store cannot be reached."""


def one_line(exc: BaseException) -> str:
    """The message as the CLI prints it: whitespace (newlines from a library's text) collapsed to one line."""
    return " ".join(str(exc).split()) or type(exc).__name__
