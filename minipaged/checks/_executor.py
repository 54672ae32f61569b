"""Run code cells in a Jupyter kernel, one at a time, each with a time limit.

The grader's engine room. It talks to the kernel through ``jupyter_client`` directly (the
library nbclient is built on) because grading needs what nbclient's ``execute_cell``
does not give: after a timeout, *interrupt, wait a grace period, and if the kernel still
does not answer, kill it* and tell the caller, so the caller can start a fresh kernel,
replay the cells that define things, and go on with the next exercise.

Inputs / outputs
    ``KernelRunner(cwd, timeout)``; ``start()``; ``run(code) -> CellRun`` with ``status``
    one of ``"ok"``, ``"error"`` (the cell raised), ``"timeout"`` (interrupted in time,
    the kernel is usable), ``"hung"`` (did not stop after the interrupt: the kernel was
    shut down) or ``"died"`` (the kernel process exited); ``stdout``; ``error`` (one line);
    ``alive`` says whether the kernel can run the next cell. ``shutdown()``.

Invariants
    one cell at a time; output messages are matched to their request by ``msg_id``, so a
    late message of an interrupted cell never lands in the next cell's output. Cells run
    with ``stop_on_error=False`` so an error never makes the kernel skip later requests.

Failure mode
    a kernel that does not start within ``startup_timeout`` raises ``RuntimeError``.
"""

from __future__ import annotations

import os
import queue
import subprocess
import time
from dataclasses import dataclass, field
from typing import Optional


MAX_OUTPUT_CHARS = 1_000_000  # stream output kept per cell; the rest is read and dropped


@dataclass
class CellRun:
    status: str  # ok | error | timeout | hung | died
    stdout: str = ""
    error: str = ""  # "ExerciseFailure: ex2.4 failed on case 3 ..." (first lines)
    outputs: list = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.status in ("ok", "error", "timeout")


def _first_lines(text: str, n: int = 6, width: int = 300) -> str:
    lines = [ln[:width] for ln in str(text).splitlines() if ln.strip()]
    return "\n".join(lines[:n])


class KernelRunner:
    def __init__(
        self,
        cwd: str,
        timeout: float,
        interrupt_grace: float = 3.0,
        startup_timeout: float = 60.0,
        kernel_name: str = "python3",
        env: Optional[dict] = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.cwd = cwd
        self.timeout = float(timeout)
        self.interrupt_grace = float(interrupt_grace)
        self.startup_timeout = float(startup_timeout)
        self.kernel_name = kernel_name
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("MPLBACKEND", "Agg")
        self.km = None
        self.kc = None

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        from jupyter_client.manager import KernelManager

        self.km = KernelManager(kernel_name=self.kernel_name)
        # NOTE: the kernel's own stderr carries only its start-up log lines (not the
        # student's output, which comes over IOPub); keep them out of the score table.
        self.km.start_kernel(cwd=self.cwd, env=self.env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        self.kc = self.km.client()
        self.kc.start_channels()
        try:
            self.kc.wait_for_ready(timeout=self.startup_timeout)
        except RuntimeError as e:
            self.shutdown()
            raise RuntimeError(f"the Jupyter kernel did not start: {e}") from None

    def shutdown(self) -> None:
        if self.kc is not None:
            try:
                self.kc.stop_channels()
            except Exception:  # pragma: no cover - best effort
                pass
        if self.km is not None:
            try:
                self.km.shutdown_kernel(now=True)
            except Exception:  # pragma: no cover - best effort
                pass
        self.km = self.kc = None

    def restart(self) -> None:
        self.shutdown()
        self.start()

    @property
    def running(self) -> bool:
        return self.km is not None and self.km.is_alive()

    # -- one cell ----------------------------------------------------------------------
    def run(self, code: str, timeout: Optional[float] = None) -> CellRun:
        assert self.kc is not None and self.km is not None, "start() the kernel first"
        limit = self.timeout if timeout is None else float(timeout)
        msg_id = self.kc.execute(code, store_history=True, allow_stdin=False, stop_on_error=False)
        stdout, outputs, error = [], [], ""
        kept = 0  # characters of stream output kept so far
        deadline = time.monotonic() + limit
        interrupted = False
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if interrupted:  # the interrupt did not stop it: kill the kernel
                    self.shutdown()
                    return CellRun("hung", "".join(stdout),
                                   f"did not finish within {limit:g} s and ignored the interrupt",
                                   outputs)
                self.km.interrupt_kernel()
                interrupted = True
                deadline = time.monotonic() + self.interrupt_grace
                continue
            try:
                msg = self.kc.get_iopub_msg(timeout=min(remaining, 0.5))
            except queue.Empty:
                if not self.km.is_alive():
                    self.shutdown()
                    return CellRun("died", "".join(stdout),
                                   "the kernel died (os._exit, a crash, or out of memory)", outputs)
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue  # a late message of an earlier request
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content.get("execution_state") == "idle":
                break
            if kind == "stream":
                # NOTE: a cell that prints in a loop must not fill the grader's memory
                if kept < MAX_OUTPUT_CHARS:
                    text = content["text"][: MAX_OUTPUT_CHARS - kept]
                    kept += len(text)
                    outputs.append({"output_type": "stream", "name": content["name"], "text": text})
                    if content["name"] == "stdout":
                        stdout.append(text)
            elif kind == "error":
                outputs.append({"output_type": "error", "ename": content["ename"], "evalue": content["evalue"]})
                error = _first_lines(f"{content['ename']}: {content['evalue']}")
            elif kind in ("execute_result", "display_data"):
                text = content.get("data", {}).get("text/plain", "")
                outputs.append({"output_type": kind, "text": text})
        status = "ok"
        reply = self._shell_reply(msg_id)
        if reply is not None and reply["content"].get("status") != "ok":
            status = "error"
            if not error:
                c = reply["content"]
                error = _first_lines(f"{c.get('ename', 'Error')}: {c.get('evalue', '')}")
        elif error:
            status = "error"
        if interrupted:
            return CellRun("timeout", "".join(stdout), f"did not finish within {limit:g} s (interrupted)",
                           outputs)
        return CellRun(status, "".join(stdout), error, outputs)

    def _shell_reply(self, msg_id: str):
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                reply = self.kc.get_shell_msg(timeout=1.0)
            except queue.Empty:
                if not self.km.is_alive():
                    return None
                continue
            if reply.get("parent_header", {}).get("msg_id") == msg_id:
                return reply
        return None
