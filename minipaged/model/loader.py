"""Load a Hugging Face checkpoint into a minipaged model: ``load_model(model) -> (model, tokenizer)``.

Mirrors vLLM ``vllm/model_executor/model_loader/`` (default loader) and the architecture
registry of ``vllm/model_executor/models/registry.py``, cut down to four families.

Inputs
    ``model``: ``None`` (the course model shipped in ``minipaged/data/course_model``), a
    local directory in Hugging Face format, or a hub id such as ``"HuggingFaceTB/SmolLM2-135M"``
    (downloaded by transformers where a network is reachable). ``dtype``: "float32",
    "float16" or "bfloat16". ``device``: anything ``torch.device`` accepts.
    ``attention_backend``: "torch", "triton" or "cpu" (``EngineConfig`` resolves "auto" first,
    ``minipaged.kernels.selector``), held by the model (``PagedCausalLM.use_backend``).
    ``tp``: a ``minipaged.model.parallel.TensorParallelGroup`` (rank r of N), or ``None`` for
    the whole model in one process.
Output
    ``(model, tokenizer)``: a ``PagedCausalLM`` in eval mode on ``device`` in ``dtype`` with
    the checkpoint's weights, and the checkpoint's transformers tokenizer (``None`` for a
    local directory that holds no tokenizer files at all).

How
    transformers reads the config and the weights (``AutoConfig``,
    ``AutoModelForCausalLM.from_pretrained(...).state_dict()``), which handles local and hub
    paths, safetensors and ``.bin``, sharding and tied weights; the minipaged model is built
    on the ``meta`` device (no random init), materialised on ``device`` and filled by its
    ``load_weights``.

    Tensor-parallel (``tp.size > 1``, Llama family only): rank r builds its shard of the model
    and reads only its shard of each weight: from a local safetensors checkpoint through
    ``safe_open(...).get_slice(name)[rows]``, which reads those bytes and no others (vLLM's
    ``weight_loader`` does the same with ``narrow``). A hub id or a ``.bin`` checkpoint has no
    such slices: transformers reads it whole and each rank keeps its shard.
    ``load_model_meta``: the checkpoint's shapes without its weights (a tensor-parallel driver).

Invariants
    Same weights as transformers' model, so the same logits up to the attention kernel's
    rounding; ``model.eos_token_ids`` is the generation config's EOS (else the config's).

Failure mode
    ``ValueError`` naming the argument for: a path that is neither a local directory nor a
    plausible hub id, a checkpoint whose config cannot be loaded, an architecture outside
    Llama / Mistral / Qwen2 / GPT-2, a bad dtype or backend, a device this machine does not
    have (``"cuda"`` without CUDA), a weights file that cannot be read (truncated, corrupt):
    one sentence naming the device or the file; a ``tp.size`` that does not divide the heads,
    the KV heads or the intermediate size, or exceeds the devices, or a GPT-2 checkpoint with
    ``tp.size > 1``: ``ValueError`` naming ``tensor_parallel_size``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from minipaged.kernels.selector import ATTENTION_BACKENDS
from minipaged.model.gpt2 import GPT2LMHeadModel
from minipaged.model.kv_scales import CALIBRATION_TEXT
from minipaged.model.layers import PagedCausalLM
from minipaged.model.llama import LlamaForCausalLM
from minipaged.model.parallel import check_tensor_parallel_size

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_dtype(dtype) -> torch.dtype:
    """'float32' | 'float16' | 'bfloat16' (or a torch.dtype) -> torch.dtype."""
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype must be one of 'float32', 'float16', 'bfloat16', got {dtype!r}")


COURSE_MODEL_DIR = Path(__file__).resolve().parent.parent / "data" / "course_model"

# config.model_type -> minipaged class
_MODEL_REGISTRY: dict[str, type[PagedCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "gpt2": GPT2LMHeadModel,
}

# "name" or "namespace/name": letters, digits, '.', '_', '-' (Hugging Face's repo id rule).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.\-]{0,95}(/[A-Za-z0-9][\w.\-]{0,95})?")


# A local checkpoint without any of these has no tokenizer: load_model returns None for it
# (the engine then takes token-id prompts only). Tests build such checkpoints.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def resolve_model_path(model: str | os.PathLike | None) -> str:
    """The directory or hub id to load; ``ValueError`` if ``model`` can be neither."""
    if model is None:
        if not (COURSE_MODEL_DIR / "config.json").is_file():
            raise ValueError(f"model=None: the course model is missing from {COURSE_MODEL_DIR}")
        return str(COURSE_MODEL_DIR)
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a path, a hub id or None, got {type(model).__name__}")
    path = os.fspath(model)
    if os.path.isdir(path):
        return path
    looks_like_path = path.startswith(("/", ".", "~")) or os.sep + os.sep in path or "\\" in path
    if looks_like_path or not _HUB_ID.fullmatch(path) or "--" in path or ".." in path:
        raise ValueError(f"model {path!r}: no such local directory, and not a Hugging Face hub id")
    return path  # a hub id: transformers downloads it (or finds it in the local HF cache)


def check_device_available(device: torch.device) -> None:
    """``ValueError`` in one sentence if ``device`` is not on this machine."""
    if device.type == "cpu":
        return
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device={str(device)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
        return
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device={str(device)!r}: MPS is not available on this machine")
        return
    raise ValueError(f"device={str(device)!r}: only 'cpu', 'cuda' and 'mps' devices are supported")


def _weight_errors() -> tuple:
    import pickle

    errors = [OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError]
    try:  # a truncated or corrupt .safetensors file
        from safetensors import SafetensorError

        errors.append(SafetensorError)
    except ImportError:  # pragma: no cover - safetensors comes with transformers
        pass
    return tuple(errors)


_WEIGHT_ERRORS = _weight_errors()
_READ_ERRORS = tuple(e for e in _WEIGHT_ERRORS if e is not ValueError)


def _weights_files(src: str) -> str:
    """The weight files of a local checkpoint, for an error message."""
    if os.path.isdir(src):
        names = sorted(f for f in os.listdir(src) if f.endswith((".safetensors", ".bin", ".pt")))
        if names:
            return "the weights file " + ", ".join(os.path.join(src, f) for f in names)
    return "the weights"


def supported_model_types() -> list[str]:
    return sorted(_MODEL_REGISTRY)


def _from_pretrained_dtype_kwargs(dtype: torch.dtype) -> dict:
    # NOTE: transformers >= 4.56 calls the argument ``dtype``; older versions ``torch_dtype``.
    import transformers
    from packaging.version import Version

    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return {key: dtype}


def _eos_token_ids(config, src: str) -> list[int]:
    eos = None
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(src).eos_token_id
    except (OSError, ValueError):
        pass  # no generation_config.json: fall back to the model config
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _quietly(fn, *args, **kwargs):
    """Call ``fn`` with transformers' progress bars off (they would land in notebook output)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return fn(*args, **kwargs)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _safetensors_files(src: str) -> list[str]:
    """The ``.safetensors`` files of a local checkpoint ([] for a hub id or a ``.bin`` one)."""
    if not os.path.isdir(src):
        return []
    return sorted(os.path.join(src, f) for f in os.listdir(src) if f.endswith(".safetensors"))


