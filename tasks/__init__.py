"""Prefect tasks: thin wrappers around `mopd_core` stage functions — caching, retries, MLflow run context,
Prefect artifacts. No ML logic lives here (that is `mopd_core`)."""
