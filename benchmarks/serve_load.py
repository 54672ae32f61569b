"""Load benchmark of ``minipaged serve``: throughput, TTFT and inter-token latency at
several Poisson arrival rates, measured with the official ``openai`` client.

    python benchmarks/serve_load.py                         # starts a server in-process
    python benchmarks/serve_load.py --rates 1,2,4,8 --num-requests 64
    python benchmarks/serve_load.py --url http://127.0.0.1:8000   # a running `minipaged serve`

For each rate, ``--num-requests`` streaming requests are sent at Poisson arrival times
(exponential gaps, seeded), each with a prompt from a fixed list and ``max_tokens`` drawn
uniformly from ``--min-tokens .. --max-tokens`` (greedy, ``ignore_eos`` so lengths are as
drawn). Reported per rate: requests/s and output tokens/s over the run, and the p50 / p90
/ p99 of TTFT (send -> first text chunk) and ITL (gaps between a request's chunks).
Like vLLM's ``benchmarks/benchmark_serving.py``, it is a benchmark that prints numbers,
not a test. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
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


async def run_rate(url: str, model: str, rate: float, args, seed: int) -> dict:
    import openai

    rng = random.Random(seed)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    ttft, itl, out_tokens = [], [], []

    async def one(delay: float) -> None:
        await asyncio.sleep(delay)
        prompt = rng.choice(PROMPTS)
        max_tokens = rng.randint(args.min_tokens, args.max_tokens)
        t0 = time.perf_counter()
        last = None
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for ch in stream:
            now = time.perf_counter()
            if ch.usage is not None:
                out_tokens.append(ch.usage.completion_tokens)
            if not ch.choices or not ch.choices[0].text:
                continue
            if last is None:
                ttft.append(now - t0)
            else:
                itl.append(now - last)
            last = now

    t = 0.0
    delays = []
    for _ in range(args.num_requests):
        t += rng.expovariate(rate)
        delays.append(t)
    start = time.perf_counter()
    await asyncio.gather(*(one(d) for d in delays))
    elapsed = time.perf_counter() - start
    await client.close()
    return {
        "rate": rate,
        "requests": args.num_requests,
        "seconds": elapsed,
        "req_per_s": args.num_requests / elapsed,
        "tok_per_s": sum(out_tokens) / elapsed,
        "ttft": [percentile(ttft, q) for q in (50, 90, 99)],
        "itl": [percentile(itl, q) for q in (50, 90, 99)],
        "itl_mean": statistics.fmean(itl) if itl else float("nan"),
    }


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
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]

    server = None
    if args.url is None:
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
            f"{'rate':>6} {'req/s':>7} {'tok/s':>8} | {'TTFT p50':>9} {'p90':>7} {'p99':>7} "
            f"| {'ITL p50':>8} {'p90':>7} {'p99':>7}  (seconds)"
        )
        for i, rate in enumerate(rates):
            r = asyncio.run(run_rate(url, model, rate, args, args.seed + i))
            print(
                f"{r['rate']:>6.1f} {r['req_per_s']:>7.2f} {r['tok_per_s']:>8.1f} | "
                + " ".join(f"{x:>{w}.3f}" for x, w in zip(r["ttft"], (9, 7, 7)))
                + " | "
                + " ".join(f"{x:>{w}.3f}" for x, w in zip(r["itl"], (8, 7, 7))),
                flush=True,
            )
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
