"""Soak: does a long-running ``minipaged serve`` keep anything of the requests it served?

Starts ``minipaged serve`` (the course model) as its own process, sends ``--warmup`` short
completions, reads the resident memory (``VmRSS`` of ``/proc/PID/status``) of the server and
of its engine-core process, sends
``--num-requests`` more in ``--concurrency`` client threads, and reads it again. Prints the
two readings and the growth; a server that forgot every finished request grows by allocator
noise only. (vLLM v1's scheduler forgets a request when it finishes; so does minipaged's,
and its worker drops the request's block table on the next step.)

usage: python benchmarks/serve_soak.py [--num-requests 10000] [--warmup 500]
       [--concurrency 8] [--max-tokens 4] [--port 8391]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[-60:]
    except OSError:
        return "?"


def tree_rss_mb(pid: int) -> dict[int, float]:
    """RSS of ``pid`` and of every process below it (the engine-core process of the server)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    tree, todo = [pid], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        tree += kids
        todo += kids
    return {p: rss_mb(p) for p in tree}


def send(url: str, model: str, n: int, concurrency: int, max_tokens: int) -> int:
    """``n`` completions from ``concurrency`` threads; returns how many failed."""
    import httpx

    failures = [0]
    lock = threading.Lock()
    counter = iter(range(n))

    def worker() -> None:
        with httpx.Client(timeout=60) as client:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                body = {
                    "model": model,
                    "prompt": f"Once upon a time {i % 97}",
                    "max_tokens": max_tokens,
                }
                r = client.post(url + "/v1/completions", json=body)
                if r.status_code != 200:
                    with lock:
                        failures[0] += 1
                        if failures[0] == 1:
                            print(f"first failure: {r.status_code} {r.text[:300]}")

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=10_000)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--port", type=int, default=8391)
    args = p.parse_args(argv)
    import httpx

    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "minipaged.cli", "serve", "--port", str(args.port)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the server did not start")
            time.sleep(0.5)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        bad = send(url, model, args.warmup, args.concurrency, args.max_tokens)
        before = tree_rss_mb(server.pid)
        t0 = time.perf_counter()
        bad += send(url, model, args.num_requests, args.concurrency, args.max_tokens)
        wall = time.perf_counter() - t0
        time.sleep(1.0)
        after = tree_rss_mb(server.pid)
        print(f"requests: {args.warmup} warm-up + {args.num_requests} measured, {bad} failed, {wall:.1f} s")
        for p in before:
            name = "api server" if p == server.pid else f"child {p} ({_cmdline(p)})"
            a = after.get(p, float("nan"))
            print(
                f"{name}: RSS {before[p]:.1f} MB after warm-up, {a:.1f} MB after the soak ({a - before[p]:+.1f} MB)"
            )
        total_b, total_a = sum(before.values()), sum(after.get(p, 0.0) for p in before)
        print(f"growth: {total_a - total_b:+.1f} MB over {args.num_requests} requests (all processes)")
        return 0 if bad == 0 else 1
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
