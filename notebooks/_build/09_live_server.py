"""Generate notebooks/09_live_server.ipynb (run from the repo root, then execute it).

python notebooks/_build/09_live_server.py
bash notebooks/_build/build_all.sh 09_live_server
"""

from _nb import code, md, write

md(r"""
# 09 · A live server: requests that arrive while the engine runs

Every chapter so far handed the engine a fixed list of prompts. A real deployment never
sees one: requests **arrive at random times**, stream their tokens back, and sometimes
hang up half-way. That is the situation continuous batching was invented for. vLLM's
users meet it as `vllm serve`, an HTTP server that speaks the OpenAI API; minipaged has
the same thing on the same engine: `minipaged serve`.

**You will learn**

1. how a server drives the engine: an *engine loop* that adds and aborts requests
   *between* steps, with the model step running off the event loop;
2. how to talk to it with the official `openai` client, streaming or not, and why a
   greedy answer from the server equals the offline `LLM.generate` one;
3. how requests arriving at Poisson times join and leave the batch, seen in the
   engine's trace (`/trace`), in the stepper widget, and in `/metrics`;
4. how a classroom joins one instructor's server.

Everything runs on loopback (`127.0.0.1`) on a CPU, in well under a minute.
""")

md("## Setup: one engine, served in the background")

code(r"""
import concurrent.futures
import random
import time

import matplotlib.pyplot as plt
import openai

from minipaged import LLM, SamplingParams, viz
from minipaged.engine.llm_engine import LLMEngine
from minipaged.entrypoints.openai.api_server import BackgroundServer
from minipaged.entrypoints.openai.live import attach_stepper, fetch_trace

# the offline engine of every other chapter, for reference answers
llm = LLM(max_num_seqs=8, num_blocks=48)
# the server's engine: same config, and (to save a second load) the same model weights
engine = LLMEngine(llm.config, model=llm.llm_engine.model, tokenizer=llm.get_tokenizer())
server = BackgroundServer(engine, check_invariants=True).start()   # 127.0.0.1, a free port
client = openai.OpenAI(base_url=server.url + "/v1", api_key="not-needed")
MODEL = server.serving.model_name
print("serving", MODEL, "on", server.host)
""")

md(r"""
`BackgroundServer` runs exactly what `minipaged serve` runs, in a thread of this kernel,
so that the notebook can start and stop it. From a terminal it would be

```bash
minipaged serve --port 8000            # http://127.0.0.1:8000, live view at /
```

`check_invariants=True` makes the engine core call `EngineCore.check_invariants()` after
every step: the block accounting of chapter 02 and the scheduler rules of chapter 04 are
checked while real clients come and go.

## The engine loop

The server is laid out as vLLM v1's. The HTTP side (`minipaged/entrypoints/openai/`):
the routes (`api_server.py`), the request bodies (`protocol.py`), the request path
(`serving.py`). Under it the engine, in two halves (`minipaged/engine/`):

- the **frontend**, `AsyncLLM` (`async_llm.py`): a `Processor` that validates and tokenizes
  a request and fans `n` out into one `EngineCoreRequest` per sample (`processor.py`), and
  an `OutputProcessor` that turns token ids back into text, finds stop strings and builds
  every `RequestOutput` (`output_processor.py`, the same one `LLM.generate` uses);
- the **engine core**, `EngineCore(scheduler, executor)` (`core.py`): no tokenizer, no
  text, token ids in and out, one `step()` at a time, driven by a busy loop
  (`EngineCoreProc.run_busy_loop`). The frontend reaches it through a client
  (`core_client.py`).

A handler never touches the scheduler: `AsyncLLM.add_requests` queues an *add* message
(or, when its client hangs up, `AsyncLLM.abort` an *abort*), and the core's busy loop
applies those **between** steps, then runs one `core.step()` and sends back each
request's new tokens:
""")

code(r"""
import inspect
from minipaged.engine.core import EngineCoreProc

print(inspect.getsource(EngineCoreProc.run_busy_loop))
""")

