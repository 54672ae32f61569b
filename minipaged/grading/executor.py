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

Sandbox
    with ``isolation`` (``minipaged.grading.sandbox.Isolation``) the kernel command is wrapped
    in prlimit / bwrap / setpriv, the kernel gets a per-run folder for its connection file
    and Unix sockets (``transport="ipc"``: the sandbox has no network), a stripped
    environment, and interrupts go over the control channel (a signal to the process group
    would stop bwrap itself). Output is kept up to ``max_output_bytes`` per cell (all
    output kinds together; the rest is read and dropped) and a single message larger than
    ``MAX_MESSAGE_BYTES`` is dropped by ZeroMQ before it is read into memory. The kernel's
    client and manager share one ZeroMQ context per kernel, destroyed at ``shutdown()``
    (jupyter_client would otherwise leave one context and its I/O thread per kernel).

Failure mode
    a kernel that does not start within ``startup_timeout`` raises ``RuntimeError``. Any
    exception of the kernel client while a cell runs (a message that fails its signature or
    is not JSON, a closed socket) stops that kernel and comes back as ``"died"`` with the
    exception named: nothing a cell does raises out of ``run``.
"""

from __future__ import annotations

import os
import queue
import subprocess
import time
from dataclasses import dataclass, field
from typing import Optional

MAX_OUTPUT_BYTES = 64 * 2**10  # output kept per student cell; the rest is read and dropped
RECEIVE_QUEUE_MESSAGES = (
    4  # IOPub messages (each at most MAX_MESSAGE_BYTES) ZeroMQ holds before dropping new ones
)
MAX_ERROR_BYTES = 4 * 2**10  # an exception's text kept per cell
MAX_MESSAGE_BYTES = 32 * 2**20  # larger messages from the kernel are dropped unread (ZMQ_MAXMSGSIZE)
UID_DRAIN_SECONDS = 10.0  # a fresh kernel waits this long at most for the slot's last processes to end
IOPUB_LOST_AFTER = 10.0  # seconds of IOPub silence after the execute reply: the output channel is gone


@dataclass
class CellRun:
    status: str  # ok | error | timeout | hung | died
    stdout: str = ""
    error: str = ""  # "ExerciseFailure: ex2.4 failed on case 3 ..." (first lines)
    outputs: list = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.status in ("ok", "error", "timeout")


def _clip(text: str, max_bytes: int) -> str:
    """At most ``max_bytes`` of ``text`` (UTF-8), cut at a character boundary."""
    if max_bytes <= 0:
        return ""
    raw = str(text).encode("utf-8")
    return text if len(raw) <= max_bytes else raw[:max_bytes].decode("utf-8", "ignore")


def _make_manager_class():
    from jupyter_client.manager import KernelManager

    class SandboxKernelManager(KernelManager):
        """A KernelManager whose kernel command runs inside ``self.isolation``."""

        isolation = None

        def format_kernel_cmd(self, extra_arguments=None):
            cmd = super().format_kernel_cmd(extra_arguments)
            iso = self.isolation
            if iso is None:
                return cmd
            os.chmod(self.connection_file, 0o644)  # the sandbox user reads it
            if iso.bwrap:
                # NOTE: in its own PID namespace the kernel's parent is bwrap's init (pid 1),
                # which ipykernel's parent poller reads as "the grader exited"; bwrap's
                # --die-with-parent does that job instead.
                cmd = [*cmd, "--IPKernelApp.parent_handle=0"]
            return iso.wrap(cmd, os.path.dirname(self.connection_file))

    return SandboxKernelManager


def _uid_processes(uid: int) -> int:
    """How many processes (and threads' leaders) of ``uid`` are alive, from ``/proc``."""
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        n += int(line.split()[1]) == uid
                        break
        except OSError:
            continue  # it ended while we looked
    return n


def _wait_for_uid_to_drain(uid: int, timeout: float = UID_DRAIN_SECONDS) -> None:
    """Wait (up to ``timeout``) until the sandbox user ``uid`` has no process left."""
    if not os.path.isdir("/proc"):
        return
    deadline = time.monotonic() + timeout
    while _uid_processes(uid) and time.monotonic() < deadline:
        time.sleep(0.1)


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
        isolation=None,
        max_output_bytes: int = MAX_OUTPUT_BYTES,
    ) -> None:
        if not timeout > 0:  # NOTE: also rejects NaN
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.cwd = cwd
        self.timeout = float(timeout)
        self.interrupt_grace = float(interrupt_grace)
        self.startup_timeout = float(startup_timeout)
        self.kernel_name = kernel_name
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("MPLBACKEND", "Agg")
        self.isolation = isolation
        self.max_output_bytes = int(max_output_bytes)
        self.km = None
        self.kc = None
        self._ctx = None
        self._rundir = None

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        import zmq

        iso = self.isolation
        ctx = zmq.Context()
        ctx.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        # NOTE: a kernel that prints faster than the grader reads must not queue its output
        # in the grader's memory (ZeroMQ's default is 1000 messages per socket: 1 GB of 1 MB
        # prints); past this many waiting messages IOPub drops them, the cap drops the rest
        ctx.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE_MESSAGES)
        kwargs = {"kernel_name": self.kernel_name, "context": ctx}
        env, cwd = self.env, self.cwd
        if iso is not None:
            import tempfile

            self._rundir = tempfile.mkdtemp(prefix="minipaged-kernel-")
            if iso.user:
                import pwd

                pw = pwd.getpwnam(iso.user)
                # NOTE: the last kernel of this slot may have left a process hoard (forks up
                # to the per-uid limit) that its PID namespace is still tearing down; a new
                # kernel started now could not start a thread
                _wait_for_uid_to_drain(pw.pw_uid)
                os.chown(self._rundir, pw.pw_uid, pw.pw_gid)
            os.chmod(self._rundir, 0o700)
            kwargs.update(
                transport="ipc",
                ip=os.path.join(self._rundir, "s"),
                connection_file=os.path.join(self._rundir, "kernel.json"),
            )
            env = iso.env(self.env)
            cwd = self._rundir if iso.bwrap else self.cwd
            if iso.user and not iso.bwrap:
                cwd = self._rundir
        self.km = _make_manager_class()(**kwargs)
        self.km.isolation = iso
        if iso is not None and iso.bwrap:
            self.km.kernel_spec.interrupt_mode = "message"
        # NOTE: the kernel's own stderr carries only its start-up log lines (not the
        # student's output, which comes over IOPub); keep them out of the score table.
        # (MINIPAGED_GRADE_DEBUG=1 shows them, to debug a sandbox that does not start)
        quiet = subprocess.DEVNULL if not os.environ.get("MINIPAGED_GRADE_DEBUG") else None
        self.km.start_kernel(cwd=cwd, env=env, stdout=quiet, stderr=quiet)
        self._ctx = ctx
        self.kc = self.km.client(context=ctx)  # the same context: its limit applies, it is destroyed
        self.kc.start_channels()
        try:
            self.kc.wait_for_ready(timeout=self.startup_timeout)
        except Exception as e:  # RuntimeError (no reply in time) or whatever the client raised
            self.shutdown()
            raise RuntimeError(f"the Jupyter kernel did not start: {e}") from None
        if iso is not None and iso.user and self._rundir is not None:
            # NOTE: the kernel has bound its sockets; from now on the folder is root's and
            # read-only to the sandbox user, so no student cell can write to the host's disk
            # through it (the sockets keep working: connecting needs no write permission)
            os.chown(self._rundir, 0, 0)
            os.chmod(self._rundir, 0o755)

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
        if getattr(self, "_ctx", None) is not None:
            try:
                self._ctx.destroy(linger=0)
            except Exception:  # pragma: no cover - best effort
                pass
            self._ctx = None
        self.km = self.kc = None
        if self._rundir is not None:
            import shutil

            shutil.rmtree(self._rundir, ignore_errors=True)
            self._rundir = None

    def restart(self) -> None:
        self.shutdown()
        self.start()

    @property
    def running(self) -> bool:
        return self.km is not None and self.km.is_alive()

    # -- one cell ----------------------------------------------------------------------
    def run(
        self,
        code: str,
        timeout: Optional[float] = None,
        store_history: bool = True,
        max_output_bytes: Optional[int] = None,
    ) -> CellRun:
        assert self.kc is not None and self.km is not None, "start() the kernel first"
        try:
            return self._run(code, timeout, store_history, max_output_bytes)
        except Exception as e:
            # NOTE: the kernel is the student's: it can re-key its session (every later
            # message then fails jupyter_client's "Invalid Signature" check), send frames that
            # are not JSON, close its sockets. Whatever the client raises ends this kernel,
            # never the grader: the cell reads as a kernel death (the caller restarts, bounded).
            self.shutdown()
            what = _clip(f"{type(e).__name__}: {e}", 300)
            return CellRun(
                "died",
                "",
                f"the grader could not read the kernel's messages ({what}); the kernel was stopped",
            )

    def _run(
        self,
        code: str,
        timeout: Optional[float],
        store_history: bool,
        max_output_bytes: Optional[int],
    ) -> CellRun:
        limit = self.timeout if timeout is None else float(timeout)
        msg_id = self.kc.execute(code, store_history=store_history, allow_stdin=False, stop_on_error=False)
        stdout, outputs, error = [], [], ""
        early_reply, quiet_since = None, time.monotonic()
        kept = 0  # bytes of output kept so far (all kinds together)
        cap = self.max_output_bytes if max_output_bytes is None else int(max_output_bytes)
        deadline = time.monotonic() + limit
        interrupted = False
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if interrupted:  # the interrupt did not stop it: kill the kernel
                    self.shutdown()
                    return CellRun(
                        "hung",
                        "".join(stdout),
                        f"did not finish within {limit:g} s and ignored the interrupt",
                        outputs,
                    )
                self.km.interrupt_kernel()
                interrupted = True
                deadline = time.monotonic() + self.interrupt_grace
                continue
            try:
                msg = self.kc.get_iopub_msg(timeout=min(remaining, 0.5))
            except queue.Empty:
                if not self.km.is_alive():
                    self.shutdown()
                    return CellRun(
                        "died",
                        "".join(stdout),
                        "the kernel died (os._exit, a crash, or out of memory)",
                        outputs,
                    )
                # NOTE: an output message over MAX_MESSAGE_BYTES makes ZeroMQ drop the IOPub
                # connection, with the "idle" status and every later output; the execute
                # reply on the shell channel still says the cell is done. The kernel is then
                # useless for grading: shut it down (the caller restarts, bounded).
                if early_reply is None and self.kc.shell_channel.msg_ready():
                    r = self.kc.get_shell_msg(timeout=0.1)
                    if r.get("parent_header", {}).get("msg_id") == msg_id:
                        early_reply, quiet_since = r, time.monotonic()
                elif early_reply is not None and time.monotonic() - quiet_since > IOPUB_LOST_AFTER:
                    if self._iopub_alive():
                        break  # NOTE: only dropped output (the receive queue was full): the cell is done
                    self.shutdown()
                    return CellRun(
                        "died",
                        "".join(stdout),
                        f"its output came in one message over {MAX_MESSAGE_BYTES // 2**20} MiB, "
                        "which the grader drops; the kernel was restarted",
                        outputs,
                    )
                continue
            quiet_since = time.monotonic()
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue  # a late message of an earlier request
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content.get("execution_state") == "idle":
                break
            if kind == "stream":
                # NOTE: a cell that prints in a loop must not fill the grader's memory
                if kept < cap:
                    text = _clip(content.get("text", ""), cap - kept)
                    kept += len(text.encode("utf-8"))
                    outputs.append({"output_type": "stream", "name": content.get("name"), "text": text})
                    if content.get("name") == "stdout":
                        stdout.append(text)
            elif kind == "error":
                # NOTE: an exception's text is kept bounded (a 100 MB message is cut here)
                ename, evalue = (
                    _clip(str(content.get("ename", "")), 200),
                    _clip(str(content.get("evalue", "")), MAX_ERROR_BYTES),
                )
                outputs.append({"output_type": "error", "ename": ename, "evalue": evalue})
                error = _first_lines(f"{ename}: {evalue}")
            elif kind in ("execute_result", "display_data", "update_display_data"):
                if kept < cap:
                    text = _clip(str(content.get("data", {}).get("text/plain", "")), cap - kept)
                    kept += len(text.encode("utf-8")) + 1
                    outputs.append({"output_type": kind, "text": text})
        status = "ok"
        reply = early_reply if early_reply is not None else self._shell_reply(msg_id)
        if reply is not None and reply["content"].get("status") != "ok":
            status = "error"
            if not error:
                c = reply["content"]
                error = _first_lines(
                    f"{_clip(str(c.get('ename', 'Error')), 200)}: {_clip(str(c.get('evalue', '')), MAX_ERROR_BYTES)}"
                )
        elif error:
            status = "error"
        if interrupted:
            return CellRun(
                "timeout", "".join(stdout), f"did not finish within {limit:g} s (interrupted)", outputs
            )
        return CellRun(status, "".join(stdout), error, outputs)

    def _iopub_alive(self, wait: float = 5.0) -> bool:
        """Does IOPub still carry messages? (A kernel_info request makes the kernel publish
        its busy/idle status there.) False after ZeroMQ dropped the connection."""
        probe = self.kc.kernel_info()
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                msg = self.kc.get_iopub_msg(timeout=0.5)
            except queue.Empty:
                continue
            if msg.get("parent_header", {}).get("msg_id") == probe:
                return True
        return False

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
