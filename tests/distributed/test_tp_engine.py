"""LLM(tensor_parallel_size=2) on a CPU (gloo): the same greedy tokens as tp=1 and as
transformers, under preemption, chunked prefill and prefix caching at once; a killed worker
and a KeyboardInterrupt stop the engine cleanly.

One engine configuration exercises all three mechanisms: a pool too small for the batch
(recompute preemption), a token budget smaller than a prompt (chunked prefill) and prompts
that share their first blocks (prefix caching); the trace shows each happened. Checkpoints:
the course model (GQA 8 / 2, tied embeddings) and a random Llama with GQA 4 / 2 and an untied
LM head (``tests/_tiny_llama.py``).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from _tiny_llama import make_tiny_llama
from _tp_cases import left_behind, shm_segments

from minipaged import LLM, BeamSearchParams, SamplingParams
from minipaged.distributed import WorkerDiedError
from minipaged.model import COURSE_MODEL_DIR
from minipaged.model.parallel import available_devices

pytestmark = pytest.mark.skipif(available_devices("cpu") < 2, reason="needs 2 CPU cores")

MAX_TOKENS = 10
ENGINE = dict(
    block_size=4, num_blocks=14, max_num_seqs=4, max_num_batched_tokens=8, enable_prefix_caching=True
)
PROMPTS = {
    "course": [
        "Once upon a time there was a little girl named Lily. She",
        "Once upon a time there was a little girl named Lily. One day",
        "Once upon a time there was a little boy",
        "The dog ran to the park and",
    ],
    "llama-gqa": [
        "w10 w11 w12 w13 w14 w15 w16 w17 w20 w21 w22",
        "w10 w11 w12 w13 w14 w15 w16 w17 w30 w31",
        "w10 w11 w12 w13 w40 w41 w42",
        "w50 w51 w52 w53 w54 w55",
    ],
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {"course": str(COURSE_MODEL_DIR), "llama-gqa": make_tiny_llama(tmp_path_factory.mktemp("llama"))}


def _hf_greedy(path, prompt_ids):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = hf.config.pad_token_id
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids])  # NOTE: an explicit mask: the course model's BOS is token 0
            gen = hf.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS, do_sample=False
            )
            out.append(gen[0, len(ids) :].tolist())
    return out


def _children(before):
    import multiprocessing

    return [p for p in multiprocessing.active_children() if p.pid not in before and p.is_alive()]


@pytest.mark.parametrize("name", ["course", "llama-gqa"])
def test_tp2_greedy_equals_tp1_and_transformers(checkpoints, name):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = PROMPTS[name]
    one = LLM(checkpoints[name], **ENGINE)
    want = one.generate(prompts, params, use_tqdm=False)
    with LLM(checkpoints[name], tensor_parallel_size=2, **ENGINE) as two:
        got = two.generate(prompts, params, use_tqdm=False)
        steps = two.trace.steps
        two.llm_engine.check_invariants()  # every worker's model-runner checks too
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, f"{name}: {g.prompt!r}"
        assert g.outputs[0].text == w.outputs[0].text
    hf = _hf_greedy(checkpoints[name], [o.prompt_token_ids for o in got])
    assert [o.outputs[0].token_ids for o in got] == hf, f"{name}: tp=2 differs from transformers"
    # the three mechanisms happened in the tp=2 run
    assert any(s.preempted_ids for s in steps), "no preemption: the pool is too large for the test"
    assert any(s.shared_blocks for s in steps), "no prefix-cache hit"
    assert any(sum(str(i) in s.prefill_ids for s in steps) > 1 for i in range(len(prompts))), (
        "no chunked prefill"
    )


def test_tp2_runs_the_papers_block_moves_and_forks_as_tp1(checkpoints):
    """The paper's scheduler (swap, copy-on-write forks for n = 2) on every worker's
    ``PaperModelRunner`` (``PaperSchedulerOutput.for_worker()`` carries the moves and fork
    ids); beam search switches a vLLM v1 engine's workers to it. All as tp=1."""
    path, prompts = checkpoints["course"], PROMPTS["course"]
    paper = dict(ENGINE, enable_prefix_caching=False, preemption_mode="swap", parallel_sampling="fork")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    beam = BeamSearchParams(beam_width=2, max_tokens=8)  # NOTE: long enough to need copies
    greedy = SamplingParams(temperature=0.0, max_tokens=4)

    def run(llm):
        if llm.llm_engine.config.preemption_mode == "swap":
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert any(s.swapped_out_ids for s in llm.trace.steps), "no swap: the pool is too large"
            assert any(s.shared_blocks for s in llm.trace.steps), "no fork"
            return [[c.token_ids for c in o.outputs] for o in outs]
        beams = llm.beam_search(prompts[:2], beam)  # then vLLM v1's outputs on the paper's runner
        return [[s.token_ids for s in b.sequences] for b in beams] + [
            o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)
        ]

    for kw in (paper, ENGINE):
        want = run(LLM(path, **kw))
        with LLM(path, tensor_parallel_size=2, **kw) as two:
            assert run(two) == want
            two.llm_engine.check_invariants()  # every worker's runner checks too (its CPU pool)


