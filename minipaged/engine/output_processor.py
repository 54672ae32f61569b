"""OutputProcessor: per-sequence text, stop strings and logprobs, beside the scheduler.

Mirrors vLLM v1 ``vllm/v1/engine/output_processor.py`` (+ ``logprobs.py``). In vLLM the
output processor runs in the front-end process and aborts a request whose text hit a stop
string (the engine core frees its blocks before its next step); here the engine calls it
right after ``update_from_output`` and has the scheduler finish the request
(``finish_requests``) in that same step, so the token that completes a stop string is the
last one kept and the request's KV blocks are free before the next ``schedule()``.

Inputs
    ``add_request(seqs, prompt_token_ids, params)`` when the engine queues them;
    ``check_stop_strings(req)`` after every token the scheduler appends -> the stop string
    it completed, or None;
    ``add_logprobs(reqs, entries)`` after every sampling; ``make_completion(...)`` at the
    end; ``remove(seqs)`` when the engine forgets a request.
Outputs
    ``CompletionOutput`` with vLLM's text rules (``minipaged/engine/detokenizer.py``):
    a stop string, or the EOS / stop token that ended a request, is cut from the text
    unless ``include_stop_str_in_output``; ``token_ids`` keep every generated token.

Invariants
    a tracked sequence has one ``Logprobs`` entry per generated token when it asked for
    logprobs; its detokenizer (only when it has stop strings) has seen every token.

Failure mode
    none of its own: unknown sequences (beam search's, tests' own schedulers) are ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from minipaged.core.sched.request import Request, RequestStatus
from minipaged.engine.detokenizer import IncrementalDetokenizer
from minipaged.engine.outputs import CompletionOutput, Logprob
from minipaged.engine.sampler import Logprobs
from minipaged.sampling_params import SamplingParams


@dataclass
class _SeqState:
    detokenizer: Optional[IncrementalDetokenizer]  # only for sequences with stop strings
    logprobs: Optional[list[Logprobs]] = None
    stop_string: Optional[str] = None


def logprob_dict(entry, piece) -> dict:
    """One generated token's ``Logprobs`` as vLLM's dict: the sampled token, then the top k
    (token id -> ``Logprob`` with its rank and text, ``piece(token_id)``); the one builder
    ``OutputProcessor`` and the server's frontends share."""
    d = {
        entry.sampled_token_id: Logprob(
            entry.sampled_logprob, entry.sampled_rank, piece(entry.sampled_token_id)
        )
    }
    for rank, (tid, lp) in enumerate(zip(entry.token_ids, entry.logprobs), start=1):
        if tid not in d:
            d[tid] = Logprob(lp, rank, piece(tid))
    return d


@dataclass
class OutputProcessor:
    tokenizer: object = None
    seqs: dict[str, _SeqState] = field(default_factory=dict)

    def add_request(
        self, seqs: Sequence[Request], prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        for req in seqs:
            detok = None
            if params.stop and self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
            self.seqs[req.request_id] = _SeqState(detok, [] if params.logprobs is not None else None)

    def remove(self, seqs: Sequence[Request]) -> None:
        for req in seqs:
            self.seqs.pop(req.request_id, None)

    # -- called by the engine, after the scheduler appended a token and checked EOS / lengths
    def check_stop_strings(self, req: Request) -> Optional[str]:
        """Feed ``req``'s newest token to its detokenizer; the stop string it completed, or
        None. The engine then finishes ``req`` (FINISHED_STOPPED) through the scheduler."""
        st = self.seqs.get(req.request_id)
        if st is None or st.detokenizer is None:
            return None
        by_token = req.status == RequestStatus.FINISHED_STOPPED  # EOS / stop id ended it
        s = st.detokenizer.update(req.output_token_ids[-1], by_token)
        if s is not None:
            st.stop_string = s
        return s

    # -- called by the engine after sampling -------------------------------------------
    def add_logprobs(self, reqs: Sequence[Request], entries: dict) -> None:
        """Called before the sampled tokens are appended: ``entries[request_id]`` belongs to
        output position ``req.num_output_tokens`` (a re-sampled position replaces its entry)."""
        for req in reqs:
            e = entries.get(req.request_id)
            st = self.seqs.get(req.request_id)
            if e is not None and st is not None and st.logprobs is not None:
                del st.logprobs[req.num_output_tokens :]
                st.logprobs.append(e)

    # -- the output -------------------------------------------------------------------
    def _decoded(self, token_id: int) -> Optional[str]:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprob_dicts(self, entries: list[Logprobs]) -> list[dict[int, Logprob]]:
        return [logprob_dict(e, self._decoded) for e in entries]

    def _text(self, req: Request, st: Optional[_SeqState], reason: Optional[str]) -> str:
        if st is not None and st.detokenizer is not None:
            return st.detokenizer.output_text
        if self.tokenizer is None or not req.output_token_ids:
            return ""
        params = req.sampling_params
        ids = req.output_token_ids
        if reason == "stop" and not params.include_stop_str_in_output:
            ids = ids[:-1]  # NOTE: as vLLM, the EOS / stop token's text is not output
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)

    def make_completion(self, index: int, req: Request, reason: Optional[str]) -> CompletionOutput:
        """The ``CompletionOutput`` of sequence ``req`` (``reason``: its finish reason)."""
        st = self.seqs.get(req.request_id)
        stop_reason = None
        if reason == "refused":
            stop_reason = req.stop_reason or "refused: the request can never fit"
        elif reason == "stop" and st is not None and st.stop_string is not None:
            stop_reason = st.stop_string
        elif reason == "stop" and req.output_token_ids:
            last = req.output_token_ids[-1]
            if last in req.sampling_params.stop_token_ids and last != req.eos_token_id:
                stop_reason = last
        logprobs = cumulative = None
        if st is not None and st.logprobs is not None:
            entries = st.logprobs[: req.num_output_tokens]
            logprobs = self._logprob_dicts(entries)
            cumulative = float(sum(e.sampled_logprob for e in entries))
        return CompletionOutput(
            index=index,
            text=self._text(req, st, reason),
            token_ids=list(req.output_token_ids),
            finish_reason=reason,
            stop_reason=stop_reason,
            cumulative_logprob=cumulative,
            logprobs=logprobs,
        )
