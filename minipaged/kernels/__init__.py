"""minipaged.kernels: attention over a paged KV cache, and the ops that fill that cache.

The reference every kernel is tested against, then three backends behind its contract:

- ``reference.py``: ``paged_attention_ref`` / ``paged_attention_prefill_ref`` (readable loops),
  ``contiguous_attention``. Shapes and invariants are stated there.
- ``torch_backend.py``: ``paged_attention_torch`` (vectorized, the ``"torch"`` backend);
  ``cache_ops.py``: ``reshape_and_cache``, ``copy_blocks``, ``swap_blocks``.
- Triton: ``paged_attention_decode`` (V1 and split-KV V2), ``paged_attention_prefill``,
  ``reshape_and_cache_triton``. ``HAS_TRITON`` says whether Triton is importable; without
  it the Triton functions raise ``RuntimeError`` when called and the torch ones still work.
- C, for the CPU: ``minipaged.kernels.cpu`` (``paged_attention_decode_cpu``,
  ``paged_attention_cpu``, ``reshape_and_cache_cpu``), compiled on first use; the
  ``"cpu"`` attention backend.
- ``selector.py``: ``get_attn_backend``, the one place a backend is chosen ("auto" resolved,
  each backend checked against the device and dtypes), and ``attn_backend(name)``, its object
  (``TorchAttentionBackend``, ``triton_backend.TritonAttentionBackend``, ``CPUAttentionBackend``):
  ``build_metadata`` plans a step once, ``forward`` is what every attention layer calls.

On a machine without CUDA the Triton kernels run in Triton's interpreter: this module
sets ``TRITON_INTERPRET=1`` (unless the user set it) *before* any kernel is defined.
NOTE: Triton 3.x reads the variable when ``@triton.jit`` decorates a function (see
``triton.knobs.runtime.interpret``), so it must be set before ``paged_attention`` and
``cache_ops`` are imported; importing ``triton`` itself earlier is harmless.

Triton is imported only when a Triton kernel runs: ``paged_attention_decode`` and
``paged_attention_prefill`` are loaded from ``paged_attention.py`` on first access (a module
``__getattr__``), ``reshape_and_cache_triton`` loads ``cache_ops_triton.py`` on its first
call, and ``HAS_TRITON`` looks Triton up without importing it. So the CPU paths (``"torch"``
and ``"cpu"`` backends, ``minipaged serve`` on a CPU) never import it.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minipaged.kernels.cache_ops import (  # noqa: E402
    HAS_TRITON,
    copy_blocks,
    reshape_and_cache,
    reshape_and_cache_triton,
    swap_blocks,
)
from minipaged.kernels.reference import (  # noqa: E402
    contiguous_attention,
    paged_attention_prefill_ref,
    paged_attention_ref,
)
from minipaged.kernels.selector import get_attn_backend  # noqa: E402
from minipaged.kernels.torch_backend import paged_attention_torch  # noqa: E402

__all__ = [
    "HAS_TRITON",
    "paged_attention_decode",
    "paged_attention_prefill",
    "reshape_and_cache",
    "reshape_and_cache_triton",
    "copy_blocks",
    "swap_blocks",
    "paged_attention_ref",
    "paged_attention_prefill_ref",
    "contiguous_attention",
    "paged_attention_torch",
    "get_attn_backend",
]

_LAZY = {"paged_attention_decode", "paged_attention_prefill"}  # from paged_attention.py (Triton)


def __getattr__(name: str):
    if name in _LAZY:
        from minipaged.kernels import paged_attention

        return getattr(paged_attention, name)
    raise AttributeError(f"module 'minipaged.kernels' has no attribute {name!r}")
