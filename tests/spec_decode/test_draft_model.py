"""DraftModelProposer: its own paged cache, addressed by the target's block ids.

Reference: transformers' LlamaForCausalLM recomputing the whole sequence at every token
(no cache at all). With the draft model equal to the checkpoint, greedy drafts must be the
checkpoint's greedy continuation, however the block table is scattered and whatever stale
K/V the previous step left in the slots it rewrites.
"""

import pytest
import torch
from _tiny_llama import VOCAB, make_tiny_llama

from minipaged.model import load_model
from minipaged.sample import RowContext
from minipaged.sampling_params import SamplingParams
from minipaged.spec_decode import DraftModelProposer, DraftSeq, build_model_input

BS = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(ckpt).eval()


@pytest.fixture(scope="module")
def draft(ckpt):
    model, _ = load_model(ckpt)
    return model


def hf_greedy(hf, tokens, n):
    tokens = list(tokens)
    out = []
    with torch.no_grad():
        for _ in range(n):
            t = int(hf(torch.tensor([tokens + out])).logits[0, -1].argmax())
            out.append(t)
    return out


def _greedy_req(prompt, output=()):
    return RowContext(list(prompt), list(output), SamplingParams(temperature=0.0, max_tokens=64))


def test_drafts_follow_the_model_across_steps_with_rejected_slots_rewritten(draft, hf):
    k = 3
    prop = DraftModelProposer(draft, num_blocks=16, block_size=BS, num_speculative_tokens=k)
    prop.check_invariants()
    table = [7, 3, 12, 1, 9, 5]  # scattered on purpose
    prompt = [5, 17, 33, 8, 41, 9, 20]
    P = len(prompt)
    t0 = hf_greedy(hf, prompt, 1)[0]
    # step 1: the target prefilled the prompt and sampled t0; the draft runs prompt + t0
    (d,), _ = prop.propose([DraftSeq(table, 0, prompt + [t0], k, _greedy_req(prompt, [t0]))])
    assert d == hf_greedy(hf, prompt + [t0], k)
    # step 2: the target accepted d[0] and disagreed on d[1]: it chose x != d[1]. The draft
    # cache holds d[1] at position P + 2 (a rejected slot); pass 0 rewrites it with x.
    x = (d[1] + 1) % VOCAB
    ctx = prompt + [t0, d[0], x]
    (d2,), _ = prop.propose([DraftSeq(table, P, [t0, d[0], x], k, _greedy_req(prompt, [t0, d[0], x]))])
    assert d2 == hf_greedy(hf, ctx, k)
    # the rewritten cache equals a one-shot prefill of the same tokens into a fresh cache
    fresh = draft.allocate_kv_caches(16, BS)
    with torch.inference_mode():
        draft.forward(build_model_input([(table, 0, ctx)], BS), fresh)
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(len(ctx))])
    for (k1, v1), (k2, v2) in zip(prop.kv_caches, fresh):
        torch.testing.assert_close(k1.flatten(0, 1)[slots], k2.flatten(0, 1)[slots], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v1.flatten(0, 1)[slots], v2.flatten(0, 1)[slots], atol=1e-5, rtol=1e-5)


def test_batch_with_a_prefill_chunk_gives_the_same_drafts(draft, hf):
    k = 2
    prop = DraftModelProposer(draft, num_blocks=16, block_size=BS, num_speculative_tokens=k)
    a_prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    b_prompt = [30, 31, 32, 33, 34]
    ta = hf_greedy(hf, a_prompt, 1)[0]
    # request a: first chunk of its prompt, nothing to propose; b: whole prompt + its token
    seqs = [
        DraftSeq([0, 1, 2], 0, a_prompt[:5], 0),
        DraftSeq([4, 5, 6], 0, b_prompt + [hf_greedy(hf, b_prompt, 1)[0]], k, _greedy_req(b_prompt)),
    ]
    drafts, probs = prop.propose(seqs)
    assert probs is None  # all greedy
    assert drafts[0] == [] and drafts[1] == hf_greedy(hf, b_prompt + [hf_greedy(hf, b_prompt, 1)[0]], k)
    # a's second chunk: the rest of the prompt and its sampled token
    (da,), _ = prop.propose([DraftSeq([0, 1, 2], 5, a_prompt[5:] + [ta], k, _greedy_req(a_prompt, [ta]))])
    assert da == hf_greedy(hf, a_prompt + [ta], k)


def test_sampled_drafts_report_their_distribution(draft):
    k = 3
    prop = DraftModelProposer(draft, num_blocks=8, block_size=BS, num_speculative_tokens=k)
    req = RowContext([5, 6, 7], [8], SamplingParams(temperature=1.0, top_k=5), None)
    seq = DraftSeq([2, 0, 1], 0, [5, 6, 7, 8], k, req, seed=42)
    (d,), q = prop.propose([seq])
    assert len(d) == k and q.shape == (k, VOCAB)
    torch.testing.assert_close(q.sum(-1), torch.ones(k))
    assert all(float(q[j, t]) > 0 for j, t in enumerate(d))  # each draft was possible under q
    assert all(int((q[j] > 0).sum()) == 5 for j in range(k))  # top_k applied to q
    (again,), _ = prop.propose([seq])
    assert again == d  # seeded


