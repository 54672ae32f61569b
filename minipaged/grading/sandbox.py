"""The throw-away sandbox a submission's Jupyter kernel runs in, built from the OS's own tools.

Concept
    Each submission gets a fresh kernel started through ``bwrap`` (bubblewrap, Debian's
    ``bubblewrap`` package) as an unprivileged user (``minipaged-grader``, created with
    ``useradd`` when the grader runs as root), under resource limits set with ``prlimit``:

    * filesystem: ``/usr``, ``/lib``, ``/etc``, the Python installation and the virtual
      environment read-only; the chapter's *student build* of the package
      (``student_build.py``: no implementation that answers an exercise, no reference)
      read-only at ``/opt/minipaged`` and also on top of the real package's folder when
      that lies inside a bound folder (a non-editable install in the venv's
      site-packages), so no path of the sandbox leads to the real package (the authored
      notebooks, the instructor's key, the tests and other submissions are not in the
      sandbox at all); a fresh ``/tmp`` (tmpfs capped at
      ``Limits.tmpfs_bytes``) as the working folder; the kernel's private socket folder
      (its connection file and Unix sockets, a fresh folder per kernel) is writable only
      while the kernel starts: before any student cell runs it is handed back to root,
      read-only to the sandbox user;
    * one uid per concurrent submission (``slot_user``): ``--jobs 2`` grades as
      ``minipaged-grader`` and ``minipaged-grader-1``, so the process limit is per
      submission and one submission's thread hoard cannot stop a classmate's kernel;
    * namespaces: own PID namespace (``/proc`` shows only the sandbox: no grader command
      line, no other kernels), no network, own IPC and hostname; the kernel talks to the
      grader over Unix sockets in a per-submission folder bound into the sandbox;
    * limits (prlimit; cgroups are not used: a CI container rarely delegates them):
      address space, CPU seconds, processes (per uid, so per submission), open files,
      file size, no core dumps;
    * afterwards: killing the kernel ends the PID namespace, so every process it started
      dies; the tmpfs and the socket folder are removed.

Inputs / outputs
    ``probe(user=..., create_user=True)`` -> ``Isolation`` (what this machine gives, once
    per process); ``Isolation.describe()`` is the line the grader prints, naming every
    missing piece. ``Isolation.wrap(cmd, workdir)`` -> the kernel command line wrapped in
    prlimit / bwrap / setpriv. ``Limits`` holds the numbers.

Invariants
    a piece that is missing (no bwrap, not root, the Python not readable by the grader
    user) is never silently skipped: ``Isolation.missing`` names it and the grader prints
    it before grading starts.

Failure mode
    never raises for a missing tool; ``wrap`` with nothing available returns the command
    with only the limits (or unchanged on a system without ``prlimit``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

GRADER_USER = "minipaged-grader"
PACKAGE_MOUNT = "/opt/minipaged"


def slot_user(slot: int) -> str:
    """The sandbox user of concurrent grading slot ``slot`` (one uid per submission graded at once)."""
    return GRADER_USER if slot == 0 else f"{GRADER_USER}-{slot}"


@dataclass
class Limits:
    memory_bytes: int = 6 * 2**30  # address space of the kernel process
    cpu_seconds: int = 900  # CPU time of one kernel (a restart gets a fresh one)
    processes: int = 256  # processes and threads of the slot's uid: of this one submission
    open_files: int = 256
    file_bytes: int = 64 * 2**20  # largest file the kernel may write
    tmpfs_bytes: int = 256 * 2**20  # the sandbox's /tmp (its only writable folder)

    def prlimit_args(self) -> list[str]:
        return [
            f"--as={self.memory_bytes}",
            f"--cpu={self.cpu_seconds}",
            f"--nproc={self.processes}",
            f"--nofile={self.open_files}",
            f"--fsize={self.file_bytes}",
            "--core=0",
        ]


@dataclass
class Isolation:
    bwrap: Optional[str] = None
    user: Optional[str] = None  # the unprivileged user the kernel runs as
    prlimit: Optional[str] = None
    setpriv: Optional[str] = None
    limits: Limits = field(default_factory=Limits)
    missing: list = field(default_factory=list)  # one line per missing piece
    package_dir: str = ""  # the package the kernel imports (the student build when grading)
    real_package_dir: str = ""  # the installed package: hidden under package_dir in the sandbox

    @property
    def complete(self) -> bool:
        return not self.missing

    def describe(self) -> str:
        got = []
        if self.bwrap:
            got.append(
                "bubblewrap sandbox (own PID/network/IPC namespaces, read-only package, no "
                "authored notebooks or other submissions, fresh /tmp)"
            )
        if self.user:
            got.append(f"user {self.user} (one uid per submission graded at once)")
        if self.prlimit:
            lim = self.limits
            got.append(
                f"limits: memory {lim.memory_bytes // 2**20} MiB, CPU {lim.cpu_seconds} s, "
                f"{lim.processes} processes per submission, {lim.open_files} open files, "
                f"files up to {lim.file_bytes // 2**20} MiB, /tmp {lim.tmpfs_bytes // 2**20} MiB"
            )
        lines = ["isolation: " + ("; ".join(got) if got else "none")]
        lines += [f"isolation MISSING: {m}" for m in self.missing]
        return "\n".join(lines)

    def wrap(self, cmd: list[str], workdir: str) -> list[str]:
        """``cmd`` (the kernel's command line) run inside the sandbox; ``workdir`` is the
        per-submission folder (connection file and sockets), bound read-write."""
        out: list[str] = []
        if self.prlimit:
            out += [self.prlimit, *self.limits.prlimit_args(), "--"]
        if self.bwrap:
            out += [
                self.bwrap,
                *_bwrap_args(self.package_dir, workdir, self.limits.tmpfs_bytes, self.real_package_dir),
            ]
        if self.user and self.setpriv:
            out += [
                self.setpriv,
                f"--reuid={self.user}",
                f"--regid={self.user}",
                "--clear-groups",
                "--no-new-privs",
                "--",
            ]
        return out + list(cmd)

    def for_slot(self, slot: int) -> Isolation:
        """This isolation for concurrent slot ``slot``: its own uid (``slot_user``), created
        when the grader runs as root; the same user, said in ``missing``, where it cannot be."""
        iso = dataclasses.replace(self, missing=list(self.missing))
        if slot == 0 or self.user is None:
            return iso
        name = _ensure_user(slot_user(slot), create=True)
        if name:
            iso.user = name
        else:
            iso.missing.append(f"no user {slot_user(slot)}: slot {slot} shares {self.user}'s process limit")
        return iso

    def with_package(self, package_dir: str) -> Isolation:
        """This isolation with ``package_dir`` (a student build) in place of the package."""
        return dataclasses.replace(
            self,
            missing=list(self.missing),
            package_dir=str(package_dir),
            real_package_dir=self.real_package_dir or self.package_dir,
        )

    def env(self, base: dict) -> dict:
        """The kernel's environment: nothing of the grader's but what Python needs."""
        keep = {k: base[k] for k in ("PATH", "LANG", "LC_ALL", "TZ") if k in base}
        keep.update(
            MPLBACKEND="Agg",
            PYTHONDONTWRITEBYTECODE="1",
            PYTHONNOUSERSITE="1",
            HOME="/tmp" if self.bwrap else base.get("HOME", "/tmp"),
            TRITON_CACHE_DIR="/tmp/.triton" if self.bwrap else base.get("TRITON_CACHE_DIR", ""),
        )
        if not keep["TRITON_CACHE_DIR"]:
            del keep["TRITON_CACHE_DIR"]
        if "TRITON_INTERPRET" in base:
            keep["TRITON_INTERPRET"] = base["TRITON_INTERPRET"]
        keep["PYTHONPATH"] = PACKAGE_MOUNT if self.bwrap else str(Path(self.package_dir).parent)
        return keep


def _python_dirs() -> list[str]:
    dirs = {
        os.path.realpath(sys.prefix),
        os.path.realpath(sys.base_prefix),
        os.path.realpath(os.path.dirname(os.path.realpath(sys.executable))),
        sys.prefix,
    }
    out = []
    for d in sorted(dirs):
        if not any(d == s or d.startswith(s + "/") for s in ("/usr", "/lib", "/lib64", "/bin", "/etc")):
            out.append(d)
    # a folder inside another one is covered by it
    return [d for d in out if not any(d != o and d.startswith(o + "/") for o in out)]


def _bwrap_args(package_dir: str, workdir: str, tmpfs_bytes: int, real_package_dir: str = "") -> list[str]:
    args = [
        "--die-with-parent",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--hostname",
        "minipaged-sandbox",
        # first the fresh /tmp, so a Python or a socket folder under the host's /tmp is
        # mounted on top of it, not hidden by it
        "--size",
        str(int(tmpfs_bytes)),
        "--tmpfs",
        "/tmp",
        "--perms",
        "0777",
        "--dir",
        "/tmp/work",
    ]
    binds = [
        (p, p) for p in ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc") if os.path.exists(p)
    ]
    binds += [(d, d) for d in _python_dirs()]
    binds.append((package_dir, f"{PACKAGE_MOUNT}/minipaged"))
    real = os.path.realpath(real_package_dir) if real_package_dir else ""
    if real and real != os.path.realpath(package_dir) and any(real.startswith(d + "/") for _, d in binds):
        # NOTE: a non-editable install lives in the venv's site-packages, which is bound:
        # the student build goes on top of it, so sys.path's site-packages entry (or any
        # path a cell builds by hand) finds the build, never the real package
        binds.append((package_dir, real))
    made = {"/", "/tmp"}
    for src, dest in binds + [(workdir, workdir)]:
        # NOTE: bwrap (as root) makes the missing parents of a mount point mode 0700, which
        # the unprivileged user cannot cross; create them 0755 first.
        parents = []
        p = Path(dest).parent
        while str(p) not in made:
            parents.append(str(p))
            p = p.parent
        for q in reversed(parents):
            if not any(q == d or q.startswith(d + "/") for _, d in binds if d != dest):
                args += ["--perms", "0755", "--dir", q]
            made.add(q)
        args += ["--bind" if dest == workdir else "--ro-bind", src, dest]
        made.add(dest)
    args += ["--proc", "/proc", "--dev", "/dev", "--chdir", "/tmp/work"]
    return args


def _user_exists(name: str) -> bool:
    try:
        import pwd

        pwd.getpwnam(name)
        return True
    except (KeyError, ImportError):
        return False


def _ensure_user(name: str, create: bool) -> Optional[str]:
    """The name if the user exists (created when ``create`` and root), else None."""
    if _user_exists(name):
        return name
    if not create or os.geteuid() != 0 or not shutil.which("useradd"):
        return None
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return name if _user_exists(name) else None


def _works(cmd: list[str], env: dict) -> bool:
    try:
        return (
            subprocess.run(
                cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60, cwd="/", env=env
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


_PROBED: dict = {}


def probe(
    user: str = GRADER_USER, create_user: bool = True, limits: Optional[Limits] = None, use_bwrap: bool = True
) -> Isolation:
    """What isolation this machine gives (cached per process and arguments)."""
    key = (user, create_user, use_bwrap)
    if key in _PROBED:
        iso = _PROBED[key]
        return dataclasses.replace(iso, limits=limits or Limits(), missing=list(iso.missing))
    import minipaged

    real = str(Path(minipaged.__file__).resolve().parent)
    iso = Isolation(limits=limits or Limits(), package_dir=real, real_package_dir=real)
    if sys.platform != "linux":
        iso.missing.append(
            f"sandboxing needs Linux (this is {sys.platform}): kernels run as you, with no limits"
        )
        _PROBED[key] = iso
        return iso
    iso.prlimit = shutil.which("prlimit")
    if not iso.prlimit:
        iso.missing.append("prlimit not found (util-linux): no memory/CPU/process/file limits")
    iso.setpriv = shutil.which("setpriv")
    if os.geteuid() == 0:
        name = _ensure_user(user, create_user)
        if name and iso.setpriv:
            iso.user = name
        else:
            iso.missing.append(
                f"no unprivileged user: could not create {user!r} (useradd) or find setpriv; "
                "kernels would run as root"
            )
    else:
        iso.missing.append(
            f"not running as root: kernels run as your own user (uid {os.geteuid()}), not a separate one"
        )
    bw = shutil.which("bwrap") if use_bwrap else None
    if bw is None:
        iso.missing.append(
            "bubblewrap (bwrap) not found: kernels can read the authored notebooks and "
            "other submissions, see other processes in /proc, and reach the network "
            "(apt-get install bubblewrap)"
        )
    else:
        test = Isolation(bw, iso.user, None, iso.setpriv, iso.limits, [], iso.package_dir)
        import tempfile

        with tempfile.TemporaryDirectory(prefix="minipaged-probe-") as d:
            os.chmod(d, 0o755)
            cmd = test.wrap([sys.executable, "-c", "import minipaged"], d)
            if _works(cmd, test.env(dict(os.environ))):
                iso.bwrap = bw
            else:
                iso.missing.append(
                    "bubblewrap is installed but could not start a sandbox here "
                    "(user namespaces off?): no filesystem or /proc isolation"
                )
    if iso.user and not iso.bwrap:
        # without bwrap the user must reach the Python installation by itself
        if not _works(
            iso.wrap([sys.executable, "-c", "import minipaged"], "/tmp"), iso.env(dict(os.environ))
        ):
            iso.missing.append(
                f"user {iso.user} cannot run {sys.executable} (its folder is not readable "
                "to other users): kernels run as root"
            )
            iso.user = None
    _PROBED[key] = iso
    return dataclasses.replace(iso, missing=list(iso.missing))
