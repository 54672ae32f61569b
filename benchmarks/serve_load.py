"""Load benchmark of ``minipaged serve``: throughput, TTFT and inter-token latency at
several Poisson arrival rates, measured with ``aiohttp`` as vLLM's own serving benchmark
measures (``--client openai``: the official ``openai`` client, which costs the load generator four
to five times the CPU per streamed token; on a 2-core machine that CPU is taken from the server).

    python benchmarks/serve_load.py                         # starts a server in-process
    python benchmarks/serve_load.py --rates 1,2,4,8 --num-requests 64
    python benchmarks/serve_load.py --url http://127.0.0.1:8000   # a running `minipaged serve`

For each rate, ``--num-requests`` streaming requests are sent at Poisson arrival times
(exponential gaps, seeded), each with a prompt from a fixed list and ``max_tokens`` drawn
uniformly from ``--min-tokens .. --max-tokens`` (greedy, ``ignore_eos`` so lengths are as
drawn). Reported per rate: requests/s and output tokens/s over the run, and the mean, p50 /
p90 / p99 of TTFT (send -> first event) and ITL (gaps between a request's events), and the
mean TPOT, all as ``vllm bench serve`` measures them (``backend_request_func.py``): every
event with a choice counts, its text empty or not (minipaged, as vLLM, sends one per token),
TPOT = (latency - TTFT) / (output tokens - 1) per request.
Like vLLM's ``benchmarks/benchmark_serving.py``, it is a benchmark that prints numbers,
not a test. Loopback only.

    python benchmarks/serve_load.py --fairness             # what one client does to another
    python benchmarks/serve_load.py --profile --rates 64   # where the server's time goes
    python benchmarks/serve_load.py --profile --rates 64 --no-engine-process   # ... before the split

``--profile`` (implies ``--spawn``: ``minipaged serve`` as a subprocess, so the clients do
not share its interpreter) reads the server's ``GET /profile`` before and after each rate
and prints each part's share of the run's wall time (``minipaged/entrypoints/openai/
profile.py``: event loop busy, parsing, SSE encoding, tokenizing, detokenizing, the engine
step, GIL wait). ``--no-engine-process`` runs the server's engine in-process (before issue
29's split); by default the engine core has its own process.

``--fairness`` starts ``minipaged serve`` as a subprocess (so that the clients' own work
does not share the server's interpreter) and runs issue 30's three scenarios, each
``--trials`` times (median reported):

1. logprobs: a greedy request (``max_tokens=16``) alone, then while another client's
   ``n=16, logprobs=20, max_tokens=480`` stream runs: the ratio of the two latencies;
   and the same while 4 such streams are left unread (their client reads nothing);
2. stop strings: the greedy request while another client sends 100,000 stop strings (a
   1 MB body: refused with a 400 by the stop-string cap): the latency ratio;
3. 4 MB prompt: a greedy stream runs while another client sends a 4 MB prompt (refused by
   the prompt-size limit before tokenizing): the stream's largest gap between chunks,
   and the 4 MB request's answer time.

Then the server's RSS after the whole probe set against its RSS after warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily wanted to",
    "One day, a big",
    "Tom and Sue",
    "The sun was",
    "A small bird",
    "Max found a",
    "In the park,",
    "The cat said",
]


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


def default_client() -> str:
    """``"aiohttp"`` where it is installed (``pip install minipaged[bench]``), else ``"openai"``."""
    import importlib.util

    return "aiohttp" if importlib.util.find_spec("aiohttp") else "openai"


async def _stream_openai(client, body: dict, on_event) -> int:
    """One streamed completion through the official ``openai`` client -> its completion tokens;
    ``on_event()`` for every event with a choice."""
    body = dict(body)
    extra = {"ignore_eos": body.pop("ignore_eos")}
    stream = await client.completions.create(**body, extra_body=extra)
    tokens = 0
    async for ch in stream:
        if ch.usage is not None:
            tokens = ch.usage.completion_tokens
        if ch.choices:
            on_event()
    return tokens


async def _stream_aiohttp(session, url: str, body: dict, on_event) -> int:
    """The same request read as vLLM's own serving benchmark reads it (``aiohttp``, the server-sent
    events split by hand, one ``json.loads`` per event) -> its completion tokens."""
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        async for raw in resp.content:  # one line at a time
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            if ev.get("choices"):  # NOTE: as vLLM's client: an event with a choice, text or not
                on_event()
    return tokens


async def run_rate(url: str, model: str, rate: float, args, seed: int) -> dict:
    """One rate: ``args.num_requests`` streamed requests at Poisson arrival times, through
    ``args.client`` ("aiohttp" or "openai"; default: ``default_client()``)."""
    client = getattr(args, "client", None) or default_client()
    rng = random.Random(seed)
    ttft, itl, tpot, out_tokens = [], [], [], []
    if client == "aiohttp":
        import aiohttp

        session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=600), connector=aiohttp.TCPConnector(limit=0)
        )
    elif client == "openai":
        import openai

        session = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    else:
        raise ValueError(f"client must be 'aiohttp' or 'openai', got {client!r}")

    async def one(delay: float) -> None:
        await asyncio.sleep(delay)
        body = {
            "model": model,
            "prompt": rng.choice(PROMPTS),
            "max_tokens": rng.randint(args.min_tokens, args.max_tokens),
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        t0 = time.perf_counter()
        first = last = None

        def on_event() -> None:
            nonlocal first, last
            now = time.perf_counter()
            if last is None:
                first = now
                ttft.append(now - t0)
            else:
                itl.append(now - last)
            last = now

        if client == "aiohttp":
            n = await _stream_aiohttp(session, url, body, on_event)
        else:
            n = await _stream_openai(session, body, on_event)
        out_tokens.append(n)
        if n > 1 and first is not None:
            tpot.append((time.perf_counter() - first) / (n - 1))

    t = 0.0
    delays = []
    for _ in range(args.num_requests):
        t += rng.expovariate(rate)
        delays.append(t)
    start = time.perf_counter()
    try:
        await asyncio.gather(*(one(d) for d in delays))
    finally:
        await session.close()
    elapsed = time.perf_counter() - start
    return {
        "rate": rate,
        "client": client,
        "requests": args.num_requests,
        "seconds": elapsed,
        "req_per_s": args.num_requests / elapsed,
        "tok_per_s": sum(out_tokens) / elapsed,
        "output_tokens": sum(out_tokens),
        "ttft": [percentile(ttft, q) for q in (50, 90, 99)],
        "itl": [percentile(itl, q) for q in (50, 90, 99)],
        "itl_mean": statistics.fmean(itl) if itl else float("nan"),
        "ttft_mean": statistics.fmean(ttft) if ttft else float("nan"),
        "tpot_mean": statistics.fmean(tpot) if tpot else float("nan"),
        "num_events": len(ttft) + len(itl),
    }


# -- --fairness: issue 30's scenarios -----------------------------------------------------
GREEDY = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
HOSTILE = {
    "prompt": "Hi",
    "n": 16,
    "logprobs": 20,
    "max_tokens": 480,
    "temperature": 1.0,
    "seed": 0,
    "ignore_eos": True,
    "stream": True,
}


async def _greedy_latency(client) -> float:
    t0 = time.perf_counter()
    r = await client.post("/v1/completions", json=GREEDY)
    r.raise_for_status()
    return time.perf_counter() - t0


async def _alone(client) -> float:
    return statistics.median([await _greedy_latency(client) for _ in range(3)])


async def _run_hostile(client, started: asyncio.Event, stop: asyncio.Event) -> None:
    async with client.stream("POST", "/v1/completions", json=HOSTILE) as r:
        chunks = 0
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                chunks += 1
                if chunks == 8:  # well into its decode
                    started.set()
            if stop.is_set():
                return


def _unread_hostile(host: str, port: int):
    """A client that sends the hostile request and never reads a byte of the answer."""
    import json
    import socket

    body = json.dumps(HOSTILE).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, port))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return s


async def scenario_logprobs(url: str) -> float:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        alone = await _alone(c)
        started, stop = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(_run_hostile(c, started, stop))
        await asyncio.wait_for(started.wait(), 300)
        busy = await _greedy_latency(c)
        running = not task.done()
        stop.set()
        await task
    assert running, "the n=16 stream ended before the greedy request did"
    return alone, busy


async def scenario_unread(url: str, host: str, port: int, num: int = 3) -> float:
    # NOTE: 3 x n=16 = 48 of the default 64 seats: a 4th would take them all, and the greedy
    # request would wait for a seat (FCFS, as in vLLM), which is not a cost it is made to pay
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        alone = await _alone(c)
        socks = [_unread_hostile(host, port) for _ in range(num)]
        await asyncio.sleep(1.0)  # they are admitted and decoding
        busy = await _greedy_latency(c)
        for s in socks:
            s.close()
    return alone, busy


async def scenario_stop_strings(url: str) -> float:
    import json

    import httpx

    # NOTE: serialized before the clock starts: this client's own json.dumps is not the server's cost
    body = json.dumps({**GREEDY, "stop": [f"stop string {i}" for i in range(100_000)]}).encode()
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        alone = await _alone(c)
        hostile = asyncio.create_task(c.post("/v1/completions", content=body, headers=headers))
        await asyncio.sleep(0)
        busy = await _greedy_latency(c)
        code = (await hostile).status_code
    assert code == 400, f"100,000 stop strings answered {code}"
    return alone, busy


async def scenario_big_prompt(url: str) -> tuple[float, float]:
    """(largest gap between a running stream's chunks, seconds to answer the 4 MB prompt)."""
    import httpx

    stream_body = {**GREEDY, "max_tokens": 200, "stream": True}
    big = ('{"prompt": "' + "a" * (4 * 1024 * 1024 - 200) + '", "max_tokens": 4}').encode()
    gaps: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        sent = asyncio.Event()

        async def stream() -> None:
            last = None
            async with c.stream("POST", "/v1/completions", json=stream_body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    now = time.perf_counter()
                    if last is not None and sent.is_set():
                        gaps.append(now - last)
                    last = now
                    if len(gaps) == 0 and not sent.is_set() and last is not None:
                        sent.set()

        task = asyncio.create_task(stream())
        await asyncio.wait_for(sent.wait(), 300)
        t0 = time.perf_counter()
        r = await c.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        answered = time.perf_counter() - t0
        await task
    assert r.status_code in (400, 413), f"the 4 MB prompt answered {r.status_code}"
    return max(gaps), answered


PROFILE_ROWS = [
    ("event_loop", "event loop busy (all of its work)"),
    ("event_loop_cpu", "  its thread's CPU time (without lock waits)"),
    ("parse", "  of which: request parsing (json + pydantic)"),
    ("sse", "  of which: SSE chunks (build + json)"),
    ("tokenize", "tokenizing (tokenizer thread)"),
    ("detokenize", "detokenizing + stop strings + logprobs"),
    ("engine_step", "engine step"),
    ("gil_wait", "GIL + CPU wait (a probe thread's lateness)"),
]


def print_profile(before: dict, after: dict, engine_process: bool) -> None:
    wall = after["wall"] - before["wall"]
    where = "the core process, beside the frontend" if engine_process else "the engine thread, in-process"
    print(f"  where the server's time went over {wall:.1f} s (share of wall time):")
    for key, label in PROFILE_ROWS:
        a, b = after["seconds"].get(key), before["seconds"].get(key)
        if a is None or b is None:
            print(f"    {label:<44} n/a")
            continue
        extra = f"   ({where})" if key == "engine_step" else ""
        print(f"    {label:<44} {(a - b) / wall:6.1%}{extra}")


def start_serve(extra_args: list[str], threads: int = 0, timeout: float = 300):
    """``minipaged serve`` as a subprocess on a free port -> (Popen, url); waits for /health."""
    import os
    import socket
    import subprocess
    import sys

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "minipaged.cli", "serve", "--port", str(port), "--log-level", "warning"]
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.Popen(cmd + list(extra_args), env={**os.environ}, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError(f"minipaged serve did not start ({' '.join(cmd)})")
        time.sleep(0.5)


def _rss_mb(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


def run_fairness(args) -> int:
    import os
    import socket
    import subprocess
    import sys

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "minipaged.cli", "serve", "--port", str(port), "--log-level", "warning"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, env={**os.environ}, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("minipaged serve did not start")
            time.sleep(0.5)
        for _ in range(5):  # warm-up
            httpx.post(url + "/v1/completions", json=GREEDY, timeout=120).raise_for_status()
        time.sleep(1.0)
        rss_warm = _rss_mb(proc.pid)
        print(f"minipaged serve fairness (pid {proc.pid}), median of {args.trials} trials")
        rows = {
            "greedy while an n=16 logprobs=20 max_tokens=480 stream runs": lambda: scenario_logprobs(url),
            "greedy while 3 such streams are left unread": lambda: scenario_unread(url, "127.0.0.1", port),
            "greedy while another client sends 100,000 stop strings": lambda: scenario_stop_strings(url),
        }
        print(f"  {'scenario':<62} {'alone s':>8} {'busy s':>7} {'ratio':>6}  (ratio of each trial)")
        for name, fn in rows.items():
            res = []
            for _ in range(args.trials):
                res.append(asyncio.run(fn()))
                time.sleep(1.0)  # the aborted streams leave the engine
            ratios = [b / a for a, b in res]
            print(
                f"  {name:<62} {statistics.median(a for a, _ in res):8.3f} "
                f"{statistics.median(b for _, b in res):7.3f} {statistics.median(ratios):6.2f}  "
                f"({', '.join(f'{v:.2f}' for v in ratios)})"
            )
        res = [asyncio.run(scenario_big_prompt(url)) for _ in range(args.trials)]
        gaps, answers = [g for g, _ in res], [a for _, a in res]
        print(
            f"  {'a stream largest gap while a 4 MB prompt is answered (s)':<62} "
            f"{statistics.median(gaps):6.3f}   ({', '.join(f'{g:.3f}' for g in gaps)})"
        )
        print(
            f"  {'the 4 MB prompt answered in (s)':<62} {statistics.median(answers):6.3f}   "
            f"({', '.join(f'{a:.3f}' for a in answers)})"
        )
        time.sleep(2.0)
        rss_end = _rss_mb(proc.pid)
        print(
            f"  server RSS after warm-up {rss_warm:.0f} MB, after the probes {rss_end:.0f} MB "
            f"({rss_end - rss_warm:+.0f} MB)"
        )
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a running server (default: start one in-process)")
    p.add_argument("--rates", default="1,2,4,8", help="arrival rates, requests per second")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-num-seqs", type=int, default=32, help="engine option (in-process server)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--client",
        choices=["aiohttp", "openai"],
        default=None,
        help="the load generator's HTTP client (default: aiohttp where installed, as vLLM's benchmark)",
    )
    p.add_argument("--fairness", action="store_true", help="issue 30's three scenarios (see above)")
    p.add_argument("--trials", type=int, default=3, help="--fairness: trials per scenario (median)")
    p.add_argument("--profile", action="store_true", help="print where the server's time goes")
    p.add_argument("--spawn", action="store_true", help="start `minipaged serve` as a subprocess")
    p.add_argument("--no-engine-process", dest="engine_process", action="store_false")
    p.add_argument("--model", default=None, help="checkpoint for the spawned server (default: course model)")
    args = p.parse_args(argv)
    if args.fairness:
        return run_fairness(args)
    rates = [float(r) for r in args.rates.split(",")]

    server = proc = None
    if args.url is None and (args.spawn or args.profile):
        extra = ["--max-num-seqs", str(args.max_num_seqs)]
        extra += [] if args.engine_process else ["--no-engine-process"]
        extra += [] if args.model is None else ["--model", args.model]
        proc, url = start_serve(extra, args.threads)
        import httpx

        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    elif args.url is None:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        from minipaged.engine.llm_engine import LLMEngine
        from minipaged.entrypoints.openai.api_server import BackgroundServer

        server = BackgroundServer(LLMEngine(max_num_seqs=args.max_num_seqs)).start()
        url, model = server.url, server.serving.model_name
    else:
        import httpx

        url = args.url.rstrip("/")
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    try:
        print(
            f"minipaged serve load: {model} at {url}, {args.num_requests} streaming requests "
            f"per rate, max_tokens {args.min_tokens}..{args.max_tokens}"
        )
        print(
            f"{'rate':>6} {'req/s':>7} {'tok/s':>8} | {'TTFT mean':>9} {'p50':>7} {'p90':>7} {'p99':>7} "
            f"| {'ITL mean':>8} {'p50':>7} {'p90':>7} {'p99':>7} | {'TPOT':>6}  (seconds)"
        )
        for i, rate in enumerate(rates):
            if args.profile:
                import httpx

                before = httpx.get(url + "/profile").json()
            r = asyncio.run(run_rate(url, model, rate, args, args.seed + i))
            print(
                f"{r['rate']:>6.1f} {r['req_per_s']:>7.2f} {r['tok_per_s']:>8.1f} | "
                + " ".join(f"{x:>{w}.3f}" for x, w in zip([r["ttft_mean"], *r["ttft"]], (9, 7, 7, 7)))
                + " | "
                + " ".join(f"{x:>{w}.3f}" for x, w in zip([r["itl_mean"], *r["itl"]], (8, 7, 7, 7)))
                + f" | {r['tpot_mean']:>6.3f}",
                flush=True,
            )
            if args.profile:
                print_profile(before, httpx.get(url + "/profile").json(), args.engine_process)
    finally:
        if server is not None:
            server.stop()
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
