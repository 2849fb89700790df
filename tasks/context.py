"""What every task module shares about the Prefect run it runs in: the retry policy and the run's ids as MLflow
tags. Its own module so that `stages`, `teachers` and `runs` import it instead of each other."""

from __future__ import annotations

from prefect.context import get_run_context

from .common import retry_transient

RETRY = dict(retries=2, retry_delay_seconds=[10, 60], retry_condition_fn=retry_transient)


def prefect_tags() -> dict[str, str]:
    """The ids of the current Prefect task/flow run, as MLflow tags (empty outside a run)."""
    tags = {}
    try:
        ctx = get_run_context()
        tr = getattr(ctx, "task_run", None)  # lib: prefect 3 run context
        if tr is not None:
            tags["prefect.task_run_id"] = str(tr.id)
            tags["prefect.flow_run_id"] = str(tr.flow_run_id)
        fr = getattr(ctx, "flow_run", None)  # lib: prefect 3 run context
        if fr is not None:
            tags["prefect.flow_run_id"] = str(fr.id)
            tags["prefect.flow_run_name"] = fr.name
    except Exception:  # noqa: BLE001 - outside a run context (direct calls in tests)
        pass
    return tags
