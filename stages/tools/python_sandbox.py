"""python: run a snippet in a sandboxed subprocess and return its stdout. Arguments: {"code": "print(6 * 7)"}.

Layers, each doing what it can (checked on this machine: root in a container where `unshare --net` works):

| what | how | enforced by |
|---|---|---|
| wall clock | the process group is killed after `timeout_s` | parent, SIGKILL |
| CPU time | RLIMIT_CPU: SIGXCPU, then SIGKILL | kernel |
| memory | RLIMIT_AS: allocations beyond it raise MemoryError | kernel |
| file size, fds, core | RLIMIT_FSIZE 16 MiB, RLIMIT_NOFILE 64, no core dumps | kernel |
| network | a new, empty network namespace (`unshare --net`, or `unshare -rn` for non-root) when permitted | kernel |
|  | an audit hook refuses every `socket.*` event (create, connect, bind, getaddrinfo) | interpreter |
| writes | the snippet runs as `nobody` when the parent is root; only its temporary directory is its own | kernel |
|  | the audit hook refuses opening for writing, creating, removing or renaming outside that directory | interpreter |
| processes | the audit hook refuses fork, exec, spawn, system, subprocess; ctypes is refused | interpreter |
| isolation | `python -I -S -B`: no environment, site-packages or bytecode writes; stdin is /dev/null | interpreter |

Running as `nobody` has a cost: a snippet can import only the stdlib modules in PRELOAD (imported before the uid
drop) plus whatever `nobody` can read, since the interpreter's own files may be private to root.

The audit hook is a guard against accidents and ordinary code, not a security boundary: CPython's audit hooks can
be evaded by code that corrupts the interpreter. The kernel layers (limits, namespace, uid) hold regardless; where a
layer is not available here (no namespace permission, not root) the others still apply, and `PythonSandbox.layers`
says which are on. Every failure comes back as a SandboxResult with the reason, never as an exception.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from stages.tools import ToolError

NOBODY = 65534
FSIZE_BYTES = 16 << 20
OUTPUT_CAP = 8192
# Importable by a snippet that runs as `nobody` (see the bootstrap); socket and subprocess so that using them is
# refused by the audit hook with a clear message rather than failing to import.
PRELOAD = (
    "bisect collections copy dataclasses datetime decimal encodings.idna fractions functools heapq itertools json "
    "math operator random re socket statistics string subprocess textwrap time typing"
).split()

# Runs in the child before the snippet: limits, uid, then the audit hook, then the snippet.
_BOOTSTRAP = (
    r"""
import os, resource, sys
work, snippet, mem, cpu, drop = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (@FSIZE@, @FSIZE@))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if drop:
    # Imports after the drop can only read what `nobody` may read, which need not include the interpreter's stdlib
    # (here it lives under /root): import the modules snippets commonly use while still allowed to.
    for name in PRELOAD:
        __import__(name)
    os.setgroups([])
    os.setgid(@NOBODY@)
    os.setuid(@NOBODY@)
os.chdir(work)
with open(snippet) as f:
    source = f.read()
root = os.path.realpath(work) + os.sep
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
PATHS = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link", "os.chmod", "os.chown",
         "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move"}
PROCS = {"os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen",
         "pty.spawn", "os.startfile", "os.kill", "os.killpg"}

def outside(path):
    if isinstance(path, int):
        return False
    try:
        return not os.path.realpath(os.fsdecode(path)).startswith(root)
    except (TypeError, ValueError):
        return True

def hook(event, args):
    if event == "open":
        path, mode, flags = args
        writes = isinstance(mode, str) and any(c in mode for c in "wax+")
        writes = writes or (isinstance(flags, int) and flags & WRITE)
        if writes and outside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the sandbox directory is refused")
    elif event in PATHS:
        for arg in args:
            if isinstance(arg, (str, bytes)) and outside(arg):
                raise PermissionError(f"sandbox: {event} on {arg!r} outside the sandbox directory is refused")
    elif event.startswith("socket."):
        raise PermissionError(f"sandbox: network access is refused ({event})")
    elif event in PROCS:
        raise PermissionError(f"sandbox: starting or signalling processes is refused ({event})")
    elif event.startswith("ctypes."):
        raise PermissionError(f"sandbox: ctypes is refused ({event})")

