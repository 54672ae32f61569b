"""Beam search over forked block tables (minipaged/engine/beam_search.py, LLM.beam_search).

Reference: transformers' ``generate(num_beams=k, num_return_sequences=k, do_sample=False,
length_penalty=..., early_stopping=...)``, all k returned hypotheses token for token and
their scores, on a random tiny Llama whose EOS row is boosted (so hypotheses also end on
EOS and the early-stop test matters) and on the course model. Then the paging: beams
share blocks (the trace's ``shared_blocks``), copy-on-write copies happen, nothing leaks,
and the reservation refuses what could outgrow the pool.
"""

from __future__ import annotations

import random

import pytest
import torch

from minipaged import LLM, BeamSearchParams, SamplingParams
from minipaged.engine.beam_search import beam_search
from minipaged.worker.paper_runner import PaperModelRunner

VOCAB = 128
rng = random.Random(7)
PROMPTS = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(6)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint dir, transformers model): a random Llama, EOS (id 2) made likely."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(100)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=96,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.mul_(4.0)  # peaky logits: no near-ties between beams
        hf.lm_head.weight[2] *= 4.0  # EOS often among the candidates
    path = tmp_path_factory.mktemp("beam_llama")
    hf.save_pretrained(path)
    return str(path), hf


def hf_beams(hf, prompt, k, max_new, length_penalty, early_stopping=False, pad=0):
    """transformers' k hypotheses, best first: (generated tokens, score)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        o = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            num_beams=k,
            num_return_sequences=k,
            max_new_tokens=max_new,
            do_sample=False,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            pad_token_id=pad,
            return_dict_in_generate=True,
            output_scores=True,
        )
    out = []
    for i in range(k):
        n = int((o.beam_indices[i] != -1).sum())  # generated length of hypothesis i
        out.append((o.sequences[i, len(prompt) : len(prompt) + n].tolist(), float(o.sequences_scores[i])))
    return out


def _check(outs, prompts, hf, k, max_new, lp, es=False):
    for p, o in zip(prompts, outs):
        want = hf_beams(hf, p, k, max_new, lp, es)
        assert [s.token_ids for s in o.sequences] == [w[0] for w in want], f"prompt {p}"
        for s, (_, score) in zip(o.sequences, want):
            assert s.score == pytest.approx(score, abs=1e-4)
            assert s.score == pytest.approx(s.cum_logprob / len(s.token_ids) ** lp, rel=1e-5)


@pytest.mark.parametrize("k,lp", [(2, 1.0), (4, 1.0), (3, 2.0), (3, 0.0)])
def test_equals_transformers(tiny, k, lp):
    path, hf = tiny
    llm = LLM(model=path, block_size=4, num_blocks=160)
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=k, max_tokens=12, length_penalty=lp))
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    assert all(len(o.sequences) == k for o in outs)
    _check(outs, PROMPTS, hf, k, 12, lp)
    if lp == 1.0:  # the EOS boost makes some hypotheses end early
        assert any(s.finish_reason == "stop" for o in outs for s in o.sequences)
    eng = llm.llm_engine
    assert eng.kv_cache_manager.get_num_free_blocks() == eng.num_blocks, "blocks leaked"
    eng.kv_cache_manager.check_invariants()
    trace = llm.trace
    trace.check_invariants()
    assert any(s.shared_blocks for s in trace.steps), "beams should share blocks"


@pytest.mark.parametrize("es", [True, "never"])
def test_early_stopping_variants_equal_transformers(tiny, es):
    path, hf = tiny
    llm = LLM(model=path, block_size=4, num_blocks=160)
    params = BeamSearchParams(beam_width=3, max_tokens=14, length_penalty=-0.5 if es is True else 2.0)
    outs = beam_search(llm.llm_engine, PROMPTS[:4], params, early_stopping=es)
    _check(outs, PROMPTS[:4], hf, 3, 14, params.length_penalty, es)


def test_early_stopping_from_params_through_llm(tiny):
    """``BeamSearchParams.early_stopping`` reaches the search through the public API."""
    path, hf = tiny
    llm = LLM(model=path, block_size=4, num_blocks=160)
    params = BeamSearchParams(beam_width=3, max_tokens=14, length_penalty=2.0, early_stopping="never")
    outs = llm.beam_search(PROMPTS[:2], params)
    _check(outs, PROMPTS[:2], hf, 3, 14, 2.0, "never")
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(early_stopping="sometimes")


def test_paging_small_pool_chunks_and_copies(tiny):
    """A small pool and budget: prompts wait for their reservation, prefill in chunks; the
    result is unchanged and copy-on-write copies happened."""
    path, hf = tiny
    llm = LLM(model=path, block_size=2, num_blocks=40, max_num_seqs=6, max_num_batched_tokens=8)
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    outs = llm.beam_search(PROMPTS, params)
    _check(outs, PROMPTS, hf, 3, 8, 1.0)
    steps = llm.trace.steps
    llm.trace.check_invariants()
    assert max(sum(s.scheduled.values()) for s in steps) <= 8
    assert max(len(s.scheduled) for s in steps) <= 6
    table_blocks = [sum(len(t) for t in s.block_tables.values()) for s in steps]
    used = [40 - s.num_free_blocks for s in steps]
    assert max(t - u for t, u in zip(table_blocks, used)) > 0  # sharing saved blocks
    eng = llm.llm_engine
    assert eng.kv_cache_manager.get_num_free_blocks() == 40
    assert isinstance(eng.model_runner, PaperModelRunner)  # the copies are the paper runner's
    # vLLM v1's scheduler again, on that runner: the tokens of an engine that never beamed
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    fresh = LLM(model=path, block_size=2, num_blocks=40, max_num_seqs=6, max_num_batched_tokens=8)
    assert not isinstance(fresh.llm_engine.model_runner, PaperModelRunner)
    got, want = llm.generate(PROMPTS, sp), fresh.generate(PROMPTS, sp)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_bad_arguments(tiny):
    path, _ = tiny
    llm = LLM(model=path, block_size=4, num_blocks=8, max_num_seqs=4)
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=5, max_tokens=4))
    with pytest.raises(ValueError, match="KV blocks"):
        llm.beam_search([[5] * 20], BeamSearchParams(beam_width=4, max_tokens=20))
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search(PROMPTS[:1], None)
    with pytest.raises(ValueError, match="empty"):
        llm.beam_search([[]], BeamSearchParams(beam_width=2, max_tokens=4))
    with pytest.raises(ValueError, match="early_stopping"):
        beam_search(llm.llm_engine, PROMPTS[:1], BeamSearchParams(beam_width=2), early_stopping="x")
    # the engine still works afterwards
    outs = llm.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=2, max_tokens=3))
    assert len(outs[0].sequences) == 2


def test_course_model_equals_transformers():
    from minipaged.model import COURSE_MODEL_DIR

    if not (COURSE_MODEL_DIR / "config.json").is_file():
        pytest.skip("the course model is not in this checkout")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(COURSE_MODEL_DIR, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(COURSE_MODEL_DIR, local_files_only=True)
    prompts = ["Once upon a time", "The little dog"]
    llm = LLM(block_size=16)
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=12))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    for p, o in zip(prompts, outs):
        ids = tok(p)["input_ids"]
        assert o.prompt_token_ids == ids
        want = hf_beams(hf, ids, 3, 12, 1.0, pad=pad)
        assert [s.token_ids for s in o.sequences] == [w[0] for w in want]
        assert o.sequences[0].text == tok.decode(want[0][0], skip_special_tokens=True)
