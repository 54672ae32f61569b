"""SamplingParams and BeamSearchParams: what a caller asks of one request.

Mirrors vLLM ``vllm/sampling_params.py`` (today's vLLM, v1): the same field names, defaults
and meanings for the fields below. Pure Python (no torch), validated on construction.

Inputs (``SamplingParams``)
    n, temperature, top_p, top_k (0 = off), min_p, max_tokens, min_tokens, seed,
    presence_penalty, frequency_penalty, repetition_penalty, stop (strings),
    stop_token_ids, include_stop_str_in_output, ignore_eos, logprobs, skip_special_tokens.
    Where each takes effect: penalties, ``min_p``, ``min_tokens`` and ``logprobs`` in
    ``minipaged/sample/sampler.py``; ``stop``, ``include_stop_str_in_output`` and
    ``skip_special_tokens`` in ``minipaged/engine/detokenizer.py``; ``min_tokens``,
    ``stop_token_ids``, ``ignore_eos`` and ``max_tokens`` in the scheduler's stop check.

Invariants
    after construction ``stop`` and ``stop_token_ids`` are lists, every float is
    finite and what float32 (the sampler's dtype) can carry; a temperature below
    ``SAMPLING_EPS`` (vLLM's ``_SAMPLING_EPS``, 1e-5) *is* greedy: it is stored as 0.0 and
    top_p / top_k / min_p are reset to off, as vLLM does; ``replace(params, ...)``
    re-validates (idempotent).

Bounds (so that no request can make one step overflow or cost without limit)
    temperature at most float32's largest; ``repetition_penalty`` not below float32's
    smallest normal (a smaller one is 0 in float32 and the division gives inf / NaN);
    ``top_p`` in (0, 1] as vLLM (one below float32's range keeps the top token: greedy);
    ``seed`` an int64 (vLLM's protocol bound); at most ``MAX_STOP_STRINGS`` stop strings
    of at most ``MAX_STOP_CHARS`` characters together, at most ``MAX_STOP_TOKEN_IDS``
    stop token ids (vLLM has no such caps; each is checked on every new token).

Failure mode
    a bad argument raises ``ValueError`` naming it: wrong type (a bool is not a number
    here), NaN or infinity, out of range. Checks that need the engine (a stop token id or
    ``top_k`` against the vocabulary, ``n`` against ``max_num_seqs``, ``logprobs``
    against ``MAX_LOGPROBS``) are ``verify_sampling_params``, called by the engine's
    ``add_request``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

# NOTE: as vLLM's ModelConfig.max_logprobs default: more top-k entries per token are refused.
MAX_LOGPROBS = 20
# NOTE: as vLLM's _SAMPLING_EPS: a temperature below it is greedy sampling.
SAMPLING_EPS = 1e-5
FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max
FLOAT32_TINY = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny (smallest normal)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# caps on what one request may ask the per-token stop check to scan
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096
MAX_STOP_TOKEN_IDS = 1024


def _short(x, limit: int = 80) -> str:
    """``repr(x)``, cut to ``limit`` characters (an error message never echoes a whole body)."""
    try:
        r = repr(x)
    except ValueError:  # an int over Python's str-conversion digit limit
        return f"an int of {x.bit_length()} bits"
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_float(name: str, value, lo=None, hi=None, lo_open=False, hi_open=False) -> float:
    """``value`` as a float; ``ValueError`` naming ``name`` unless it is a finite real in range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {_short(value)}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int too large for a float
        finite = False
    if not finite:
        raise ValueError(f"{name} must be finite, got {_short(value)}")
    too_low = lo is not None and (value <= lo if lo_open else value < lo)
    too_high = hi is not None and (value >= hi if hi_open else value > hi)
    if too_low or too_high:
        lb = "(" if lo_open else "["
        rb = ")" if hi_open else "]"
        rng = f"{lb}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{rb}"
        raise ValueError(f"{name} must be in {rng}, got {_short(value)}")
    return value