md(r"""
This is vLLM v1's `EngineCoreProc.run_busy_loop` in miniature. Continuous batching needs
nothing more: a request added between step *k* and *k+1* is in the batch of step *k+1*.
This notebook's server runs that loop in a thread of this kernel (`ThreadedClient`: it
shares the weights of `llm`); `minipaged serve` from a terminal does what vLLM v1 does
instead, next.

## Two processes: the engine core and the API server

In one process, the engine's step and the server's own work (parsing requests,
detokenizing, finding stop strings, writing Server-Sent Events) take turns on one
interpreter lock. vLLM v1 splits them: an **engine core** process runs the scheduler and
the executor in a busy loop that never waits for anyone, and the **API server** process
does everything around it. `minipaged serve` does the same by default
(`minipaged/engine/core.py`, `core_client.py`; `--no-engine-process` keeps the old way).
Each step, only plain data crosses, one way each:

- in, when a client sends or leaves: `("add", [(request_id, [EngineCoreRequest, ...])])`
  (a request's samples: token ids, `SamplingParams` with `n=1`, a seed),
  `("abort", [seq_id])`, and `("stop", [(seq_id, reason)])` when the *frontend*
  finds a stop string in the text: the core finishes that sequence at its next step
  boundary, its blocks freed there (vLLM v1 aborts it the same way);
- out, after every step: `EngineCoreOutputs`, for each sequence that moved an
  `EngineCoreOutput` with its **new token ids** (plus logprob entries if asked, and a
  finish reason once it ends), and the step's `StepRecord` that `/trace`, `/metrics` and
  the live view draw.

`EngineCore` is the object the child process drives; here it runs in this kernel, over
the weights of `llm`, with a `Processor` and an `OutputProcessor` beside it as the
frontend holds them, so we can weigh each message in bytes (pickled, as they cross the
pipe):
""")

code(r"""
from minipaged.engine.core import EngineCore, encode
from minipaged.engine.output_processor import OutputProcessor
from minipaged.engine.processor import Processor

tok = llm.get_tokenizer()
core = EngineCore.from_config(llm.config, llm.llm_engine.model)   # scheduler + executor
processor, output_processor = Processor(core.model_info, tok), OutputProcessor(tok)
params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
adds = []
for i, prompt in enumerate(["Once upon a time", "The little dog", "Lily wanted to",
                            "One day, a big"]):
    text, ids = processor.tokenize(prompt)
    reqs = processor.process_inputs(f"r{i}", ids, params)     # one EngineCoreRequest (n=1)
    output_processor.add_request(f"r{i}", text, ids, params, reqs, stream=True)
    adds.append((f"r{i}", reqs))
add_msg = ("add", adds)
for rid, reqs in adds:
    core.add_request_group(reqs)
steps = []
while core.has_unfinished_requests():
    outs = core.step()                          # EngineCoreOutputs: token ids, no text
    steps.append(outs)
    output_processor.process_outputs(outs.outputs)   # the frontend turns them into text
outs = steps[3]                                 # a decode step with all four running
print(f"add, 4 requests:              {len(encode(add_msg)):5d} bytes")
print(f"one step's tokens ({len(outs.outputs)} seqs):     {len(encode(outs.outputs)):5d} bytes")
print("   ", outs.outputs[0])
print(f"one step's StepRecord:        {len(encode(outs.step)):5d} bytes")
print(f"abort of one request:         {len(encode(('abort', ['r0']))):5d} bytes")
print("steps run:", len(steps), "| every block free at the end:",
      core.scheduler.kv_cache_manager.get_num_free_blocks() == core.model_info.num_blocks)
""")

md(r"""
A decode step sends a handful of token ids per sequence: tens of bytes, far less than
the text and the SSE chunks built from them. The `StepRecord` (block tables included) is
the biggest part; it is what makes the live view possible. The two processes:
""")

code(r"""
from matplotlib.patches import FancyBboxPatch

step_bytes, trace_bytes = len(encode(outs.outputs)), len(encode(outs.step))
fig, ax = plt.subplots(figsize=(9, 3.4))
ax.set_xlim(0, 10); ax.set_ylim(0, 4); ax.axis("off")
for x, title, lines, color in [
    (0.2, "API server process", "HTTP (uvicorn, FastAPI)\ntokenize prompts\ndetokenize, stop strings\n"
     "logprob dicts, SSE, /metrics, /trace", viz.palette.STATE_COLORS["prefill"]),
    (6.0, "engine core process", "busy loop:\n  apply adds / aborts / stops\n  schedule + execute\n"
     "  update_from_output", viz.palette.STATE_COLORS["decode"])]:
    ax.add_patch(FancyBboxPatch((x, 0.4), 3.8, 3.1, boxstyle="round,pad=0.05",
                                facecolor=color, alpha=0.25, edgecolor=color))
    ax.text(x + 1.9, 3.15, title, ha="center", fontsize=11, weight="bold")
    ax.text(x + 0.2, 2.7, lines, va="top", fontsize=9, family="monospace")
ax.annotate("", xy=(6.0, 2.4), xytext=(4.0, 2.4), arrowprops=dict(arrowstyle="->", lw=1.5))
ax.text(5.0, 2.55, f"add {len(encode(add_msg))} B (4 req)\nabort / stop ~{len(encode(('abort', ['r0'])))} B",
        ha="center", fontsize=8)
ax.annotate("", xy=(4.0, 1.2), xytext=(6.0, 1.2), arrowprops=dict(arrowstyle="->", lw=1.5))
ax.text(5.0, 1.35, f"per step: tokens {step_bytes} B\n+ StepRecord {trace_bytes} B", ha="center",
        fontsize=8)
ax.set_title("what crosses between the two processes each step (pickled, over a pipe)")
plt.show()
plt.close(fig)
""")

