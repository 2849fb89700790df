"""Progress of long stages: a rich bar on a terminal, periodic one-line logs otherwise (CI, Prefect logs)."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("mopd")

_SHOW = ("reward/mean", "reverse_kl", "loss", "perf/step_s")


def _summary(m: dict) -> str:
    parts = []
    for key in _SHOW:
        vals = [v for k, v in m.items() if k == key or k.startswith(key + "/")]
        if vals:
            parts.append(f"{key.split('/')[-1]}={sum(vals) / len(vals):.3g}")
    return " ".join(parts)


class StageProgress:
    def __init__(self, name: str, total: int, start: int = 0, enabled: bool = True, log_every_s: float = 15.0):
        self.name, self.total, self.enabled = name, total, enabled
        self._bar = None
        self._last_log = 0.0
        self.log_every_s = log_every_s
        if enabled and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeRemainingColumn(), TextColumn("{task.fields[info]}"), transient=False)
            self._bar.start()
            self._task = self._bar.add_task(name, total=total, completed=start, info="")
        elif enabled and start:
            log.info("%s: resuming at step %d/%d", name, start, total)

    def update(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        info = _summary(metrics)
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)
        elif time.monotonic() - self._last_log > self.log_every_s or step == self.total:
            self._last_log = time.monotonic()
            log.info("%s: step %d/%d %s", self.name, step, self.total, info)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
