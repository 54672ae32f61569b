"""Tensor parallelism at the model level: two gloo ranks, the same inputs, the same logits.

The reference is the same checkpoint in one process (``load_model``, world size 1), itself
checked against transformers in ``tests/model/test_model.py``; the last step is also compared with
transformers directly. Three checkpoints: the course model (GQA 8/2, tied embeddings), a
random Llama with GQA 4/2 and an untied LM head (``tests/_tiny_llama.py``), and a random
Qwen2 (q/k/v biases: the column-parallel bias shards). One ``WorkerGroup`` of 2 spawned
ranks holds all three (one process-group start).
"""

from __future__ import annotations

import os

import pytest
import torch
from _tiny_llama import make_tiny_llama
from _tp_cases import BLOCK_SIZE, NUM_BLOCKS, build_input, left_behind, make_qwen2, shm_segments

from minipaged.distributed import WorkerDiedError, WorkerError, WorkerGroup
from minipaged.model import COURSE_MODEL_DIR, load_model
from minipaged.model.parallel import (
    TensorParallelGroup,
    available_devices,
    check_tensor_parallel_size,
    shard_range,
)

TP = 2
ATOL = 1e-4
pytestmark = pytest.mark.skipif(available_devices("cpu") < TP, reason="needs 2 CPU cores")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {
        "course": str(COURSE_MODEL_DIR),
        "llama-gqa": make_tiny_llama(tmp_path_factory.mktemp("llama")),
        "qwen2": make_qwen2(tmp_path_factory.mktemp("qwen2")),
    }


@pytest.fixture(scope="module")
def group(checkpoints):
    kwargs = dict(models=checkpoints, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    with WorkerGroup(TP, "_tp_cases:MultiModelWorker", kwargs) as g:
        yield g


def _ids(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _steps(vocab):
    """Three steps over shuffled block tables: A and B prefill together; A's second prefill
    chunk beside B's decode (a mixed, chunked step); both decode."""
    a, b = _ids(11, vocab, 1), _ids(6, vocab, 2)
    perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(3)).tolist()
    tables = [perm[:5], perm[5:9]]  # A: 17 + 1 tokens, B: 6 + 2 tokens
    steps = [
        ([(a[:7], 0), (b, 0)], tables),  # prefill: A's first chunk, B whole
        ([(a[7:], 7), ([5], 6)], tables),  # A's second chunk, B decodes
        ([([6], 11), ([7], 7)], tables),  # both decode
    ]
    seqs = [a + [6], b + [5, 7]]  # the full sequences after the last step
    return steps, seqs


@pytest.mark.parametrize("name", ["course", "llama-gqa", "qwen2"])
def test_logits_equal_world_size_one_and_transformers(group, checkpoints, name):
    ref, _ = load_model(checkpoints[name])  # world size 1, in this process
    kv = ref.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
    steps, seqs = _steps(ref.vocab_size)
    for i, (chunks, tables) in enumerate(steps):
        inp = build_input(chunks, tables)
        with torch.inference_mode():
            want = ref(inp, kv)  # [B, vocab]
        got = group.call("run", name, "execute_model", inp, True)
        assert torch.equal(got[0], got[1]), "every rank must have the same (all-gathered) logits"
        torch.testing.assert_close(got[0], want, atol=ATOL, rtol=0, msg=lambda m: f"{name} step {i}: {m}")

    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[name]).eval()
    with torch.no_grad():
        for row, ids in enumerate(seqs):
            hf_last = hf(input_ids=torch.tensor([ids])).logits[0, -1].float()
            torch.testing.assert_close(got[0][row], hf_last, atol=ATOL, rtol=0, msg=lambda m: f"{name}: {m}")

    # one block table for both ranks: rank r's block b holds KV heads r*KVH/2 .. of the same tokens
    blocks = steps[0][1][0] + steps[0][1][1]
    for layer in range(ref.num_layers):
        parts = group.call("run", name, "kv_blocks", layer, blocks)
        for which in (0, 1):  # K, V
            joined = torch.cat([p[which] for p in parts], dim=2)  # [n, bs, KVH, D]
            full = kv[layer][which][torch.tensor(blocks)]
            torch.testing.assert_close(joined, full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["course", "llama-gqa"])