md(r"""
Why it pays: the core starts step *k+1* as soon as step *k*'s token ids are on the pipe;
the frontend turns them into text and SSE chunks **while** step *k+1* runs, where in one
process the two take turns on one interpreter lock. Appendix **09a**
(`notebooks/09a_two_processes.ipynb`) times both halves of each step on this engine and
lays them out both ways; it also says when the split loses (a machine with no spare core).
`benchmarks/serve_load.py --profile` prints where a loaded server's time goes, and
`benchmarks/serve_vs_vllm.py` measures the server against vLLM's own; the README has the
numbers.

## Talking to it with the `openai` client
""")

code(r"""
print([m.id for m in client.models.list().data])

r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20,
                              temperature=0.0)
print(repr(r.choices[0].text))
print(r.choices[0].finish_reason, r.usage)

offline = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=20),
                       use_tqdm=False)[0].outputs[0].text
print("same as offline LLM.generate:", r.choices[0].text == offline)
""")

md(r"""
Streaming (`stream=True`) sends one Server-Sent Event per engine step that produced
text. Alone on the server, this request gets one token per step:
""")

code(r"""
stream = client.completions.create(model=MODEL, prompt="The little dog", max_tokens=10,
                                   temperature=0.0, stream=True)
pieces = [chunk.choices[0].text for chunk in stream]
print(pieces)
""")

md(r"""
The chat endpoint renders the messages with a chat template first. The course model
has none of its own, so the server uses a plain one (`User: ...` lines, then
`Assistant:`); a real checkpoint's own template is used where it has one.
""")

code(r"""
chat = client.chat.completions.create(
    model=MODEL, temperature=0.0, max_tokens=16,
    messages=[{"role": "user", "content": "Tell me about a cat."}])
print(repr(chat.choices[0].message.content))
""")

md(r"""
## Requests at Poisson arrival times

Now twelve clients that do not wait for each other: the gaps between arrivals are
exponential (a Poisson process, 6 requests per second on average), each client streams
its answer. Greedy decoding makes every text reproducible, however the requests end up
batched.
""")

code(r"""
rng = random.Random(0)
starts = ["Once upon a time", "The little dog", "Lily wanted to", "One day, a big",
          "Tom and Sue", "The sun was", "A small bird", "Max found a"]
jobs, t = [], 0.0
for i in range(12):
    t += rng.expovariate(6.0)                      # seconds after the first send
    jobs.append((t, rng.choice(starts), rng.randint(8, 32)))

def run(job):
    delay, prompt, max_tokens = job
    time.sleep(delay)
    text = ""
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                           temperature=0.0, stream=True):
        text += chunk.choices[0].text
    return text

with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
    texts = list(pool.map(run, jobs))

ref = llm.generate([p for _, p, _ in jobs],
                   [SamplingParams(temperature=0.0, max_tokens=m) for _, _, m in jobs],
                   use_tqdm=False)
same = sum(t == o.outputs[0].text for t, o in zip(texts, ref))
print(f"{same} of {len(jobs)} streamed answers equal offline LLM.generate")
for (_, prompt, m), text in list(zip(jobs, texts))[:3]:
    print(f"{prompt!r} + {m} tokens -> {text!r}")
""")

md(r"""
## Watching the steps

The server records the same `EngineTrace` as `LLM.generate`, one `StepRecord` per step,
and streams it at `/trace`. `fetch_trace` turns the recent steps into an `EngineTrace`,
so every picture of `minipaged.viz` draws a live server's history. How many steps it
took depends on timing (when each request happened to arrive), so the numbers below are
pictures, not printed text.
""")

code(r"""
trace = fetch_trace(server.url)
trace.check_invariants()
fig = viz.timeline(trace)
plt.show()
plt.close(fig)
""")

