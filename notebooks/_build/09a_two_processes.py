"""Generate notebooks/09a_two_processes.ipynb, an appendix of chapter 09 (run from the repo root).

    bash notebooks/_build/build_all.sh 09a_two_processes
"""

from _nb import code, md, write

md(r"""
# 09a · Appendix to chapter 09: what two processes buy, step by step

Chapter 09's `minipaged serve` runs as vLLM v1 does: an **engine core** process (scheduler and
executor, token ids in and out) and an **API server** process (tokenizing, detokenizing, stop
strings, Server-Sent Events). This appendix times the two halves of each step on the course
model and lays the same steps out both ways: in one process, where they take turns, and in two,
where the frontend's work on step *k* overlaps step *k+1*. Nothing in later chapters depends on it.

**You will learn**

1. the arithmetic of the overlap, by hand on three made-up steps;
2. the two halves of a real step, timed on this machine: `EngineCore.step()` and the
   frontend's `OutputProcessor.process_outputs(...)` plus the SSE chunks it yields;
3. when the split loses: a machine with no spare core.
""")

code(r"""
import time

import matplotlib.pyplot as plt

from minipaged import LLM, SamplingParams, viz
from minipaged.engine.core import EngineCore
from minipaged.engine.output_processor import OutputProcessor
from minipaged.engine.processor import Processor
from minipaged.entrypoints.openai.serving import sse

llm = LLM(max_num_seqs=8, num_blocks=48)   # chapter 09's engine
tok = llm.get_tokenizer()
""")

md(r"""
## 1. The overlap, by hand

Let step *k* of the engine take `s[k]` and the frontend's work on its output `f[k]`. In one
process they alternate: the run takes `sum(s) + sum(f)`. In two, the core starts step *k+1*
as soon as step *k*'s token ids are on the pipe, so the frontend's `f[k]` runs beside `s[k+1]`;
as long as every `f[k] <= s[k+1]`, only the last `f` is left over: `sum(s) + f[-1]`. (When the
frontend is the slower one, it is the frontend that sets the pace: `s[0] + sum(f)`. In general,
each step of the two-process run takes `max(s[k+1], f[k])`.) Three steps of 3 ms with 1 ms of
frontend work each:
""")

code(r"""
def one_process(s, f):
    return sum(s) + sum(f)

def two_processes(s, f):
    # the core runs its steps back to back; the frontend starts on step k when step k is done
    # and the frontend is free
    core_done, front_done = 0.0, 0.0
    for sk, fk in zip(s, f):
        core_done += sk
        front_done = max(front_done, core_done) + fk
    return front_done

s, f = [3.0, 3.0, 3.0], [1.0, 1.0, 1.0]
print(f"one process : {one_process(s, f):.0f} ms   (3 + 1 + 3 + 1 + 3 + 1)")
print(f"two         : {two_processes(s, f):.0f} ms   (3 + 3 + 3, then the last 1)")
s, f = [1.0, 1.0, 1.0], [3.0, 3.0, 3.0]
print(f"frontend-bound, one: {one_process(s, f):.0f} ms, two: {two_processes(s, f):.0f} ms   (1, then 3 + 3 + 3)")
""")

md(r"""
## 2. The two halves of a real step

Eight streams (this engine's `max_num_seqs`) of 24 greedy tokens. For each step, the time of
`core.step()` (schedule, forward, sample, update) and of what the frontend does with its
`EngineCoreOutputs`: detokenize, look for stop strings, build each stream's chunk as an SSE
event. The durations vary from run to run and machine to machine; the shape does not:
""")

code(r"""
core = EngineCore.from_config(llm.config, llm.llm_engine.model)   # scheduler + executor
processor, output_processor = Processor(core.model_info, tok), OutputProcessor(tok)
params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
for i, prompt in enumerate(["Once upon a time", "The little dog", "Lily wanted to", "One day, a big",
                            "Tom and Sue", "The sun was", "A small bird", "Max found a"]):
    text, ids = processor.tokenize(prompt)
    reqs = processor.process_inputs(f"s{i}", ids, params)
    output_processor.add_request(f"s{i}", text, ids, params, reqs, stream=True)
    core.add_request_group(reqs)
output_processor.process_outputs(core.step().outputs)   # warm-up step (the prefill), not drawn
t_step, t_front = [], []
while core.has_unfinished_requests():
    t0 = time.perf_counter()
    outs = core.step()
    t1 = time.perf_counter()
    processed = output_processor.process_outputs(outs.outputs)   # detokenize, stop strings
    chunks = [sse({"choices": [{"index": 0, "text": c.text}]})
              for o in processed.request_outputs for c in o.outputs]   # the SSE chunks they become
    t2 = time.perf_counter()
    t_step.append(t1 - t0)
    t_front.append(t2 - t1)

fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 3.2), sharex=True)
x = 0.0
for sk, fk in zip(t_step, t_front):          # one process: step, then the frontend's work
    a1.barh(0, sk, left=x, color=viz.palette.STATE_COLORS["decode"], edgecolor="white"); x += sk
    a1.barh(0, fk, left=x, color=viz.palette.STATE_COLORS["prefill"]); x += fk
x = 0.0
for sk, fk in zip(t_step, t_front):          # two processes: the frontend overlaps the next step
    a2.barh(1, sk, left=x, color=viz.palette.STATE_COLORS["decode"], edgecolor="white")
    a2.barh(0, fk, left=x + sk, color=viz.palette.STATE_COLORS["prefill"]); x += sk
a1.set_yticks([0], ["one process"]); a2.set_yticks([1, 0], ["core", "frontend"])
a2.set_xlabel("seconds (light: engine steps; dark: detokenize + SSE chunks of the step before)")
fig.suptitle("the same steps, in one process and in two")
plt.show()
plt.close(fig)
print(f"decode steps timed: {len(t_step)}, each with its frontend work")
""")

md(r"""
With 8 streams on a small model the frontend's part is thin, and two processes save little
here. In a saturated server (64 streams, HTTP writes on top, logprob dictionaries) the
frontend's part is a large share of the event loop, and the split saves that share: the profile
that `benchmarks/serve_load.py --profile` prints shows where a loaded server's time goes.

## 3. When the split loses

The overlap is free only if there is a CPU for each process. On a machine whose cores are all
busy (the course's 2-core CI box, shared), the two processes take turns on the CPUs instead of
on the interpreter lock, and the pipe's pickling is paid on top: the split can lose. That is
why `minipaged serve --no-engine-process` exists, and why `benchmarks/serve_vs_vllm.py`, which
measures both servers against vLLM's own, reports the load it ran under.

## Recap

- One process: `sum(s) + sum(f)`. Two processes: each step costs `max(s[k+1], f[k])`, so when
  the frontend is the faster half only the last `f` is left over.
- On the course model the frontend's half is small; at saturation it is not.
- The split needs a spare core; without one it can cost more than it saves.
- Code: `minipaged/engine/core.py` (`EngineCore`, `EngineCoreProc.run_busy_loop`),
  `minipaged/engine/core_client.py` (the clients), `minipaged/engine/output_processor.py`;
  vLLM v1: `vllm/v1/engine/core.py`, `core_client.py`, `output_processor.py`.
""")

write("09a_two_processes")