def checkpoint_slices(files: list[str]):
    """``(name, slice)`` for every tensor of these safetensors files; indexing a slice reads
    only the indexed bytes (``safetensors.safe_open(...).get_slice``)."""
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def _check_tp_family(cls, config, tp_size: int) -> None:
    if tp_size > 1 and cls is not LlamaForCausalLM:
        raise ValueError(
            f"tensor_parallel_size={tp_size}: tensor parallelism is built for the Llama family only, "
            f"not {config.model_type!r}"
        )


def _load_sharded(cls, config, src: str, torch_dtype, device, tp):
    """Rank ``tp.rank``'s shard of the model, reading only its shard of each weight."""
    _check_tp_family(cls, config, tp.size)
    check_tensor_parallel_size(tp.size, config, device)
    with torch.device("meta"):
        paged = cls(config, eos_token_ids=_eos_token_ids(config, src), tp=tp)
    paged = paged.to_empty(device=device).to(torch_dtype)
    files = _safetensors_files(src)
    try:
        if files:
            paged.load_weights(checkpoint_slices(files))
        else:  # no slices to read from: the whole state dict, each rank keeps its shard
            from transformers import AutoModelForCausalLM

            hf_model = _quietly(
                AutoModelForCausalLM.from_pretrained, src, **_from_pretrained_dtype_kwargs(torch_dtype)
            )
            paged.load_weights(hf_model.state_dict())
            del hf_model
    except _READ_ERRORS as e:  # NOTE: a ValueError from load_weights already names the weight
        raise ValueError(f"model {src!r}: {_weights_files(src)} could not be read ({e})") from e
    return paged


