"""Plain data across the grading boundary: what the student's kernel may send the trusted side.

Concept
    The checker never holds an object of the student's interpreter. Inputs go into the
    kernel as JSON text; results come back as JSON text and are decoded on the trusted side
    by ``loads_strict``, which builds nothing but ``dict`` (string keys), ``list``, ``str``,
    ``int``, ``float``, ``bool`` and ``None``. An object with its own ``__eq__``, a list
    with a lying ``__len__``, a tensor subclass with ``__torch_function__``, ``mock.ANY``:
    none of them can cross, because only their JSON text does.

Inputs / outputs
    ``to_data(value)`` (kernel side, and the trusted side for the reference): a value made
    of plain types, tuples (become lists), and tensors (become
    ``{"__tensor__": {"shape": [...], "dtype": "float32", "values": [...]}}``), as plain
    data; anything else becomes ``{"__unencodable__": type name}``, which never equals an
    expected value. ``dumps(data)`` -> compact JSON text. ``loads_strict(text, max_bytes)``
    -> plain data or ``ValueError``.

Invariants
    ``loads_strict(dumps(to_data(x)))`` is plain data for every ``x``; ``to_data`` reads a
    container with ``type(x) is list`` etc. (exact types: a subclass of ``list`` is
    unencodable), so a lying ``__iter__`` is never called on the trusted side (and on the
    kernel side it can only lie to itself).

Failure mode
    ``loads_strict`` raises ``ValueError`` for text over ``max_bytes``, nesting deeper than
    ``MAX_DEPTH``, or anything that is not JSON; the judge turns that into a wrong answer.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_DEPTH = 32
MAX_RESULT_BYTES = 8 * 2**20  # one check's results, all cases together
TENSOR = "__tensor__"
UNENCODABLE = "__unencodable__"
_MAX_TENSOR_VALUES = 1 << 20


def _float(x: float):
    # NOTE: JSON has no NaN / inf; keep them as tagged strings so they compare as themselves
    if math.isnan(x):
        return {"__float__": "nan"}
    if math.isinf(x):
        return {"__float__": "inf" if x > 0 else "-inf"}
    return x


def to_data(value: Any, depth: int = 0) -> Any:
    """``value`` as plain JSON-able data (exact built-in types and tensors only)."""
    t = type(value)
    if depth > MAX_DEPTH:
        return {UNENCODABLE: "nested too deep"}
    if value is None or t is bool or t is str:
        return value
    if t is int:
        return value
    if t is float:
        return _float(value)
    if t is list or t is tuple:
        return [to_data(v, depth + 1) for v in value]
    if t is dict:
        out = {}
        for k, v in value.items():
            kt = type(k)
            if kt is str:
                key = k
            elif kt is int or kt is bool or k is None:
                key = json.dumps(k)  # JSON keys are strings: 3 -> "3"
            else:
                return {UNENCODABLE: f"dict with a {kt.__name__} key"}
            out[key] = to_data(v, depth + 1)
        return out
    mod = getattr(t, "__module__", "") or ""
    if t.__name__ == "Tensor" and mod.startswith("torch"):  # exactly torch.Tensor, no subclass
        import torch

        if type(value) is not torch.Tensor or value.numel() > _MAX_TENSOR_VALUES:
            return {UNENCODABLE: "tensor"}
        v = torch.Tensor.detach(value).cpu()
        flat = v.reshape(-1).tolist()
        return {
            TENSOR: {
                "shape": list(v.shape),
                "dtype": str(v.dtype).removeprefix("torch."),
                "values": [_float(x) if type(x) is float else x for x in flat],
            }
        }
    return {UNENCODABLE: t.__name__}


def dumps(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"), allow_nan=False, sort_keys=True)


def _reject_constant(name: str):
    raise ValueError(f"not plain JSON: {name}")


def _check_depth(x: Any, depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        raise ValueError("nested too deep")
    if type(x) is list:
        for v in x:
            _check_depth(v, depth + 1)
    elif type(x) is dict:
        for v in x.values():
            _check_depth(v, depth + 1)


def loads_strict(text: str, max_bytes: int = MAX_RESULT_BYTES) -> Any:
    """Plain data from JSON text, or ``ValueError``."""
    if type(text) is not str:
        raise ValueError("results must be JSON text")
    if len(text) > max_bytes:
        raise ValueError(f"results over {max_bytes} bytes")
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"not JSON: {e}") from None
    _check_depth(data)
    return data


def as_tensor(data: Any):
    """A tensor-shaped datum back as a ``torch.Tensor`` (trusted side), or ``None``."""
    if type(data) is not dict or set(data) != {TENSOR}:
        return None
    t = data[TENSOR]
    import torch

    vals = [float(v["__float__"]) if type(v) is dict else v for v in t["values"]]
    dtype = getattr(torch, t["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        return None
    return torch.tensor(vals, dtype=dtype).reshape(t["shape"])
