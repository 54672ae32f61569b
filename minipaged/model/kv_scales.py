"""The scales of a quantized KV cache: one calibration forward sets every attention layer's
``k_scale`` and ``v_scale`` before an int8 / fp8 cache is allocated.

Mirrors vLLM's ``calculate_kv_scales`` (``vllm/attention/layer.py``), which measures the
first batch; here the batch is fixed (``CALIBRATION_TEXT``), so outputs never depend on which
request came first. The arithmetic of a quantized cache is ``kernels/quant.py``'s.

Inputs
    ``calibrate_kv_scales(model, kv_cache_dtype, input_ids=None)``: a ``PagedCausalLM``; one
    of ``KV_CACHE_DTYPES``; ``input_ids`` [n], one sequence (None: ``model.calibration_ids``,
    the loader's tokens of ``CALIBRATION_TEXT``, else token ids drawn with a fixed seed; at
    most ``CALIBRATION_TOKENS``).
Output
    every attention layer's ``k_scale = max|k| / QUANT_MAX`` and ``v_scale`` likewise
    (``quant.scale_for``), measured through a scratch cache in the model's dtype; "auto":
    every scale 1.0. ``model.kv_cache_dtype`` says what the scales were set for.

Failure mode
    ``input_ids`` not [n] with 1 <= n <= max_model_len: ``ValueError``.
"""

from __future__ import annotations

from typing import Optional

import torch

from minipaged.kernels.quant import is_quantized, kv_cache_torch_dtype, scale_for
from minipaged.model.input import build_model_input

CALIBRATION_TOKENS = 256  # at most this many tokens in the calibration forward of a quantized KV cache
# What the calibration forward reads (the loader tokenizes it for the model, ``calibration_ids``):
# plain English in the style of the course corpus, written for this purpose (it is not a corpus story).
CALIBRATION_TEXT = (
    "Once upon a time, in a small town near the sea, there lived a girl named Lily. Every morning she "
    "walked to the park with her dog, Max, and her best friend, Ben. One day the wind took Lily's red "
    'kite and carried it high into an old tree. "Oh no!" Lily said. "My kite is stuck." Ben looked up '
    'and thought for a moment. "Do not worry, Lily. I will help you," he said. He found a long stick, '
    "stood on a big rock and pulled the string very slowly. The kite came down with a leaf on its tail. "
    'Lily was so happy that she laughed and hugged him. "Thank you, Ben!" she said. Then the three '
    "friends ran down the hill to the water, where the boats were white and the sky was blue. They ate "
    "apples, played a game with a green ball and watched the birds until the sun was low. When it was "
    "time to go home, Lily's mom made soup and bread, and Max fell asleep by the warm fire. Lily smiled. "
    "It had been a good day, and tomorrow they would fly the kite again, far away from the tall trees. "
    "The end."
)


def calibrate_kv_scales(model, kv_cache_dtype: str, input_ids: Optional[torch.Tensor] = None) -> None:
    """Set every attention layer's ``k_scale`` / ``v_scale`` for a ``kv_cache_dtype`` cache."""
    dtype = kv_cache_torch_dtype(kv_cache_dtype, model.dtype)
    layers = model.attention_layers()
    for m in layers:
        m.k_scale = m.v_scale = 1.0
    model.kv_cache_dtype = "auto"
    if not is_quantized(dtype):
        return
    n = min(CALIBRATION_TOKENS, model.max_model_len)
    if input_ids is None and model.calibration_ids:
        input_ids = torch.tensor(model.calibration_ids[:n])
    elif input_ids is None:  # NOTE: random tokens underestimate real text's max |k| by up to 40%
        input_ids = torch.randint(model.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    if input_ids.dim() != 1 or input_ids.numel() == 0 or input_ids.numel() > model.max_model_len:
        raise ValueError(
            f"input_ids must be [n] with 1 <= n <= {model.max_model_len}, got {tuple(input_ids.shape)}"
        )
    n, bs, dev = input_ids.numel(), 16, model.device
    nb = -(-n // bs)
    shape = (nb, bs, model.num_kv_heads, model.head_dim)
    kw = dict(dtype=model.dtype, device=dev)
    caches = [(torch.zeros(shape, **kw), torch.zeros(shape, **kw)) for _ in layers]
    inp = build_model_input([(list(range(nb)), 0, input_ids.tolist())], bs).to(dev)
    amax = {m: [0.0, 0.0] for m in layers}  # [max|k|, max|v|] each layer was handed

    def record(m, args):
        _, k, v = args[:3]
        amax[m] = [max(amax[m][0], float(k.abs().max())), max(amax[m][1], float(v.abs().max()))]

    hooks = [m.register_forward_pre_hook(record) for m in layers]
    try:
        with torch.no_grad():
            model.forward(inp, caches)
    finally:
        for h in hooks:
            h.remove()
    for m in layers:
        m.k_scale, m.v_scale = scale_for(amax[m][0], dtype), scale_for(amax[m][1], dtype)
    model.kv_cache_dtype = kv_cache_dtype
