"""Watching a running server: the live page at ``/`` and the notebook helpers.

``LIVE_PAGE`` (served at ``/``) reads ``/trace`` (Server-Sent Events) and draws, after
every engine step, the active sequences (state, tokens, block table) and the pool of
physical blocks, in ``minipaged.viz``'s encoding: a request's colour is
``owner_color(k)`` for the k-th request seen (arrival order), states use
``STATE_COLORS``, free blocks ``FREE_GREY``, shared blocks have a black edge. Labels on
a fill are black or white as the config event says (``palette.text_color_on``, computed
once in Python); block-table cells are as wide as the pool's widest block id.

``fetch_trace(url)`` -> an ``EngineTrace`` of the server's recent steps (renumbered from
0), for ``minipaged.viz`` and its text renderings. ``attach_stepper(url)`` -> the
``minipaged.viz.stepper`` widget over a trace that grows as the server steps.
Failure mode: an unreachable server raises ``OSError`` (from the HTTP client); a server
with no steps yet gives an empty trace (``attach_stepper`` waits for the first step).

vLLM has no counterpart (it draws nothing); its ``/metrics`` is what dashboards read.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Optional

from minipaged.trace import EngineTrace, StepRecord

_STEP_FIELDS = set(StepRecord.__slots__)


def step_record(event: dict, step: int) -> StepRecord:
    """A ``StepRecord`` from one ``/trace`` step event, numbered ``step``."""
    fields = {k: v for k, v in event.items() if k in _STEP_FIELDS}
    fields["step"] = step
    fields["shared_blocks"] = {int(k): v for k, v in fields.get("shared_blocks", {}).items()}
    fields["time"] = None
    return StepRecord(**fields)


def _empty_trace(config: dict) -> EngineTrace:
    return EngineTrace(
        num_blocks=config["num_blocks"],
        block_size=config["block_size"],
        max_num_seqs=config["max_num_seqs"],
        max_num_batched_tokens=config["max_num_batched_tokens"],
        meta={"model": config.get("model"), "source": "minipaged serve"},
    )


def _add_event(trace: EngineTrace, event: dict) -> None:
    """Append one step event; request facts (prompt length, output length, finish reason)
    go to ``trace.requests`` with this trace's step numbers."""
    rec = step_record(event, len(trace.steps))
    for rid in rec.arrived_ids:
        trace.requests.setdefault(rid, {"prompt_len": None, "output_len": 0, "finish_step": None})[
            "arrival_step"
        ] = rec.step
    for rid, info in event.get("requests", {}).items():
        mine = trace.requests.setdefault(rid, {"arrival_step": rec.step, "finish_step": None})
        mine.update({k: v for k, v in info.items() if not k.endswith("_step")})
    for rid in rec.finished_ids:
        trace.requests.setdefault(rid, {"prompt_len": None})["finish_step"] = rec.step
    trace.record(rec)


def fetch_trace(url: str, history: int = 100_000, timeout: float = 30.0) -> EngineTrace:
    """The server's recent steps (up to ``history``) as an ``EngineTrace`` numbered from 0."""
    import urllib.request

    with urllib.request.urlopen(
        f"{url.rstrip('/')}/trace?format=json&history={history}", timeout=timeout
    ) as r:
        data = json.load(r)
    trace = _empty_trace(data["config"])
    for ev in data["steps"]:
        _add_event(trace, ev)
    return trace


