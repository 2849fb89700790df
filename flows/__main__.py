"""`python -m flows [--config tiny] [--set key=value ...]`: the full recipe through Prefect (ephemeral mode when
no PREFECT_API_URL is set) with MLflow tracking; prints the accuracy table. Exit 2 and one line on a bad
parameter or any other user error (`MopdError`); anything else keeps its traceback."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flows", description=__doc__)
    ap.add_argument("--config", default="tiny", help="preset name (configs/) or YAML path")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="dotted override key=value")
    ap.add_argument("--refresh", action="append", default=[], help="stage to retrain (sft, expert-<d>, student, "
                    "evaluate, all)")
    ap.add_argument("--champion", action="store_true", help="compare with <name>-student@champion")
    ap.add_argument("--sequential-experts", action="store_true", help="train experts one after another")
    ap.add_argument("--concurrent-experts", action="store_true", help="train experts at the same time")
    a = ap.parse_args(argv)
    os.environ.setdefault("PREFECT_HOME", str(Path.cwd() / ".prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # a loaded machine can take more than the default 20 s to start the temporary server
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "mopd")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from flows.full_recipe import full_recipe
    from flows.params import ChampionParams
    from mopd_core.errors import MopdError
    from tasks.common import ParameterError

    try:
        res = full_recipe(config=a.config, overrides=a.overrides, refresh=a.refresh or None,
                          champion=ChampionParams(compare=a.champion),
                          concurrent_experts=(False if a.sequential_experts
                                              else True if a.concurrent_experts else None))
    except (ParameterError, MopdError) as e:  # the user's input (a stage's MopdError too): one line, exit 2
        if os.environ.get("MOPD_TRACEBACK"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(res["table"])
    print(f"MLflow parent run: {res['parent_run_id']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
