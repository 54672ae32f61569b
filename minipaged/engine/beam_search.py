"""Beam search over forked block tables: ``LLM.beam_search(prompts, BeamSearchParams)``.

Mirrors vLLM's ``LLM.beam_search`` (``vllm/entrypoints/llm.py``, ``vllm/beam_search.py``):
the beams are kept outside the scheduler, which runs them: it admits each prompt, prefills
it (in chunks), decodes every beam, and forks and frees the beams the selection picks
(``fork_request`` / ``abort_request``); there is no scheduling loop of its own here.
The selection rule is transformers' (``GenerationMixin._beam_search``, 4.50+), reproduced
exactly so that the outputs are token for token those of
``generate(num_beams=beam_width, do_sample=False, length_penalty=..., early_stopping=False)``.

The paging part (the paper's section 4.4, Fig. 9)
    Every beam is a ``Request`` with its own block table. At each step the ``beam_width``
    best continuations are chosen; each new beam is forked from its parent
    (``fork_request``: its table shares all of the parent's blocks, ``ref_cnt + 1``), then
    the old beams are freed (a block no beam descends from any more returns to the pool). When
    the new token is written, a parent with several children has its partly filled last
    block copied for all but one of them (copy-on-write, ``blocks_to_copy``); full blocks,
    and every block of the prompt, stay shared. So memory holds one copy of each common
    prefix instead of ``beam_width`` copies.

transformers' rule, per prompt (``cur_len`` = tokens so far, ``P`` = prompt length)
    1. ``log_softmax`` of each running beam's logits (float32) + the beam's running score;
       the first step has ``beam_width`` copies of the prompt, scores ``[0, -1e9, ...]``.
    2. top ``K = max(2, 1 + #eos) * beam_width`` of all beams x vocabulary.
    3. a candidate *hits* if its token is an EOS or ``cur_len + 1`` reaches
       ``P + max_tokens``; the next running beams are the best ``beam_width`` that do not hit.
    4. hits among the top ``beam_width`` candidates are finished hypotheses with score
       ``cum_logprob / (cur_len + 1 - P) ** length_penalty``; the ``beam_width`` best
       finished ones are kept (none is added once the early-stop test below passed, or,
       with ``early_stopping=True``, once ``beam_width`` are finished).
    5. stop when every candidate hits (max length), or ``beam_width`` hypotheses are
       finished and the best running score divided by ``(cur_len - P) ** length_penalty``
       (``(max_tokens) ** length_penalty`` for ``early_stopping="never"`` and a positive
       penalty) cannot beat the worst of them, or (``early_stopping=True``) as soon as
       ``beam_width`` are finished.

Inputs / outputs
    ``beam_search(engine, prompts, params, early_stopping=False)`` -> one
    ``BeamSearchOutput`` per prompt, in order: ``sequences`` holds ``beam_width``
    ``BeamSearchSequence`` (generated ``token_ids``, EOS included; ``text``;
    ``cum_logprob``; ``score``; ``finish_reason``), best first. ``engine.trace`` records
    every step: the beams' block tables with their shared blocks.

Invariants
    between steps every running beam holds exactly its computed tokens; each prompt's
    beams never hold more than their reservation (full prompt blocks shared + a private
    tail per beam); at the end every block is back in the pool.

Failure mode
    ``ValueError`` before anything runs for bad prompts, a ``beam_width`` above
    ``max_num_seqs`` or ``max_num_batched_tokens``, or a prompt whose beams could outgrow
    the whole pool; ``RuntimeError`` if the engine still holds requests.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from minipaged.core.kv.kv_cache_manager import max_num_blocks
from minipaged.core.sched.request import Request, RequestStatus
from minipaged.engine.core import make_scheduler
from minipaged.engine.processor import normalize_prompts
from minipaged.sampling_params import BeamSearchParams, SamplingParams
from minipaged.trace import record_step

EARLY_STOPPING = (False, True, "never")
_NEG = -1.0e9  # transformers' "minus infinity" for scores


@dataclass
class BeamSearchSequence:
    token_ids: list[int]  # generated tokens (prompt excluded), the EOS included
    text: str
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence] = field(default_factory=list)  # best first


class _PromptBeams:
    """The beam state of one prompt (one row of transformers' batch)."""

    def __init__(self, rid, text, ids, params: BeamSearchParams, eos, max_new, early_stopping):
        k = params.beam_width
        self.rid, self.text, self.prompt = rid, text, ids
        self.k = k
        self.P = len(ids)
        self.max_length = self.P + max_new
        self.eos = set() if params.ignore_eos else set(eos)
        self.length_penalty = float(params.length_penalty)
        self.early_stopping = early_stopping
        self.num_candidates = max(2, 1 + len(self.eos)) * k
        self.prompt_req = Request(rid, ids, SamplingParams(temperature=0.0, max_tokens=max_new))
        self.running: list[Request] = [self.prompt_req] * k
        self.running_scores = torch.zeros(k, dtype=torch.float32)  # [k]
        self.running_scores[1:] = _NEG
        self.fin_tokens: list[Optional[list[int]]] = [None] * k
        self.fin_cum = torch.full((k,), _NEG, dtype=torch.float32)  # [k] unnormalized
        self.fin_scores = torch.full((k,), _NEG, dtype=torch.float32)  # [k]
        self.fin_done = torch.zeros(k, dtype=torch.bool)  # [k]
        self.unsatisfied = True
        self.cur_len = self.P
        self.done = False
        self._next_beam = 0

    def reservation(self, block_size: int) -> int:
        """The most blocks its beams ever hold: shared full prompt blocks + private tails."""
        return max_num_blocks(self.max_length - 1, block_size, self.k, self.P)

    def beams(self) -> list[Request]:
        return list({id(r): r for r in self.running}.values())

    def advance(self, logprobs: torch.Tensor, scheduler) -> None:
        """One transformers step from the running beams' log-probs ``[k, V]``; the new
        beams are forked from their parents and the old ones freed, by the scheduler."""
        k, K = self.k, self.num_candidates
        V = logprobs.shape[-1]
        acc = (logprobs + self.running_scores[:, None]).reshape(-1)  # [k * V]
        top_lp, top_idx = torch.topk(acc, K)  # [K], sorted
        parents = (top_idx // V).tolist()
        tokens = (top_idx % V).tolist()
        at_max = self.cur_len + 1 >= self.max_length
        hits = torch.tensor([at_max or t in self.eos for t in tokens])  # [K]
        # e. the next running beams: the best k that do not hit
        running_lp = top_lp + hits.to(torch.float32) * _NEG  # [K]
        nxt = torch.topk(running_lp, k)[1]  # [k]
        # f. finished hypotheses: hits within the top k, length-normalized
        fin = top_lp / ((self.cur_len + 1 - self.P) ** self.length_penalty)  # [K]
        full = bool(self.fin_done.all()) and self.early_stopping is True
        fin = fin + float(full) * _NEG
        fin = fin + float(not self.unsatisfied) * _NEG
        just = hits & (torch.arange(K) < k)  # [K]
        fin = fin + (~just) * _NEG
        merged = torch.cat((self.fin_scores, fin))  # [k + K]
        keep = torch.topk(merged, k)[1].tolist()
        cand_tokens = [self.running[p].output_token_ids + [t] for p, t in zip(parents, tokens)]
        old_tokens, old_cum, old_done = self.fin_tokens, self.fin_cum, self.fin_done
        self.fin_tokens = [old_tokens[i] if i < k else cand_tokens[i - k] for i in keep]
        self.fin_cum = torch.stack([old_cum[i] if i < k else top_lp[i - k] for i in keep])
        self.fin_done = torch.stack([old_done[i] if i < k else just[i - k] for i in keep])
        self.fin_scores = merged[keep]
        # the new beams: fork each from its parent, then free the old beams
        old = self.beams()
        new = []
        for i in nxt.tolist():
            parent = self.running[parents[i]]
            child = Request(
                f"{self.rid}.{self._next_beam}",
                self.prompt,
                self.prompt_req.sampling_params,
                output_token_ids=parent.output_token_ids + [tokens[i]],
                num_computed_tokens=parent.num_tokens,
                status=RequestStatus.RUNNING,
            )
            self._next_beam += 1
            scheduler.fork_request(parent, child)
            new.append(child)
        for r in old:
            scheduler.abort_request(r.request_id)
        self.running = new
        self.running_scores = running_lp[nxt]
        # g. early-stop test and the stopping condition
        self.cur_len += 1
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_length - self.P
        else:
            best_len = self.cur_len - self.P
        best_running = self.running_scores[0] / (best_len**self.length_penalty)
        if bool(self.fin_done.all()):
            self.unsatisfied = self.unsatisfied and bool(best_running > self.fin_scores.min())
        stop_full = bool(self.fin_done.all()) and self.early_stopping is True
        self.done = not self.unsatisfied or stop_full or bool(hits.all())

    def output(self, decode) -> BeamSearchOutput:
        seqs = []
        for toks, cum, score, done in zip(
            self.fin_tokens, self.fin_cum.tolist(), self.fin_scores.tolist(), self.fin_done.tolist()
        ):
            if not done:
                continue
            reason = "stop" if toks and toks[-1] in self.eos else "length"
            seqs.append(BeamSearchSequence(list(toks), decode(toks), cum, score, reason))
        return BeamSearchOutput(self.rid, self.text, list(self.prompt), seqs)


def beam_search(
    engine, prompts, params: BeamSearchParams, early_stopping: Union[bool, str, None] = None
) -> list[BeamSearchOutput]:
    """Beam search for every prompt, batched across prompts; see the module docstring.

    ``early_stopping`` overrides ``params.early_stopping`` when given."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    if early_stopping is None:
        early_stopping = params.early_stopping
    if early_stopping not in EARLY_STOPPING:
        raise ValueError(f"early_stopping must be one of {EARLY_STOPPING}, got {early_stopping!r}")
    cfg = engine.config
    if cfg.scheduling == "static":
        raise ValueError("beam search needs scheduling='continuous' (it forks block tables)")
    k = params.beam_width
    if k > cfg.max_num_seqs or k > cfg.max_num_batched_tokens:
        raise ValueError(
            f"beam_width={k} exceeds max_num_seqs={cfg.max_num_seqs} or "
            f"max_num_batched_tokens={cfg.max_num_batched_tokens}"
        )
    prompt_list = normalize_prompts(prompts)
    tokenized = [engine.tokenize(p, name=f"prompts[{i}]") for i, p in enumerate(prompt_list)]
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine still holds requests from an interrupted call")
    kv = engine.kv_cache_manager
    bs = kv.block_size
    states = []
    for i, (text, ids) in enumerate(tokenized):
        max_new = min(params.max_tokens, engine.max_model_len - len(ids))
        if max_new < 1:
            raise ValueError(
                f"prompts[{i}] leaves no room to generate (max_model_len={engine.max_model_len})"
            )
        st = _PromptBeams(str(i), text, ids, params, engine.eos_token_ids, max_new, early_stopping)
        if st.reservation(bs) > kv.num_blocks:
            raise ValueError(
                f"prompts[{i}]: {k} beams may need {st.reservation(bs)} KV blocks but the pool "
                f"has {kv.num_blocks}; lower beam_width or max_tokens"
            )
        states.append(st)
    engine.reset_trace({"beam_search": True, "beam_width": k, "early_stopping": early_stopping})
    # NOTE: beams fork block tables, which vLLM v1 cannot: the paper's scheduler runs them,
    # over the same KV caches (the engine is idle, so every block is free), and the paper's
    # runner does their copy-on-write copies (it runs vLLM v1's outputs as they are, after)
    core = engine.core
    paper = make_scheduler(
        cfg, core.model_info.num_blocks, core.num_cpu_blocks, engine.max_model_len, paper=True
    )
    v1, core.scheduler = core.scheduler, paper
    core.executor.use_paper_runner()
    try:
        _run(engine, states)
    finally:  # leave the scheduler and the pool empty whatever happened
        sched = core.scheduler
        for st in states:
            for r in (st.prompt_req, *st.beams()):
                sched.abort_request(r.request_id)
        drain = sched.schedule()  # NOTE: tells the worker to drop every beam it still holds
        core.executor.execute_model(drain)
        sched.update_from_output(drain, {})
        core.scheduler = v1
    return [st.output(engine.decode) for st in states]


def _run(engine, states: list[_PromptBeams]) -> None:
    """The engine's step, with the beam selection in place of the sampler: the scheduler
    admits each prompt (once its reservation fits), prefills it (in chunks) and decodes
    every beam; after the forward, each prompt whose beams all ran picks its next beams,
    which the scheduler forks from their parents (``fork_request``) while it frees the
    old ones. NOTE: the reservations keep the pool from ever running out, so no beam is
    preempted, and beams take their prompt's place in arrival order, so the decodes come
    before any later prompt's prefill and all fit the token budget."""
    sched, executor, cfg = engine.core.scheduler, engine.core.executor, engine.config
    kv = sched.kv_cache_manager
    waiting = deque(states)
    active: list[_PromptBeams] = []
    reserved = 0
    trace = engine.trace
    for st in states:
        trace.requests[st.rid] = {"prompt_len": st.P, "output_len": 0, "arrival_step": 0, "finish_step": None}
    step = 0
    while waiting or active:
        while (
            waiting
            and reserved + waiting[0].reservation(kv.block_size) <= kv.num_blocks
            and (sum(s.k for s in active) + waiting[0].k <= min(cfg.max_num_seqs, cfg.max_num_batched_tokens))
        ):
            st = waiting.popleft()
            active.append(st)
            reserved += st.reservation(kv.block_size)
            sched.add_request(st.prompt_req)
        out = sched.schedule()
        # the worker: copy-on-write copies, then the forward (no sampling: the beams choose)
        logits, _ = executor.compute_logits(out)  # [B, V], one row per scheduled request
        row = {id(req): b for b, (req, _) in enumerate(out.scheduled)}
        n = {id(req): k for req, k in out.scheduled}
        if logits is not None:
            logits = logits.float()
        done = []
        for st in list(active):
            if not all(id(r) in row and r.num_computed_tokens + n[id(r)] == r.num_tokens for r in st.running):
                continue  # still prefilling
            rows = torch.tensor([row[id(r)] for r in st.running])
            st.advance(torch.log_softmax(logits[rows], dim=-1), sched)  # [k, V]
            if st.done:
                for r in st.beams():
                    sched.abort_request(r.request_id)
                st.running = []
                active.remove(st)
                reserved -= st.reservation(kv.block_size)
                done.append(st)
        sched.update_from_output(out, {})  # NOTE: every request that sampled was replaced
        rec = record_step(sched, out, step)
        rec.finished_ids = [st.rid for st in done]
        trace.record(rec)
        for st in done:
            trace.requests[st.rid].update(
                finish_step=step, output_len=max((len(t) for t in st.fin_tokens if t is not None), default=0)
            )
        step += 1