class TraceFollower:
    """Reads ``/trace`` in a background thread into ``self.trace`` (an ``EngineTrace``)."""

    def __init__(self, url: str, on_step=None, history: int = 0) -> None:
        self.url, self.on_step, self.history = url.rstrip("/"), on_step, history
        self.trace: Optional[EngineTrace] = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="minipaged-trace", daemon=True)
        self.error: Optional[BaseException] = None

    def start(self, timeout: float = 30.0) -> TraceFollower:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"no answer from {self.url}/trace")
        if self.error is not None:
            raise self.error
        return self

    def _run(self) -> None:
        import httpx

        try:
            with httpx.stream(
                "GET", f"{self.url}/trace?history={self.history}", timeout=httpx.Timeout(10.0, read=None)
            ) as r:
                for line in r.iter_lines():
                    if self._stop.is_set():
                        return
                    if not line.startswith("data: "):
                        continue
                    ev = json.loads(line[6:])
                    if ev.get("type") == "config":
                        self.trace = _empty_trace(ev)
                        self._ready.set()
                    elif ev.get("type") == "step" and self.trace is not None:
                        _add_event(self.trace, ev)
                        if self.on_step is not None:
                            self.on_step(self.trace)
        except BaseException as e:  # noqa: BLE001 -- reported by start() / .error
            if not self._stop.is_set():
                self.error = e
        finally:
            self._ready.set()

    def wait_for_steps(self, n: int = 1, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.trace is None or len(self.trace.steps) < n:
            if time.monotonic() > deadline or self.error is not None:
                raise RuntimeError(f"fewer than {n} steps arrived from {self.url}/trace")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop reading (the thread ends at the next event or when the server closes)."""
        self._stop.set()


def attach_stepper(url: str, history: int = 64, timeout: float = 60.0, **stepper_kwargs):
    """The ``minipaged.viz.stepper`` widget over the live trace of the server at ``url``.

    Starts from the server's last ``history`` steps (or waits for its next step); the
    slider's end then moves as steps arrive.
    ``widget.follower.stop()`` stops following (the widget keeps what it has).
    """
    from minipaged.viz import stepper

    widget_box = {}

    def grow(trace: EngineTrace) -> None:
        w = widget_box.get("w")
        if w is not None and hasattr(w, "slider"):
            last = len(trace.steps) - 1
            w.play.max = last
            w.slider.max = last

    follower = TraceFollower(url, on_step=grow, history=history).start(timeout)
    follower.wait_for_steps(1, timeout)
    w = stepper(follower.trace, **stepper_kwargs)
    w.follower = follower
    widget_box["w"] = w
    grow(follower.trace)  # NOTE: steps that arrived while the widget was being built
    return w


LIVE_PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>minipaged serve: live block tables</title>
<style>
 body { font: 13px/1.4 system-ui, sans-serif; margin: 16px; color: #222; }
 h1 { font-size: 18px; margin: 0 0 4px 0; }
 #status { color: #555; margin-bottom: 8px; }
 .panels { display: flex; gap: 24px; align-items: flex-start; flex-wrap: wrap; }
 .panel h2 { font-size: 14px; margin: 0 0 4px 0; }
 svg text { font: 11px monospace; }
 .legend span { display: inline-block; margin-right: 12px; }
 .legend i { display: inline-block; width: 12px; height: 12px; vertical-align: -2px; margin-right: 4px; border: 1px solid #999; }
</style></head>
<body data-step="-1">
<h1>minipaged serve: live block tables</h1>
<div id="status">connecting to /trace ...</div>
<div class="legend" id="legend"></div>
<div class="panels">
 <div class="panel"><h2>active sequences</h2><svg id="seqs" width="620" height="40"></svg></div>
 <div class="panel"><h2>physical KV blocks</h2><svg id="pool" width="10" height="10"></svg>
  <div id="counts"></div></div>
</div>
<script>
"use strict";
const NS = "http://www.w3.org/2000/svg";
let cfg = null, latest = null, queued = false, cells = [];
let idW = 17;               // width of a block-table cell: fits the widest block id (set in setup)
const ID_FONT = 9, MAX_SHOWN_BLOCKS = 24, TABLE_X = 170;
const owners = new Map();   // sequence id -> colour index, in the order first seen
let finished = 0;

function el(tag, attrs, parent) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (parent) parent.appendChild(e);
  return e;
}
function ownerIndex(rid) { if (!owners.has(rid)) owners.set(rid, owners.size); return owners.get(rid); }
function ownerColor(rid) { const c = cfg.colors.owners; return c[ownerIndex(rid) % c.length]; }
// the label colour on a fill: black or white, chosen on the server by
// minipaged.viz.palette.text_color_on (WCAG contrast >= 4.5)
function ownerText(rid) { const c = cfg.colors.text.owners; return c[ownerIndex(rid) % c.length]; }
function shortName(rid, k) {   // as minipaged.viz.palette.short_name
  if (/^\d+$/.test(rid) && rid.length < 4) return "r" + rid;
  return rid.length <= 4 ? rid : "r" + k;
}
function setup(c) {
  cfg = c;
  // block-table cells as wide as the widest id this pool can hand out, measured in the
  // font they are drawn in (a 4-digit id does not fit the 17 px a 2-digit one needs)
  const seqs = document.getElementById("seqs");
  const probe = el("text", {x: 0, y: 0, style: "font-size:" + ID_FONT + "px"}, seqs);
  probe.textContent = "0".repeat(String(Math.max(0, c.num_blocks - 1)).length);
  idW = Math.max(17, Math.ceil(probe.getComputedTextLength()) + 4);
  probe.remove();
  seqs.setAttribute("width", Math.max(620, TABLE_X + MAX_SHOWN_BLOCKS * (idW + 1) + 4));
  const cols = 64, size = 10, rows = Math.ceil(c.num_blocks / cols);
  const pool = document.getElementById("pool");
  pool.innerHTML = "";
  pool.setAttribute("width", cols * size + 2);
  pool.setAttribute("height", rows * size + 2);
  cells = [];
  for (let b = 0; b < c.num_blocks; b++) {
    cells.push(el("rect", {x: 1 + (b % cols) * size, y: 1 + Math.floor(b / cols) * size,
      width: size - 1, height: size - 1, fill: c.colors.free, "data-block": b}, pool));
  }
  const lg = document.getElementById("legend");
  lg.innerHTML = "";
  for (const s of ["waiting", "prefill", "decode", "running", "preempted"]) {
    const sp = document.createElement("span");
    sp.innerHTML = '<i style="background:' + c.colors.states[s] + '"></i>' + s;
    lg.appendChild(sp);
  }
  const sp = document.createElement("span");
  sp.innerHTML = '<i style="background:' + c.colors.free + '"></i>free block';
  lg.appendChild(sp);
  document.getElementById("status").textContent =
    "connected: " + c.model + ", " + c.num_blocks + " blocks of " + c.block_size + " tokens";
}
function draw() {
  queued = false;
  const ev = latest;
  if (!cfg || !ev) return;
  for (const rid of ev.arrived_ids) ownerIndex(rid);
  const holder = new Map(), count = new Map();
  for (const [rid, table] of Object.entries(ev.block_tables)) {
    for (const b of table) {
      if (!holder.has(b)) holder.set(b, rid);
      count.set(b, (count.get(b) || 0) + 1);
    }
  }
  let used = 0;
  for (let b = 0; b < cells.length; b++) {
    const rid = holder.get(b), r = cells[b];
    if (rid === undefined) {
      r.setAttribute("fill", cfg.colors.free); r.removeAttribute("data-owner");
      r.removeAttribute("stroke");
    } else {
      used++;
      r.setAttribute("fill", ownerColor(rid)); r.setAttribute("data-owner", rid);
      if (count.get(b) > 1) { r.setAttribute("stroke", "#000"); } else { r.removeAttribute("stroke"); }
    }
  }
  // the active sequences: running ones (they hold blocks), then the waiting ones
  const active = Object.keys(ev.block_tables).concat(ev.waiting_ids.filter(r => !(r in ev.block_tables)));
  active.sort((a, b) => ownerIndex(a) - ownerIndex(b));
  const shown = active.slice(0, 40);
  const seqs = document.getElementById("seqs");
  seqs.innerHTML = "";
  const rowH = 16;
  seqs.setAttribute("height", Math.max(40, shown.length * rowH + 20));
  // SVG collapses spaces: one header text per column
  [["seq", 0], ["state", 56], ["tokens", 124], ["block table", TABLE_X]].forEach(([t, x]) => {
    el("text", {x: x, y: 11}, seqs).textContent = t;
  });
  shown.forEach((rid, i) => {
    const y = 16 + i * rowH, k = ownerIndex(rid);
    const state = ev.prefill_ids.includes(rid) ? "prefill" : ev.decode_ids.includes(rid) ? "decode"
      : (rid in ev.block_tables) ? "running" : "waiting";
    const g = el("g", {"data-seq": rid, "data-state": state}, seqs);
    el("rect", {x: 0, y: y, width: 12, height: rowH - 3, fill: ownerColor(rid)}, g);
    el("text", {x: 16, y: y + 11}, g).textContent = shortName(rid, k);
    el("rect", {x: 56, y: y, width: 60, height: rowH - 3, fill: cfg.colors.states[state]}, g);
    el("text", {x: 60, y: y + 11, fill: cfg.colors.text.states[state], "data-on": "state"}, g).textContent = state;
    el("text", {x: 124, y: y + 11}, g).textContent = String(ev.num_tokens[rid] || 0);
    (ev.block_tables[rid] || []).slice(0, MAX_SHOWN_BLOCKS).forEach((b, j) => {
      const x = TABLE_X + j * (idW + 1);
      el("rect", {x: x, y: y, width: idW, height: rowH - 3, fill: ownerColor(rid),
                  stroke: (count.get(b) > 1) ? "#000" : "none", "data-block": b}, g);
      el("text", {x: x + idW / 2, y: y + 10, "text-anchor": "middle", fill: ownerText(rid),
                  style: "font-size:" + ID_FONT + "px", "data-block": b}, g).textContent = String(b);
    });
  });
  if (active.length > shown.length) {
    el("text", {x: 0, y: 16 + shown.length * rowH + 10}, seqs).textContent =
      "... and " + (active.length - shown.length) + " more";
  }
  document.body.dataset.step = String(ev.step);
  document.body.dataset.used = String(used);
  document.getElementById("status").textContent = "step " + ev.step + ": " +
    Object.keys(ev.block_tables).length + " running, " + ev.waiting_ids.length + " waiting, " +
    finished + " finished";
  document.getElementById("counts").textContent =
    used + " of " + cfg.num_blocks + " blocks in use, " + ev.num_free_blocks + " free";
}
const source = new EventSource("trace?history=1");
source.onmessage = (m) => {
  const ev = JSON.parse(m.data);
  if (ev.type === "config") { setup(ev); return; }
  if (ev.type !== "step") return;
  finished += ev.finished_ids.length;
  latest = ev;
  if (!queued) { queued = true; requestAnimationFrame(draw); }
};
source.onerror = () => { document.getElementById("status").textContent += " (reconnecting)"; };
</script>
</body></html>
"""