def test_a_killed_worker_ends_generate_naming_its_rank(checkpoints):
    import multiprocessing

    before = {p.pid for p in multiprocessing.active_children()}
    llm = LLM(checkpoints["llama-gqa"], tensor_parallel_size=2, **ENGINE)
    engine = llm.llm_engine
    step, calls, segments = engine.step, [], set()

    def step_then_kill():  # rank 1 dies after the engine's second step
        calls.append(1)
        if len(calls) == 3:
            segments.update(shm_segments(p.pid for p in engine.executor.workers.procs))
            os.kill(engine.executor.workers.procs[1].pid, signal.SIGKILL)
            calls.append(time.monotonic())
        return step()

    engine.step = step_then_kill
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with pytest.raises(WorkerDiedError, match=r"tensor-parallel worker rank 1 died") as err:
        llm.generate(PROMPTS["llama-gqa"], params, use_tqdm=False)
    assert err.value.rank == 1
    assert time.monotonic() - calls[3] < 10.0, "the death must stop the engine within seconds"
    assert not _children(before), "a worker outlived the engine"
    assert not left_behind(segments), f"shared memory left behind: {left_behind(segments)}"
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(["w5 w6"], params, use_tqdm=False)


def test_keyboard_interrupt_shuts_the_workers_down(checkpoints):
    import multiprocessing

    before = {p.pid for p in multiprocessing.active_children()}
    llm = LLM(checkpoints["llama-gqa"], tensor_parallel_size=2, **ENGINE)
    engine = llm.llm_engine
    step, calls = engine.step, []

    def interrupted():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step()

    engine.step = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS["llama-gqa"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not _children(before) and not any(engine.executor.workers.alive())


def test_bad_tensor_parallel_size_names_it(checkpoints):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide num_attention_heads \(8\)"):
        LLM(tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide num_key_value_heads \(2\)"):
        LLM(checkpoints["llama-gqa"], tensor_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
        LLM(tensor_parallel_size=0)
    n = 1 << available_devices("cpu").bit_length()
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={n}"):
        LLM(tensor_parallel_size=n)  # beyond this machine's cores, or the heads


def test_serve_has_the_flag():
    import argparse

    from minipaged.entrypoints.openai.api_server import ENGINE_ARGS, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--tensor-parallel-size", "2"])
    assert args.tensor_parallel_size == 2 and "tensor_parallel_size" in ENGINE_ARGS


_DRIVER = """
import sys
from minipaged import LLM, BeamSearchParams, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, block_size=4, num_blocks=14)
    llm.generate(["w5 w6 w7"], SamplingParams(max_tokens=2), use_tqdm=False)
    print(" ".join(str(p.pid) for p in llm.llm_engine.executor.workers.procs), flush=True)
    if sys.argv[2] == "hang":
        import time
        time.sleep(600)  # killed by the test
"""


def _gone(pids, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                        alive.append(pid)
            except FileNotFoundError:
                pass
        if not alive:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("how", ["exit", "killed"])
def test_workers_do_not_outlive_the_driver(checkpoints, tmp_path, how):
    """The driver exits without shutdown() (atexit stops the workers), or is SIGKILLed (each
    worker sees its parent gone and exits): no worker is left either way."""
    import subprocess
    import sys

    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen(
        [sys.executable, str(script), checkpoints["llama-gqa"], "hang" if how == "killed" else "exit"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2
    if how == "killed":
        proc.kill()
    proc.wait(timeout=120)
    assert _gone(pids), f"workers {pids} outlived the driver ({how})"


def test_tensor_parallelism_outside_the_llama_family_or_with_a_model_object_is_refused(tmp_path):
    import transformers

    from minipaged.engine.llm_engine import LLMEngine
    from minipaged.model import load_model

    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=2: tensor parallelism is built for the Llama family"
    ):
        LLM(str(tmp_path), tensor_parallel_size=2)
    model, _ = load_model(None)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: pass the checkpoint as config.model"):
        LLMEngine(model=model, tensor_parallel_size=2)
