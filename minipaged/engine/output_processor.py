"""OutputProcessor: the engine core's token ids -> ``RequestOutput``s, the only place outputs are built.

Mirrors vLLM v1 ``vllm/v1/engine/output_processor.py`` (+ ``detokenizer.py``, ``logprobs.py``,
and the ``n > 1`` fan-in of ``parallel_sampling.py``). Both frontends hold one: ``LLMEngine``
(offline) and ``AsyncLLM`` (the server), in the front-end process.

Inputs
    ``add_request(request_id, prompt, prompt_token_ids, params, core_requests, stream)``
    when a request is queued (its ``EngineCoreRequest`` per sample); then
    ``process_outputs(engine_core_outputs)`` after every core step; ``abort_request(id)``.
Outputs
    ``process_outputs`` -> ``OutputProcessorOutput``: ``request_outputs``, one
    ``RequestOutput`` per request that finished (all its samples) and, for a ``stream``
    request, a partial one (cumulative: text and token ids so far) each time it moved; and
    ``reqs_to_stop``: ``(sequence id, reason)`` of every sequence whose text just completed
    a stop string, which the caller hands to the core (``EngineCore.stop_requests``: vLLM
    aborts it) so that its blocks are free before the next step. Tokens the core made past
    that token are dropped. Text follows vLLM's rules (``detokenizer.py``): a stop string,
    or the EOS / stop token that ended a sample, is cut unless ``include_stop_str_in_output``;
    ``token_ids`` keep every generated token up to the end.
Invariants
    a tracked sample has one ``FlatLogprobs`` position per token when it asked for
    logprobs, stored once as the token arrives, and its detokenizers have seen every token.
Failure mode
    none of its own: outputs of unknown requests (aborted here already) are ignored.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from minipaged.engine.detokenizer import IncrementalDetokenizer
from minipaged.engine.outputs import CompletionOutput, FlatLogprobs, RequestOutput
from minipaged.sampling_params import SamplingParams


@dataclass
class _SampleState:
    """One of a request's n samples, as the frontend has received it."""

    seq_id: str
    params: SamplingParams  # as the core runs it (n=1, the model's further EOS ids as stop ids)
    eos_token_id: Optional[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[FlatLogprobs] = None  # one position per token, when asked for
    cumulative_logprob: float = 0.0  # the sampled tokens' log-probabilities, summed
    detokenizer: Optional[IncrementalDetokenizer] = None  # with stop strings
    stream_text: Optional[IncrementalDetokenizer] = None  # a stream's text, without stop strings
    finish_reason: Optional[str] = None
    stop_reason: object = None  # the core's words, then what the output says

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    samples: list[_SampleState]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    reqs_to_stop: list[tuple[str, str]]


class OutputProcessor:
    def __init__(self, tokenizer, piece: Optional[Callable] = None) -> None:
        self.tokenizer = tokenizer
        if piece is None:  # a token's text, memoized (at most the vocabulary)
            decode = (
                (lambda t: tokenizer.decode([t], skip_special_tokens=False))
                if tokenizer
                else (lambda t: None)
            )
            piece = functools.lru_cache(maxsize=1 << 18)(decode)
        self.piece = piece
        self.request_states: dict[str, RequestState] = {}
        self._samples: dict[str, tuple[RequestState, int]] = {}  # sequence id -> (request, index)
        self.num_logprob_tokens = 0  # tokens whose logprobs were stored (each once)

    # -- requests ------------------------------------------------------------------------
    def add_request(self, request_id, prompt, prompt_token_ids, params, core_requests, stream=False) -> None:
        if request_id in self.request_states:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        tok = self.tokenizer
        samples = []
        for r in core_requests:
            s = _SampleState(r.request_id, r.sampling_params, r.eos_token_id)
            if params.logprobs is not None:
                s.logprobs = FlatLogprobs()
            if params.stop and tok is not None:
                s.detokenizer = IncrementalDetokenizer(tok, prompt_token_ids, params)
            elif stream and tok is not None:
                s.stream_text = IncrementalDetokenizer(tok, [], dataclasses.replace(params, n=1, stop=None))
            samples.append(s)
        state = RequestState(request_id, prompt, list(prompt_token_ids), params, stream, samples)
        self.request_states[request_id] = state
        for j, s in enumerate(samples):
            self._samples[s.seq_id] = (state, j)

    def abort_request(self, request_id: str) -> list[str]:
        """Forget ``request_id``; the ids of its unfinished samples (for the core to abort)."""
        state = self.request_states.pop(request_id, None)
        if state is None:
            return []
        for s in state.samples:
            self._samples.pop(s.seq_id, None)
        return [s.seq_id for s in state.samples if not s.finished]

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    # -- the step's outputs ----------------------------------------------------------------
    def process_outputs(self, outputs) -> OutputProcessorOutput:
        """Apply one core step's ``EngineCoreOutput``s (see the module docstring)."""
        moved: dict[str, RequestState] = {}
        stops = []
        for o in outputs:
            found = self._samples.get(o.request_id)
            if found is None:
                continue  # aborted here already
            state, j = found
            s = state.samples[j]
            if s.finished:
                continue  # a stop string ended it: what the core made since is dropped
            moved[state.request_id] = state
            new = o.new_token_ids
            for k, t in enumerate(new):
                if s.logprobs is not None and o.new_logprobs is not None and k < len(o.new_logprobs):
                    # NOTE: each token's logprobs stored as it arrives (vLLM's LogprobsProcessor),
                    # never all of a long answer at once when it finishes: that burst (16 x 480
                    # tokens of 21 entries) held every other request's outputs back for a second
                    entry = o.new_logprobs[k]
                    s.logprobs.append_position(entry, self.piece)
                    s.cumulative_logprob += entry.sampled_logprob
                    self.num_logprob_tokens += 1
                s.token_ids.append(int(t))
                last = k == len(new) - 1
                if last and o.finish_reason is not None:
                    s.finish_reason, s.stop_reason = o.finish_reason, o.stop_reason
                if s.stream_text is not None:
                    s.stream_text.update(int(t))
                if s.detokenizer is not None:
                    hit = s.detokenizer.update(int(t), s.finish_reason == "stop")
                    if hit is not None:  # NOTE: as the core would, a stop string wins over length / EOS
                        reason = f"stop string {hit!r}"
                        stops.append((s.seq_id, reason))
                        s.finish_reason, s.stop_reason = "stop", hit
                        break
            if not new and o.finish_reason is not None:
                s.finish_reason, s.stop_reason = o.finish_reason, o.stop_reason
        request_outputs = []
        for rid, state in moved.items():
            if state.finished:
                request_outputs.append(self._request_output(state))
                self.abort_request(rid)
            elif state.stream:
                request_outputs.append(self._request_output(state))
        return OutputProcessorOutput(request_outputs, stops)

    # -- building outputs (the only place) ---------------------------------------------------
    def _final_text(self, s: _SampleState) -> str:
        if s.detokenizer is not None:
            return s.detokenizer.output_text
        if self.tokenizer is None or not s.token_ids:
            return ""
        ids = s.token_ids
        if s.finish_reason == "stop" and not s.params.include_stop_str_in_output:
            ids = ids[:-1]  # NOTE: as vLLM, the EOS / stop token's text is not output
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=s.params.skip_special_tokens)

    def _stop_reason(self, s: _SampleState):
        """vLLM's ``stop_reason``: the stop string or stop token id that ended a "stop"
        sample (None for EOS); for "refused", the scheduler's explanation."""
        if s.finish_reason == "refused":
            return s.stop_reason or "refused: the request can never fit"
        if s.finish_reason != "stop":
            return None
        if s.detokenizer is not None and s.detokenizer.stop_string is not None:
            return s.detokenizer.stop_string
        if s.token_ids:
            last = s.token_ids[-1]
            if last in s.params.stop_token_ids and last != s.eos_token_id:
                return last
        return None

    def _completion(self, j: int, s: _SampleState) -> CompletionOutput:
        if s.finished:
            return CompletionOutput(
                index=j,
                text=self._final_text(s),
                token_ids=list(s.token_ids),
                finish_reason=s.finish_reason,
                stop_reason=self._stop_reason(s),
                cumulative_logprob=None if s.logprobs is None else s.cumulative_logprob,
                logprobs=s.logprobs,  # NOTE: complete: nothing is appended after the finish
            )
        detok = s.detokenizer if s.detokenizer is not None else s.stream_text
        return CompletionOutput(
            index=j,
            text="" if detok is None else detok.output_text,
            token_ids=list(s.token_ids),
            logprobs=s.logprobs,  # NOTE: the growing one itself (cumulative, as the text)
        )

    def _request_output(self, state: RequestState) -> RequestOutput:
        comps = [self._completion(j, s) for j, s in enumerate(state.samples)]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=list(state.prompt_token_ids),
            outputs=comps,
            finished=all(c.finish_reason is not None for c in comps),
        )