def test_lookahead_slots_are_required(draft):
    prop = DraftModelProposer(draft, num_blocks=8, block_size=BS, num_speculative_tokens=3)
    # 4 tokens fill the only block; the proposal passes need positions 4 and 5
    with pytest.raises(RuntimeError, match="cannot hold position"):
        prop.propose([DraftSeq([3], 0, [5, 6, 7, 8], 3, _greedy_req([5, 6, 7], [8]))])


def test_drafts_stop_at_the_draft_models_context(draft):
    prop = DraftModelProposer(draft, num_blocks=32, block_size=BS, num_speculative_tokens=3)
    L = draft.max_model_len - 1  # the last sampled token sits at max_model_len - 2
    table = list(range(16))
    tokens = [7] * L
    (d,), _ = prop.propose([DraftSeq(table, 0, tokens, 3, _greedy_req(tokens[:-1], tokens[-1:]))])
    assert len(d) == 2  # pass 1 writes position max_model_len - 1, the last one


def test_layer_skip_draft_is_the_first_layers(ckpt, hf, tmp_path):
    from minipaged.spec_decode import write_layer_skip_draft

    path = write_layer_skip_draft(ckpt, tmp_path / "draft", 1)
    small, _ = load_model(path)
    assert small.num_layers == 1 and small.vocab_size == VOCAB
    # its greedy next token is transformers' model cut after layer 0, norm and LM head
    ids = torch.tensor([[5, 17, 33, 8]])
    with torch.no_grad():
        h = hf.model(ids, output_hidden_states=True).hidden_states[1]  # after layer 0
        want = hf.lm_head(hf.model.norm(h))[0, -1]
        got = small.forward(
            build_model_input([([0, 1], 0, [5, 17, 33, 8])], BS), small.allocate_kv_caches(2, BS)
        )[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="num_layers"):
        write_layer_skip_draft(ckpt, tmp_path / "bad", 2)  # the tiny model has 2 layers


def test_teacher_forced_replay_counts_what_the_online_drafts_would(draft, hf):
    """The replay's (drafts, accepted) per step equal those of DraftModelProposer run step by
    step against a reference output (here: the checkpoint's greedy continuation with every
    fifth token changed, so some drafts are rejected)."""
    from minipaged.spec_decode import replay_greedy, teacher_forced_proposer

    prompt = [5, 17, 33, 8, 41]
    out = []
    for i in range(14):
        t = hf_greedy(hf, prompt + out, 1)[0]
        out.append((t + 1) % VOCAB if i % 5 == 3 else t)
    k = 3
    replayed = replay_greedy(prompt, out, teacher_forced_proposer(draft, prompt, out, BS), k)
    # online: the proposer with its paged cache, fed exactly what the target would keep
    prop = DraftModelProposer(draft, num_blocks=16, block_size=BS, num_speculative_tokens=k)
    table = list(range(8))
    start, fed, i, online = 0, prompt + out[:1], 1, []
    while i < len(out):
        n = min(k, len(out) - 1 - i)
        (d,), _ = prop.propose([DraftSeq(table, start, fed, n, _greedy_req(prompt, out[:i]))])
        a = 0
        while a < len(d) and d[a] == out[i + a]:
            a += 1
        online.append((len(d), a))
        # as the engine will: start at the target's num_computed_tokens, which lags the
        # known tokens by one (x, the last sampled), and feed x, the accepted drafts and
        # the target's own next token
        start += len(fed) - 1
        fed = out[i - 1 : i + a + 1]
        i += a + 1
    assert replayed == online
    assert any(a < d for d, a in online) and any(a > 0 for _, a in online)


def test_prepare_inputs_by_hand(draft):
    """The module docstring's step on a tiny case (block size 4, k = 4). ``a``: its 5-token
    prompt computed this step and one token sampled: pass 0 runs all 6 tokens from 0; 3
    drafts, not 4: passes 1 and 2 write positions 6 and 7, the last of its table's 8 slots.
    ``b``: a prefill chunk (3 of 6 prompt tokens, nothing sampled): its K/V only, no drafts.
    ``c``: sampled, but asks for logprobs: K/V, no drafts. ``d``: nothing new to run."""
    from minipaged.worker.model_runner import CachedRequestState

    def state(rid, prompt, output, blocks, computed, **params):
        return CachedRequestState(rid, prompt, output, SamplingParams(**params), blocks, computed)

    requests = {
        "a": state("a", [1, 2, 3, 4, 5], [6], [7, 2], 5, temperature=0.0),
        "b": state("b", [1, 2, 3, 4, 5, 6], [], [3, 4], 3, temperature=0.0),
        "c": state("c", [9, 8], [7], [5], 2, temperature=0.0, logprobs=1),
        "d": state("d", [9, 8], [], [6], 2, temperature=0.0),
    }
    prop = DraftModelProposer(draft, 8, BS, 4)
    got = {
        rid: (s.block_ids, s.start, s.token_ids, s.num_drafts)
        for rid, s in prop.prepare_inputs(requests, {"a": 0, "b": 0, "c": 0, "d": 2}, sampled={"a", "c"})
    }
    assert got == {
        "a": ([7, 2], 0, [1, 2, 3, 4, 5, 6], 3),
        "b": ([3, 4], 0, [1, 2, 3], 0),
        "c": ([5], 0, [9, 8, 7], 0),
    }
