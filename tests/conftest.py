"""Shared test setup.

On a machine without CUDA the Triton kernels run in Triton's interpreter; the variable
must be set before triton is first imported, so it is set here, at collection time.
(Notebook kernels inherit it too, which is what we want.)

NOTE: matplotlib's backend is chosen in-process with ``matplotlib.use`` rather than by
exporting MPLBACKEND: an exported MPLBACKEND=Agg leaks into the nbval notebook kernels,
where ``plt.show()`` would then display nothing and every figure cell would differ.
"""

import os

try:
    import matplotlib

    matplotlib.use("Agg")
except ImportError:
    pass

try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # core tests run without torch
    os.environ.setdefault("TRITON_INTERPRET", "1")
