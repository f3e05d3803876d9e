"""Suite-wide settings. Triton kernels run on the CPU only under its interpreter, which must be
chosen before any kernel module is imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