sys.addaudithook(hook)
del hook
exec(compile(source, "snippet.py", "exec"), {"__name__": "__main__"})
""".replace("PRELOAD", repr(PRELOAD))
    .replace("@FSIZE@", str(FSIZE_BYTES))
    .replace("@NOBODY@", str(NOBODY))
)


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int | None
    error: str | None  # why the snippet did not run to a clean exit; None when it did


@functools.cache
def network_namespace_prefix() -> tuple[str, ...]:
    """The command prefix that gives the child an empty network namespace, or () where this is not permitted."""
    prefix = ("unshare", "--net") if os.geteuid() == 0 else ("unshare", "-rn")
    if shutil.which("unshare") is None:
        return ()
    try:
        ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return prefix if ok else ()


class PythonSandbox:
    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 256, cpu_s: int = 2) -> None:
        self.timeout_s, self.memory_mb, self.cpu_s = timeout_s, memory_mb, cpu_s

    @property
    def layers(self) -> dict[str, bool]:
        return {
            "network_namespace": bool(network_namespace_prefix()),
            "runs_as_nobody": os.geteuid() == 0,
            "rlimits": True,
            "audit_hook": True,
        }

    async def __call__(self, arguments: dict[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            raise ToolError('python needs {"code": "<python source>"}')
        result = await self.run(code)
        if result.error is not None:
            raise ToolError(result.error)
        return result.stdout

    async def run(self, code: str) -> SandboxResult:
        work = tempfile.mkdtemp(prefix="asyncrl-sandbox-")
        try:
            return await self._run_in(work, code)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    async def _run_in(self, work: str, code: str) -> SandboxResult:
        snippet = os.path.join(work, "snippet.py")
        with open(snippet, "w") as f:
            f.write(code)
        drop = os.geteuid() == 0
        if drop:  # the unprivileged child owns its directory and nothing else
            os.chown(work, NOBODY, NOBODY)
            os.chown(snippet, NOBODY, NOBODY)
        memory = str(self.memory_mb << 20)
        argv = [sys.executable, "-I", "-S", "-B", "-c", _BOOTSTRAP, work, snippet, memory, str(self.cpu_s)]
        proc = await asyncio.create_subprocess_exec(
            *network_namespace_prefix(),
            *argv,
            "1" if drop else "0",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=work,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            start_new_session=True,  # its own process group, so a timeout kills everything it started
        )
        reads = asyncio.gather(_read_capped(proc.stdout), _read_capped(proc.stderr), proc.wait())
        try:
            out, err, code_ = await asyncio.wait_for(asyncio.shield(reads), self.timeout_s)
        except TimeoutError:
            _kill_group(proc.pid)
            out, err, code_ = await reads
            return SandboxResult(out, err, code_, f"timed out after {self.timeout_s}s of wall clock; killed")
        return SandboxResult(out, err, code_, self._diagnose(code_, err))

    def _diagnose(self, returncode: int, stderr: str) -> str | None:
        if returncode == 0:
            return None
        if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
            return f"CPU time limit of {self.cpu_s}s exceeded (RLIMIT_CPU); killed"
        lines = [line for line in stderr.strip().splitlines() if line.strip()]
        last = lines[-1] if lines else f"exit code {returncode}"
        if last.startswith("MemoryError"):
            return f"memory limit of {self.memory_mb} MiB exceeded (RLIMIT_AS): {last}"
        if returncode < 0:
            return f"killed by signal {signal.Signals(-returncode).name}"
        return last


async def _read_capped(stream: asyncio.StreamReader) -> str:
    """Up to OUTPUT_CAP bytes of the stream; the rest is read and dropped so the child never blocks on a full pipe."""
    kept = bytearray()
    while chunk := await stream.read(65536):
        kept += chunk[: max(0, OUTPUT_CAP - len(kept))]
    return kept.decode("utf-8", errors="replace")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