def _check_int(name: str, value, lo: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not _is_int(value) or value < lo:
        extra = " or None" if allow_none else ""
        raise ValueError(f"{name} must be an int >= {lo}{extra}, got {_short(value)}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {_short(value)}")


def normalize_token_ids(name: str, ids) -> list[int]:
    """``ids`` as a list of int token ids >= 0; ``ValueError`` naming ``name`` otherwise
    (a string, a bool, a float or a negative id is not a token id)."""
    if ids is None:
        return []
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"{name} must be a list of int token ids, got {_short(ids)}")
    out = list(ids)
    for t in out:
        if not _is_int(t) or t < 0:
            raise ValueError(f"{name} must hold int token ids >= 0, got {_short(t)} in {_short(out)}")
    return out


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or vLLM's -1) = off
    min_p: float = 0.0  # 0 = off
    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the request before this many
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # top-k log-probabilities per generated token
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1)
        _check_float("temperature", self.temperature, lo=0.0, hi=FLOAT32_MAX)
        _check_float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= 0, or 0 or -1 for off, got {_short(self.top_k)}")
        if self.top_k == -1:  # NOTE: vLLM's older spelling of "off"; one meaning kept here
            self.top_k = 0
        _check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.temperature < SAMPLING_EPS:
            # NOTE: as vLLM: "zero temperature means greedy"; below the epsilon the
            # division by the temperature would overflow float32 (NaN probabilities).
            self.temperature, self.top_p, self.top_k, self.min_p = 0.0, 1.0, 0, 0.0
        _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check_int("seed", self.seed, INT64_MIN, allow_none=True)
        if self.seed is not None and self.seed > INT64_MAX:
            raise ValueError(f"seed must be an int64 (at most {INT64_MAX}), got {_short(self.seed)}")
        # NOTE: the ranges are vLLM's (SamplingParams._verify_args).
        _check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_float("repetition_penalty", self.repetition_penalty, lo=0.0, hi=2.0, lo_open=True)
        if self.repetition_penalty < FLOAT32_TINY:
            raise ValueError(
                f"repetition_penalty must be at least {FLOAT32_TINY:.8g} (float32's smallest normal; "
                f"a smaller one is 0 in float32), got {self.repetition_penalty!r}"
            )
        self.stop = self._normalize_stop(self.stop)
        self.stop_token_ids = normalize_token_ids("stop_token_ids", self.stop_token_ids)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids holds {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed"
            )
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            _check_bool(name, getattr(self, name))
        _check_int("logprobs", self.logprobs, 0, allow_none=True)

    @staticmethod
    def _normalize_stop(stop) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must hold strings only, got {_short(s)}")
            if s == "":
                raise ValueError("stop cannot contain an empty string")
        total = sum(len(s) for s in stop)
        if total > MAX_STOP_CHARS:
            raise ValueError(
                f"stop strings hold {total} characters together; at most {MAX_STOP_CHARS} are allowed"
            )
        return list(stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def verify_sampling_params(
    params: SamplingParams,
    vocab_size: int,
    max_num_seqs: int,
    name: str = "sampling_params",
    has_tokenizer: bool = True,
) -> None:
    """The checks that need the engine; ``ValueError`` naming the argument.

    ``n > max_num_seqs``: with continuous batching the n sequences of a request run as
    one group, all or nothing, so such a request could never be scheduled; static
    batching is held to the same limit, so both policies accept the same requests.
    """
    if not isinstance(params, SamplingParams):
        raise ValueError(f"{name} must be a SamplingParams, got {type(params).__name__}")
    if params.n > max_num_seqs:
        raise ValueError(
            f"{name}.n={params.n} exceeds max_num_seqs={max_num_seqs}: the engine can never "
            f"schedule that many sequences of one request together"
        )
    if params.stop and not has_tokenizer:
        raise ValueError(f"{name}.stop: stop strings need a tokenizer, and this engine has none")
    if params.top_k > vocab_size:
        raise ValueError(
            f"{name}.top_k={params.top_k} exceeds the vocabulary ({vocab_size}); use 0 or -1 for off"
        )
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise ValueError(f"{name}.stop_token_ids holds {bad[0]}, outside the vocabulary [0, {vocab_size})")
    if params.logprobs is not None and params.logprobs > min(MAX_LOGPROBS, vocab_size):
        raise ValueError(
            f"{name}.logprobs={params.logprobs} exceeds the maximum "
            f"{min(MAX_LOGPROBS, vocab_size)} (MAX_LOGPROBS={MAX_LOGPROBS}, vocabulary {vocab_size})"
        )


@dataclass
class BeamSearchParams:
    beam_width: int = 4
    max_tokens: int = 16
    length_penalty: float = 1.0
    ignore_eos: bool = False
    # as transformers' generate: False (heuristic), True (stop at beam_width finished), "never"
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(f"early_stopping must be False, True or 'never', got {self.early_stopping!r}")
        _check_int("beam_width", self.beam_width, 1)
        _check_int("max_tokens", self.max_tokens, 1)
        _check_float("length_penalty", self.length_penalty)
        _check_bool("ignore_eos", self.ignore_eos)
