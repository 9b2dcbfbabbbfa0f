"""Every thread's Python stack of a hung training process, taken by its agent before the node is fenced.

Owns how the stack is taken, within ``STACK_TIMEOUT_S`` seconds in all:
1. py-spy (``py-spy dump --pid PID --json``, the field's tool: it reads the process's memory through ptrace and
   needs nothing from the process, so a training thread stuck in native code, a collective or a lock is read as
   well; https://github.com/benfred/py-spy). Measured here (2 shared cores, root): see docs/troubleshooting.md.
   It needs ptrace permission over the process: root or CAP_SYS_PTRACE, or Yama's ptrace_scope 0, or 1 with the
   training process naming its agent as its tracer (worker/entry.py does, ``PR_SET_PTRACER``).
2. Where py-spy is not installed or fails (no permission, an unsupported interpreter, its time out), the in-process
   dump: the agent sends ``STACK_SIGNAL`` to the process, whose handler (``faulthandler.register``, installed by
   worker/entry.py) writes every thread's stack to its stderr from C, without the GIL; the agent reads it from the
   stderr pipe (agent/stderrtail.py). It cannot read a process that is stopped (SIGSTOP) or stuck in the kernel
   with the signal blocked.
A process that is stopped (SIGSTOP: the ``--hang`` fault injection) can be read by neither (py-spy cannot suspend
it: measured, "Failed to suspend process"; the signal waits until it continues): it is reported as such at once.

Does not own what the stack means (cause.py) nor what is done with it (agent/node.py: the ``hang_detected`` event).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from .. import cause

STACK_TIMEOUT_S = 5.0      # both ways together: the most a hang's detection is delayed by its stack dump
STACK_SIGNAL = cause.STACK_SIGNAL
QUIET_S = 0.2              # the in-process dump is complete when its stderr was quiet this long after it began


@dataclass
class Stack:
    """A dump: ``text`` (every thread, innermost frame first; "" when none could be taken), ``source`` ("py-spy",
    "faulthandler" or None), ``seconds`` it took, ``hung_in`` (cause.hung_in), ``errors`` (why a way failed)."""
    text: str
    source: str | None
    seconds: float
    hung_in: dict | None
    errors: list[str]


def pyspy_path() -> str | None:
    """py-spy's executable: next to this interpreter (a virtual environment not activated), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.access(here, os.X_OK) else shutil.which("py-spy")


def pyspy_dump(pid: int, timeout: float, exe: str | None = None) -> list[cause.Thread]:
    """Every thread of process ``pid`` through py-spy. Raises RuntimeError naming why it could not (py-spy not
    installed: the package to install is named; its exit status and message; its time out)."""
    exe = exe or pyspy_path()
    if exe is None:
        raise RuntimeError("py-spy is not installed (pip install py-spy: the deadpool-hpc package depends on it)")
    try:
        out = subprocess.run([exe, "dump", "--pid", str(pid), "--json"], capture_output=True, text=True,
                             timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"py-spy took more than {timeout:.1f} s") from None
    except OSError as exc:
        raise RuntimeError(f"py-spy could not start: {exc}") from None
    if out.returncode != 0:
        why = (out.stderr or out.stdout).strip().splitlines()
        raise RuntimeError(f"py-spy exited with {out.returncode}: {why[-1] if why else 'no message'}")
    threads = cause.parse_pyspy_json(out.stdout)
    if not threads:
        raise RuntimeError("py-spy found no Python thread")
    return threads


def inprocess_dump(pid: int, send_signal, tails, local: int, timeout: float) -> list[cause.Thread]:
    """Every thread of training process ``pid`` (local rank ``local``) through its own faulthandler: ``send_signal``
    (sig) signals it, ``tails`` (agent/stderrtail.py) collects what it writes. Raises RuntimeError when nothing
    readable came within ``timeout`` seconds."""
    tails.capture(local)
    try:
        send_signal(STACK_SIGNAL)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            text, quiet = tails.captured(local)
            if cause.parse_faulthandler(text) and quiet >= QUIET_S:
                break
            time.sleep(0.02)
    finally:
        text = tails.end_capture(local)
    threads = cause.parse_faulthandler(text)
    if not threads:
        raise RuntimeError(f"no stack on its stderr within {timeout:.1f} s of {signal.Signals(STACK_SIGNAL).name} "
                           f"(pid {pid})")
    return threads


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (state T in /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] == "T"
    except (OSError, IndexError):
        return False


def take(pid: int, send_signal, tails, local: int, timeout: float = STACK_TIMEOUT_S, exe: str | None = None) -> Stack:
    """The stack of training process ``pid``: py-spy first, the in-process dump with the time left; never raises."""
    t0 = time.monotonic()
    errors: list[str] = []
    if stopped(pid):
        return Stack("", None, time.monotonic() - t0, None,
                     [f"process {pid} is stopped by a signal (SIGSTOP): neither py-spy nor its own handler can "
                      "read it"])
    for source in ("py-spy", "faulthandler"):
        left = timeout - (time.monotonic() - t0)
        if left <= 0.05:
            errors.append(f"{source}: no time left of {timeout:.1f} s")
            break
        try:
            if source == "py-spy":
                threads = pyspy_dump(pid, left, exe)
            else:
                threads = inprocess_dump(pid, send_signal, tails, local, left)
        except (RuntimeError, ValueError, OSError) as exc:
            errors.append(f"{source}: {exc}")
            continue
        return Stack(cause.format_stack(threads), source, time.monotonic() - t0, cause.hung_in(threads), errors)
    return Stack("", None, time.monotonic() - t0, None, errors)
