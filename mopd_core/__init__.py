"""mopd_core — the engine of the MOPD recipe (SFT → expert RL → multi-teacher on-policy distillation → eval).

Plain Python + torch; never imports prefect. Heavy imports (transformers, trl) stay inside the modules that
need them so that `import mopd_core` is cheap for the CLI, tests and Ray workers.
"""

__version__ = "0.1.0"
