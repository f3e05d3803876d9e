"""Suite-wide settings. Triton kernels run on the CPU only under its interpreter, which must be
chosen before any kernel module is imported."""

import os

# Tests run beside worker processes on 2 cores: spinning OpenMP threads would starve each other
# (see services/worker/__main__.py). Set before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