def load_model_meta(
    model: str | os.PathLike | None = None, tp_size: int = 1, device="cpu"
) -> tuple[PagedCausalLM, object]:
    """What a tensor-parallel driver needs of a checkpoint, without its weights:
    ``(model on the meta device, tokenizer)``. The meta model is the whole model (world size
    1): its ``num_layers``, ``num_kv_heads``, ``head_dim``, ``vocab_size``, ``max_model_len``
    and ``eos_token_ids`` are the checkpoint's. ``tp_size`` is checked against the config
    (``ValueError`` naming ``tensor_parallel_size``)."""
    from transformers import AutoConfig

    src = resolve_model_path(model)
    try:
        config = AutoConfig.from_pretrained(src)
    except (OSError, ValueError) as e:
        raise ValueError(f"model {src!r}: could not load its config: {e}") from e
    cls = _MODEL_REGISTRY.get(getattr(config, "model_type", None))
    if cls is None:
        raise ValueError(f"model {src!r}: architecture {config.model_type!r} is not supported")
    _check_tp_family(cls, config, tp_size)
    check_tensor_parallel_size(tp_size, config, device)
    with torch.device("meta"):
        meta = cls(config, eos_token_ids=_eos_token_ids(config, src))
    tokenizer = _load_tokenizer(src)
    if tokenizer is not None:
        meta.calibration_ids = tokenizer(CALIBRATION_TEXT)["input_ids"]
    return meta, tokenizer


def _load_tokenizer(src: str):
    """The checkpoint's tokenizer, or ``None`` for a local directory with no tokenizer files."""
    from transformers import AutoTokenizer

    if not os.path.isdir(src) or any(os.path.isfile(os.path.join(src, f)) for f in _TOKENIZER_FILES):
        return AutoTokenizer.from_pretrained(src)
    return None


def load_model(
    model: str | os.PathLike | None = None,
    dtype="float32",
    device="cpu",
    attention_backend: str = "torch",
    tp=None,
):
    """Load ``model`` (None = the course model) -> ``(PagedCausalLM, tokenizer)``; with ``tp``
    (a ``TensorParallelGroup`` of size > 1), this rank's shard of it."""
    from transformers import AutoConfig

    torch_dtype = resolve_dtype(dtype)
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a torch device: {e}") from e
    check_device_available(device)
    src = resolve_model_path(model)

    try:
        config = AutoConfig.from_pretrained(src)
    except (OSError, ValueError) as e:
        raise ValueError(f"model {src!r}: could not load its config: {e}") from e
    model_type = getattr(config, "model_type", None)
    if model_type not in _MODEL_REGISTRY:
        archs = getattr(config, "architectures", None)
        raise ValueError(
            f"model {src!r}: architecture {model_type!r} ({archs}) is not supported; "
            f"supported model types: {supported_model_types()}"
        )
    cls = _MODEL_REGISTRY[model_type]

    if tp is not None and tp.size > 1:
        paged = _load_sharded(cls, config, src, torch_dtype, device, tp)
    else:
        paged = _load_whole(cls, config, src, torch_dtype, device)
    paged.use_backend(attention_backend)
    paged.eval().requires_grad_(False)
    paged.check_invariants()
    tokenizer = _load_tokenizer(src)
    if tokenizer is not None:
        paged.calibration_ids = tokenizer(CALIBRATION_TEXT)["input_ids"]  # for an int8 / fp8 KV cache
    return paged, tokenizer


def _load_whole(cls, config, src: str, torch_dtype, device):
    """The whole model in this process (world size 1)."""
    from transformers import AutoModelForCausalLM

    # 1. The weights, as transformers reads them (any format, any source).
    try:
        hf_model = _quietly(
            AutoModelForCausalLM.from_pretrained, src, **_from_pretrained_dtype_kwargs(torch_dtype)
        )
    except _WEIGHT_ERRORS as e:
        raise ValueError(f"model {src!r}: {_weights_files(src)} could not be read ({e})") from e
    state_dict = hf_model.state_dict()

    # 2. The minipaged model: built without random init, then filled.
    with torch.device("meta"):
        paged = cls(config, eos_token_ids=_eos_token_ids(config, src))
    paged = paged.to_empty(device=device).to(torch_dtype)
    paged.load_weights(state_dict)
    del hf_model, state_dict
    return paged
