"""mopd_core — the engine of the MOPD recipe (SFT → expert RL → multi-teacher on-policy distillation → eval).

Plain Python + torch; never imports prefect. Heavy imports (transformers, trl) stay inside the modules that
need them so that `import mopd_core` is cheap for the CLI, tests and Ray workers.
"""

import os

# Before anything imports torch: torch loads every `torch.backends` entry point at import (torch_npu registers
# one), and a broken backend (torch_npu without CANN) would make `import torch` itself raise. The device layer
# imports torch_npu explicitly, guarded, where it is wanted (runtime.device.npu_available).
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

__version__ = "0.1.0"
