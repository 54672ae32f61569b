"""SamplingParams and BeamSearchParams: what a caller asks of one request.

Mirrors vLLM ``vllm/sampling_params.py`` (today's vLLM, v1): the same field names, defaults
and meanings for the fields below. Pure Python (no torch), validated on construction.

Inputs (``SamplingParams``)
    n, temperature, top_p, top_k (0 = off), min_p, max_tokens, min_tokens, seed,
    presence_penalty, frequency_penalty, repetition_penalty, stop (strings),
    stop_token_ids, include_stop_str_in_output, ignore_eos, logprobs, skip_special_tokens.
    Where each takes effect: penalties, ``min_p``, ``min_tokens`` and ``logprobs`` in
    ``minipaged/engine/sampler.py``; ``stop``, ``include_stop_str_in_output`` and
    ``skip_special_tokens`` in ``minipaged/engine/detokenizer.py``; ``min_tokens``,
    ``stop_token_ids``, ``ignore_eos`` and ``max_tokens`` in the scheduler's stop check.

Invariants
    after construction ``stop`` and ``stop_token_ids`` are lists, every float is
    finite; ``replace(params, ...)`` re-validates (idempotent).

Failure mode
    a bad argument raises ``ValueError`` naming it: wrong type (a bool is not a number
    here), NaN or infinity, out of range. Checks that need the engine (a stop token id in
    the vocabulary, ``n`` against ``max_num_seqs``, ``logprobs`` against ``MAX_LOGPROBS``)
    are ``verify_sampling_params``, called by the engine's ``add_request``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

# NOTE: as vLLM's ModelConfig.max_logprobs default: more top-k entries per token are refused.
MAX_LOGPROBS = 20


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_float(name: str, value, lo=None, hi=None, lo_open=False, hi_open=False) -> float:
    """``value`` as a float; ``ValueError`` naming ``name`` unless it is a finite real in range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    too_low = lo is not None and (value <= lo if lo_open else value < lo)
    too_high = hi is not None and (value >= hi if hi_open else value > hi)
    if too_low or too_high:
        lb = "(" if lo_open else "["
        rb = ")" if hi_open else "]"
        rng = f"{lb}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{rb}"
        raise ValueError(f"{name} must be in {rng}, got {value!r}")
    return value


def _check_int(name: str, value, lo: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not _is_int(value) or value < lo:
        extra = " or None" if allow_none else ""
        raise ValueError(f"{name} must be an int >= {lo}{extra}, got {value!r}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def normalize_token_ids(name: str, ids) -> list[int]:
    """``ids`` as a list of int token ids >= 0; ``ValueError`` naming ``name`` otherwise
    (a string, a bool, a float or a negative id is not a token id)."""
    if ids is None:
        return []
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"{name} must be a list of int token ids, got {ids!r}")
    out = list(ids)
    for t in out:
        if not _is_int(t) or t < 0:
            raise ValueError(f"{name} must hold int token ids >= 0, got {t!r} in {out!r}")
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
        _check_float("temperature", self.temperature, lo=0.0)
        _check_float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= 0, or 0 or -1 for off, got {self.top_k!r}")
        if self.top_k == -1:  # NOTE: vLLM's older spelling of "off"; one meaning kept here
            self.top_k = 0
        _check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check_int("seed", self.seed, -(2**63), allow_none=True)
        # NOTE: the ranges are vLLM's (SamplingParams._verify_args).
        _check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_float("repetition_penalty", self.repetition_penalty, lo=0.0, hi=2.0, lo_open=True)
        self.stop = self._normalize_stop(self.stop)
        self.stop_token_ids = normalize_token_ids("stop_token_ids", self.stop_token_ids)
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
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must hold strings only, got {s!r}")
            if s == "":
                raise ValueError("stop cannot contain an empty string")
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
