"""The frontend's memory after issue 37's hostile load: 3 unread streams of big answers.

    python benchmarks/serve_unread_rss.py                  # extra args go to `minipaged serve`

Starts ``minipaged serve`` (its engine core in its own process), warms it up with one
``n=16, logprobs=20`` stream read to the end, then opens 3 connections that send
``serve_load.HOSTILE`` (``n=16, logprobs=20, max_tokens=480``: 48 sequences, 480,000
logprob entries) and never read a byte. It waits until the server has dropped the three
(``minipaged:unread_streams_dropped_total``, after ``--unread-timeout``), closes the
sockets, waits 10 s and prints the frontend's RSS: warm, at the peak, and after. A
benchmark that prints numbers, not a test (``tests/entrypoints/test_serve_process.py``
bounds a lighter load).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_load import HOSTILE, _rss_mb, _unread_hostile, start_serve  # noqa: E402

DROPPED = "minipaged:unread_streams_dropped_total"


def _dropped(url: str) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics").text
    return sum(
        s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == DROPPED
    )


def main(argv: list[str]) -> int:
    import httpx

    proc, url = start_serve(argv)
    port = int(url.rsplit(":", 1)[1])
    try:
        with httpx.stream(
            "POST", url + "/v1/completions", json={**HOSTILE, "max_tokens": 64}, timeout=600
        ) as r:
            for _ in r.iter_lines():
                pass
        time.sleep(3)
        warm = peak = _rss_mb(proc.pid)
        socks = [_unread_hostile("127.0.0.1", port) for _ in range(3)]
        t0 = time.monotonic()
        while _dropped(url) < 3 and time.monotonic() - t0 < 600:
            peak = max(peak, _rss_mb(proc.pid))
            time.sleep(1)
        took = time.monotonic() - t0
        for s in socks:
            s.close()
        time.sleep(10)
        after = _rss_mb(proc.pid)
        print(f"3 unread streams dropped after {took:.0f} s ({DROPPED} {_dropped(url):.0f})")
        print(
            f"frontend RSS: warm {warm:.0f} MB, peak {peak:.0f} MB, "
            f"10 s after the sockets closed {after:.0f} MB ({after - warm:+.0f} MB)"
        )
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