def test_each_rank_allocates_its_heads_of_the_same_blocks(group, checkpoints, name):
    ref, _ = load_model(checkpoints[name])
    infos = group.call("run", name, "info")
    full_kv = sum(
        t.numel() * t.element_size() for kv in ref.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE) for t in kv
    )
    for r, info in enumerate(infos):
        assert info["rank"] == r and info["tp_size"] == TP
        assert info["cache_shape"] == [NUM_BLOCKS, BLOCK_SIZE, ref.num_kv_heads // TP, ref.head_dim]
        assert (info["num_heads"], info["num_kv_heads"]) == (ref.num_heads // TP, ref.num_kv_heads // TP)
        assert info["kv_cache_bytes"] * TP == full_kv
        shapes = info["param_shapes"]
        layer = "model.layers.0."
        qkv_rows = (ref.num_heads + 2 * ref.num_kv_heads) * ref.head_dim // TP
        assert shapes[layer + "self_attn.qkv_proj.weight"][0] == qkv_rows
        assert shapes[layer + "self_attn.o_proj.weight"][1] == ref.num_heads * ref.head_dim // TP
        assert shapes[layer + "mlp.down_proj.weight"][1] == ref.config.intermediate_size // TP
        assert shapes[layer + "input_layernorm.weight"] == [ref.config.hidden_size]  # replicated
        assert shapes["model.embed_tokens.weight"][0] == -(-ref.vocab_size // TP)


# -- sharded loading, in this process (no collectives are needed to load) ------------------


@pytest.mark.parametrize("name", ["course", "qwen2"])
def test_rank_shards_put_together_are_the_full_weights(checkpoints, name):
    """Each rank reads its shard through safetensors slices; the shards side by side (along
    each layer's split dimension) are exactly the world-size-1 parameters."""
    full, _ = load_model(checkpoints[name])
    shards = [load_model(checkpoints[name], tp=TensorParallelGroup(r, TP))[0] for r in range(TP)]
    ps = [dict(m.named_parameters()) for m in shards]
    for pname, p in full.named_parameters():
        parts = [d[pname] for d in ps]
        fused = "qkv" if "qkv_proj" in pname else ("gate", "up") if "gate_up_proj" in pname else None
        if fused:  # each rank's slice of q, k, v (gate, up) sits in its own rows of the fused weight
            owner = pname.rsplit(".", 2)[0]  # the attention / MLP module with shard_rows
            for shard in fused:
                got = torch.cat(
                    [d[pname][m.get_submodule(owner).shard_rows(shard)] for m, d in zip(shards, ps)]
                )
                assert torch.equal(got, p[full.get_submodule(owner).shard_rows(shard)]), f"{pname} {shard}"
        elif pname.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, dim=1), p), pname
        elif "embed_tokens" in pname or "lm_head" in pname:
            rows = [d[pname][: shard_range(p.shape[0], r, TP)[1]] for r, d in enumerate(ps)]
            assert torch.equal(torch.cat(rows), p), pname
        else:  # norms, the o_proj bias: replicated
            for part in parts:
                assert torch.equal(part, p), pname


def test_vocab_padding_rows_are_zero():
    """A vocabulary that N does not divide: rank r holds ceil(V / N) rows, the last rank's
    rows past V are zero (their logits are cut off after the all-gather)."""
    assert [shard_range(5, r, 4) for r in range(4)] == [(0, 2), (2, 2), (4, 1), (5, 0)]
    assert [shard_range(788, r, 2) for r in range(2)] == [(0, 394), (394, 394)]


# -- bad sizes --------------------------------------------------------------------------


def test_tensor_parallel_size_that_does_not_divide_the_heads_is_refused():
    import transformers

    course = transformers.AutoConfig.from_pretrained(COURSE_MODEL_DIR)  # 8 heads, 2 KV heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide num_attention_heads \(8\)"):
        check_tensor_parallel_size(3, course)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide num_key_value_heads \(2\)"):
        check_tensor_parallel_size(4, course)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
        check_tensor_parallel_size(0, course)
    with pytest.raises(ValueError, match="tensor_parallel_size=4"):
        load_model(None, tp=TensorParallelGroup(0, 4))
    assert check_tensor_parallel_size(2, course) == 2


def test_tensor_parallel_size_beyond_the_devices_is_refused():
    import transformers

    n = 1 << available_devices("cpu").bit_length()  # a power of two above the core count
    cfg = transformers.LlamaConfig(
        num_attention_heads=n, num_key_value_heads=n, intermediate_size=n, hidden_size=n
    )
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={n} exceeds the \d+ CPU cores"):
        check_tensor_parallel_size(n, cfg, "cpu")


# -- failures -----------------------------------------------------------------------------


def _running(pids) -> list[int]:
    """Those of ``pids`` that are still a process of ours (neither exited nor reaped)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        if fields[0] != "Z" and int(fields[1]) == os.getpid():
            out.append(pid)
    return out


def test_a_killed_worker_stops_the_group_naming_its_rank(checkpoints):
    import signal
    import time

    kwargs = dict(
        models={"llama-gqa": checkpoints["llama-gqa"]}, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE
    )
    group = WorkerGroup(TP, "_tp_cases:MultiModelWorker", kwargs)
    steps, _ = _steps(128)
    chunks, tables = steps[0]
    group.call("run", "llama-gqa", "execute_model", build_input(chunks, tables))
    segments = shm_segments(p.pid for p in group.procs)
    os.kill(group.procs[1].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"rank 1 died \(signal 9") as err:
        group.call("run", "llama-gqa", "execute_model", build_input(*steps[1]))
    assert err.value.rank == 1
    assert time.monotonic() - t0 < 10.0, "the death must be noticed within seconds"
    assert not any(group.alive()) and not _running(p.pid for p in group.procs)
    assert not left_behind(segments), f"shared memory left behind: {left_behind(segments)}"
    with pytest.raises(RuntimeError, match="shut down"):
        group.call("run", "llama-gqa", "info")


def test_a_failing_worker_method_names_its_rank(checkpoints):
    kwargs = dict(
        models={"llama-gqa": checkpoints["llama-gqa"]}, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE
    )
    with WorkerGroup(TP, "_tp_cases:MultiModelWorker", kwargs) as group:
        with pytest.raises(WorkerError, match=r"rank [01] failed in 'run': IndexError"):
            group.call("run", "llama-gqa", "kv_blocks", 99, [0])
        assert not any(group.alive())  # a failed step ends the group
    assert not _running(p.pid for p in group.procs)


def test_a_worker_that_cannot_start_is_reported():
    import multiprocessing

    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(
        WorkerError, match=r"rank \d failed in 'start': ValueError: num_blocks must be a positive"
    ):
        WorkerGroup(TP, "minipaged.distributed.shard_worker:ModelShardWorker", dict(model=None, num_blocks=0))
    assert not _running({p.pid for p in multiprocessing.active_children()} - before)


def test_a_state_dict_loads_the_same_shard_as_the_safetensors_slices(checkpoints):
    """A checkpoint without slices to read (a hub id, ``.bin``) goes through the whole state dict;
    each rank keeps the same shard it would have read from the safetensors file."""
    import transformers

    from minipaged.model.llama import LlamaForCausalLM

    path = checkpoints["llama-gqa"]
    state = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
    config = transformers.AutoConfig.from_pretrained(path)
    for rank in range(TP):
        tp = TensorParallelGroup(rank, TP)
        from_slices, _ = load_model(path, tp=tp)
        with torch.device("meta"):
            model = LlamaForCausalLM(config, tp=tp)
        model = model.to_empty(device="cpu")
        model.load_weights(state)
        want = dict(from_slices.named_parameters())
        for name, p in model.named_parameters():
            assert torch.equal(p, want[name]), f"rank {rank}: {name}"
