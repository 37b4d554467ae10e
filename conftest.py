"""Repository-wide test setup, loaded before any test module.

Without CUDA, Triton kernels run through Triton's own interpreter (``TRITON_INTERPRET=1``,
read when a kernel is defined, so it must be set before ``specd.kernels`` imports them):
the same kernel source, executed on CPU tensors. With CUDA they compile as in production.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
