"""Shared test setup.

On a machine without CUDA the Triton kernels run in Triton's interpreter; the variable
must be set before triton is first imported, so it is set here, at collection time.
"""

import os

os.environ.setdefault("MPLBACKEND", "Agg")
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # core tests run without torch
    os.environ.setdefault("TRITON_INTERPRET", "1")
