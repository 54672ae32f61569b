"""The shipped course model: loads offline, is small, and minipaged generates what transformers does.

The checkpoint in ``minipaged/data/course_model`` is written by
``scripts/train_course_model.py``; these tests check the artifact, not the training run.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
import transformers

from minipaged.model import COURSE_MODEL_DIR, ModelInput, load_model

REPO = Path(__file__).resolve().parents[2]
MAX_BYTES = 20 * 2**20
PROMPTS = ["Once upon a time", "One day, Tom found", "Lily was sad because"]
NEW_TOKENS = 32
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def hf():
    """transformers' model and tokenizer, strictly from local files."""
    model = transformers.AutoModelForCausalLM.from_pretrained(COURSE_MODEL_DIR, local_files_only=True)
    tok = transformers.AutoTokenizer.from_pretrained(COURSE_MODEL_DIR, local_files_only=True)
    return model.eval(), tok


@pytest.fixture(scope="module")
def ours():
    return load_model()  # None -> the course model


def test_checkpoint_files_and_size():
    names = {p.name for p in COURSE_MODEL_DIR.iterdir()}
    for required in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert required in names, f"{required} missing from {COURSE_MODEL_DIR}"
    size = sum(p.stat().st_size for p in COURSE_MODEL_DIR.iterdir() if p.is_file())
    assert size <= MAX_BYTES, f"course model is {size / 2**20:.1f} MiB > 20 MiB"


def test_loads_offline_with_transformers(hf):
    model, tok = hf
    c = model.config
    assert c.architectures == ["LlamaForCausalLM"]
    assert c.num_key_value_heads < c.num_attention_heads  # grouped-query attention
    assert c.tie_word_embeddings
    assert model.dtype == torch.float32
    ids = tok("Once upon a time").input_ids
    assert ids[0] == tok.bos_token_id == c.bos_token_id  # the tokenizer prepends <|bos|>
    assert tok.decode(ids, skip_special_tokens=True) == "Once upon a time"
    assert tok.eos_token_id == c.eos_token_id


def test_load_model_default_is_course_model(ours, hf):
    model, tok = ours
    ref, _ = hf
    assert model.num_layers == ref.config.num_hidden_layers
    assert (model.num_heads, model.num_kv_heads) == (
        ref.config.num_attention_heads,
        ref.config.num_key_value_heads,
    )
    assert model.vocab_size == ref.config.vocab_size == len(tok)
    assert model.max_model_len == ref.config.max_position_embeddings
    assert model.eos_token_id == tok.eos_token_id


def _paged_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """Prefill the prompt, then decode one token per step, over a reversed block table."""
    num_blocks = -(-(len(prompt_ids) + max_new_tokens) // BLOCK_SIZE)
    table = list(range(num_blocks))[::-1]  # physical blocks in reverse order
    kv_caches = model.allocate_kv_caches(num_blocks, BLOCK_SIZE)
    ids, out, new = list(prompt_ids), [], list(prompt_ids)
    while len(out) < max_new_tokens:
        start = len(ids) - len(new)
        pos = list(range(start, len(ids)))
        inp = ModelInput(
            input_ids=torch.tensor(new),
            positions=torch.tensor(pos),
            slot_mapping=torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in pos]),
            block_tables=torch.tensor([table], dtype=torch.int32),
            seq_lens=torch.tensor([len(ids)], dtype=torch.int32),
            cu_seqlens_q=torch.tensor([0, len(new)], dtype=torch.int32),
            logits_indices=torch.tensor([len(new) - 1]),
            max_query_len=len(new),
            max_seq_len=len(ids),
        )
        with torch.no_grad():
            tok = int(model(inp, kv_caches)[0].argmax())
        out.append(tok)
        if tok == eos:
            break
        ids.append(tok)
        new = [tok]
    return out


@pytest.fixture(scope="module")
def continuations(ours):
    """prompt -> minipaged's greedy continuation (token ids), computed once."""
    model, tok = ours
    return {p: _paged_greedy(model, tok(p).input_ids, NEW_TOKENS, tok.eos_token_id) for p in PROMPTS}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_equals_transformers(continuations, hf, prompt):
    ref, tok = hf
    prompt_ids = tok(prompt).input_ids
    with torch.no_grad():
        expected = ref.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = expected[0, len(prompt_ids) :].tolist()
    got = continuations[prompt]
    assert got == expected, f"{prompt!r}: {tok.decode(got)!r} != {tok.decode(expected)!r}"


def _corpus_words() -> set[str]:
    spec = importlib.util.spec_from_file_location(
        "train_course_model", REPO / "scripts" / "train_course_model.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return {w for s in mod.make_corpus(500, seed=0) for w in re.findall(r"[A-Za-z]+", s)}


def test_continuation_reads_as_english(ours, continuations):
    """Every word of a greedy continuation is a word of the training grammar, with spaces."""
    _, tok = ours
    words = _corpus_words()
    for prompt, ids in continuations.items():
        text = tok.decode(ids, skip_special_tokens=True)
        found = re.findall(r"[A-Za-z]+", text)
        assert len(found) >= 6, f"{prompt!r} -> {text!r}"
        unknown = [w for w in found if w not in words]
        assert not unknown, f"{prompt!r} -> {text!r}: not English words of the corpus: {unknown}"
