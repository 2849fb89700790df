"""Prefect flows: `full_recipe` and one flow per stage. They only compose tasks (`tasks/`); every computation
is a `mopd_core` stage function called by a task."""