code(r"""
running = [len(s.block_tables) for s in trace.steps]
waiting = [len(s.waiting_ids) for s in trace.steps]
used = [trace.num_blocks - s.num_free_blocks for s in trace.steps]
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 4.5), sharex=True)
ax1.plot(running, label="running", color=viz.palette.STATE_COLORS["decode"])
ax1.plot(waiting, label="waiting", color="#777777")
ax1.set_ylabel("sequences")
ax1.legend(loc="upper right")
ax2.plot(used, color=viz.palette.MEMORY_COLORS["tokens"])
ax2.set_ylabel("KV blocks in use")
ax2.set_xlabel("engine step")
fig.suptitle("the batch follows the arrivals")
plt.show()
plt.close(fig)
print("running never above max_num_seqs:", max(running) <= trace.max_num_seqs)
print("every block free at the end:", trace.steps[-1].num_free_blocks == trace.num_blocks)
""")

md(r"""
The same picture is live in a browser: open the server's address (`/`). It reads
`/trace` and redraws the active sequences and the block pool after every step, in the
colours of `minipaged.viz`. In a notebook, `attach_stepper` puts the chapter-00 stepper
on a running server: its slider grows as steps arrive (its exact length depends on
timing, so nbval does not compare it).
""")

code(r"""
# NBVAL_IGNORE_OUTPUT
stepper = attach_stepper(server.url)
stepper
""")

code(r"""
before = stepper.slider.max
client.completions.create(model=MODEL, prompt="Tom and Sue", max_tokens=12, temperature=0.0)
deadline = time.monotonic() + 20
while stepper.slider.max == before and time.monotonic() < deadline:
    time.sleep(0.05)
stepper.follower.stop()
print("the stepper grew with the new request:", stepper.slider.max > before)
""")

md(r"""
## Hanging up, and `/metrics`

A client that closes its stream mid-way has its request aborted before the next step,
and its blocks go back to the free queue at once (no wasted decoding for nobody).
`/metrics` speaks Prometheus, with vLLM's metric names, so a dashboard built for vLLM
reads it.
""")

code(r"""
stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=200,
                                   temperature=0.0, stream=True)
for i, chunk in zip(range(3), stream):
    pass
stream.close()                                          # the client hangs up
deadline = time.monotonic() + 20
while engine.has_unfinished_requests() and time.monotonic() < deadline:
    time.sleep(0.05)
print("blocks free after the hang-up:",
      engine.kv_cache_manager.get_num_free_blocks() == engine.num_blocks)

import httpx
metrics = httpx.get(server.url + "/metrics").text
for line in metrics.splitlines():
    if line.startswith(("vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                        'vllm:request_success_total')):
        print(line)
""")

md(r"""
## Exercise: a classroom on one server

The instructor starts a server the whole room can reach (on the classroom network
only, never a public address):

```bash
minipaged serve --host 0.0.0.0 --port 8000 --max-num-seqs 16
```

and opens `http://<instructor>:8000/` on the projector. Each student then runs

```python
import openai
client = openai.OpenAI(base_url="http://<instructor>:8000/v1", api_key="none")
for chunk in client.completions.create(model="minipaged-course-model", prompt="My name is",
                                       max_tokens=64, stream=True):
    print(chunk.choices[0].text, end="", flush=True)
```

1. Everyone sends at once. Watch the block pool: how many sequences run, how many wait?
   Where does `max_num_seqs` show up in the picture?
2. Restart the server with `--num-blocks 24`. What happens to the running sequences when
   the pool is full (chapter 05)? Find `vllm:num_preemptions_total` in `/metrics`.
3. Send the same greedy prompt as your neighbour. Are your answers equal? Now add
   `temperature=1.0` and `seed=` your student number: who can reproduce whose answer?

## Stopping the server
""")

code(r"""
server.stop()
print("server stopped; engine steps checked:", server.serving.engine_client.errors == [])
""")

md(r"""
## Recap

- `minipaged serve` is the same engine behind the OpenAI API: one loop adds and aborts
  requests **between** steps, the step itself runs off the event loop.
- By default the engine core has its own process (vLLM v1's split): token ids, tens of
  bytes per sequence, cross each step; the frontend's text and SSE work overlaps the
  core's next step (appendix 09a times both halves); a stop string found by the frontend is a `stop` message the core
  applies at its next step boundary.
- Arrivals at random times are exactly what continuous batching absorbs: the batch is
  rebuilt every step, and a greedy answer does not depend on who else was in it.
- The live view, the stepper and `/metrics` all read the same `EngineTrace` the offline
  chapters drew.
- Benchmark it with `python benchmarks/serve_load.py` (throughput, TTFT and inter-token
  latency at several arrival rates).
""")

write("09_live_server")
