"""Why a failure happened, in words: the stacks of a hung training process, and the one line per failure that
``deadpool status`` prints.

Owns the pure parts of a failure's evidence: reading a stack dump (py-spy's ``dump --json``, or the text that
Python's ``faulthandler`` writes), finding the training thread's innermost frame ("hung in ``all_reduce``"), bounding
what goes into an event, naming a signal, and ``cause_line``: a summary's failure entry (summary.py) as one sentence.
Does not own taking the evidence (agent/stacks.py: py-spy or the in-process dump; agent/supervisor.py: the exit
status and the stderr tail; launch/slurm_job.py: Slurm's node state), nor the summary's entries themselves.
Imports nothing of the package.
"""
from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass, field

STACK_MAX_CHARS = 16_000     # a stack dump kept in an event and in the summary: its first this many characters
TAIL_MAX_CHARS = 2_000       # a stderr tail in an event and in the summary: its last this many characters
TAIL_LINES = 20              # ... and at most this many lines
LINE_TAIL_CHARS = 160        # the stderr quoted in a cause line: its last line(s), this many characters
# the signal on which a training process writes every thread's stack to its stderr (worker/entry.py registers it,
# agent/stacks.py sends it): a real-time signal that neither Slurm, MPI nor the usual training code sends
STACK_SIGNAL = signal.SIGRTMIN + 4
# a frame in one of these is a library's (the interpreter's, torch's, this package's): "hung in" names it, and the
# innermost frame of the user's own code as well ("called from")
_LIBRARY = re.compile(r"(^|/)(lib/python3[^/]*|site-packages|dist-packages|deadpool_hpc)/|^<frozen ")


@dataclass
class Frame:
    function: str
    file: str
    line: int | None = None

    def where(self) -> str:
        """``file.py:LINE`` (the file's base name)."""
        base = self.file.rsplit("/", 1)[-1]
        return f"{base}:{self.line}" if self.line is not None else base

    def in_library(self) -> bool:
        return bool(_LIBRARY.search(self.file))


@dataclass
class Thread:
    name: str
    frames: list[Frame] = field(default_factory=list)   # innermost first


def parse_pyspy_json(text: str) -> list[Thread]:
    """Threads of py-spy's ``dump --json`` output (a list of stack traces, frames innermost first). Raises ValueError
    when ``text`` is not that."""
    try:
        traces = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"py-spy's output is not JSON: {exc}") from None
    if not isinstance(traces, list):
        raise ValueError(f"py-spy's output is a {type(traces).__name__}, not a list of threads")
    out = []
    for t in traces:
        name = t.get("thread_name") or f"thread {t.get('thread_id')}"
        if t.get("os_thread_id"):
            name += f" (tid {t['os_thread_id']})"
        frames = [Frame(str(f.get("name")), str(f.get("filename") or f.get("short_filename") or "?"), f.get("line"))
                  for f in t.get("frames") or []]
        out.append(Thread(name, frames))
    return out


_FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):")
_FH_FRAME = re.compile(r'^\s+File "(.*)", line (\d+|\?\?\?) in (.*)$')


def parse_faulthandler(text: str) -> list[Thread]:
    """Threads of Python's ``faulthandler.dump_traceback(all_threads=True)`` text (frames innermost first). Lines
    that are neither a thread's heading nor a frame are skipped (other output on the same stream)."""
    out: list[Thread] = []
    for line in text.splitlines():
        m = _FH_THREAD.match(line)
        if m:
            out.append(Thread(("current thread " if m.group(1).startswith("Current") else "thread ") + m.group(2)))
            continue
        m = _FH_FRAME.match(line)
        if m and out:
            out[-1].frames.append(Frame(m.group(3), m.group(1), int(m.group(2)) if m.group(2).isdigit() else None))
    return out


def format_stack(threads: list[Thread]) -> str:
    """Every thread's stack as text, the training thread's first (``training_thread``), each innermost frame first
    (as py-spy prints it), at most STACK_MAX_CHARS."""
    lines = []
    first = training_thread(threads)
    for t in sorted(threads, key=lambda t: t is not first):
        lines.append(f"Thread {t.name}:")
        lines += [f"    {f.function} ({f.file}:{f.line if f.line is not None else '?'})" for f in t.frames]
    return bound_head("\n".join(lines), STACK_MAX_CHARS)


def training_thread(threads: list[Thread]) -> Thread | None:
    """The thread that runs the training function: the one whose stack holds the training process's entry point
    (worker/entry.py ``main``), else py-spy's ``MainThread``, else the last one (faulthandler lists the main
    thread last)."""
    for t in threads:
        if any(f.function == "main" and f.file.endswith("worker/entry.py") for f in t.frames):
            return t
    for t in threads:
        if t.name.startswith("MainThread"):
            return t
    return threads[-1] if threads else None


def hung_in(threads: list[Thread]) -> dict | None:
    """Where the training thread is: ``{"function", "where", "user_function", "user_where"}`` (its innermost frame,
    and the innermost frame of code outside the interpreter's, the installed packages' and this package's, when that
    is another frame), or None without a training thread or frames."""
    t = training_thread(threads)
    if t is None or not t.frames:
        return None
    top = t.frames[0]
    user = next((f for f in t.frames if not f.in_library()), None)
    out = {"function": top.function, "where": top.where()}
    if user is not None and user is not top:
        out.update(user_function=user.function, user_where=user.where())
    return out


def bound_head(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n... ({len(text) - limit} characters more)"


def bound_tail(text: str, lines: int = TAIL_LINES, chars: int = TAIL_MAX_CHARS) -> str:
    """The last ``lines`` lines of ``text``, at most its last ``chars`` characters."""
    kept = "\n".join(text.rstrip("\n").splitlines()[-lines:])
    return kept[-chars:]


def signal_name(status: int) -> str | None:
    """``SIGKILL`` for an exit status -9 (``subprocess``'s convention: negative = killed by that signal); None
    for an exit code (status >= 0)."""
    if status >= 0:
        return None
    try:
        return signal.Signals(-status).name
    except ValueError:
        return f"signal {-status}"


def _rank(p: dict) -> str:
    if p.get("rank") is not None:
        return f"rank {p['rank']}"
    return f"local rank {p.get('local')} (a spare)"


def _on(p: dict) -> str:
    return f"node{p['node']}" if p.get("node") is not None else "its node"


def _quote_tail(tail: str | None) -> str:
    if not tail:
        return "nothing on stderr"
    last = " | ".join(x.strip() for x in tail.strip().splitlines()[-2:] if x.strip())
    return "last stderr: " + (last if len(last) <= LINE_TAIL_CHARS else "..." + last[-LINE_TAIL_CHARS:])


def process_line(p: dict) -> str:
    """One training process's evidence (a summary failure entry's ``processes`` item) as a clause."""
    at = f" at step {p['step']}" if p.get("step") is not None else ""
    if p.get("what") == "hang":
        h = p.get("hung_in") or {}
        if h:
            place = f" in `{h['function']}` ({h['where']})"
            if h.get("user_function"):
                place += f" called from `{h['user_function']}` ({h['user_where']})"
        else:
            place = ""
        stuck = f" for {p['stuck_s']:.1f} s" if p.get("stuck_s") is not None else ""
        if p.get("stack"):
            where = f"stack ({p.get('stack_source')}) in events.jsonl (hang_detected) and summary.json"
        else:
            where = f"no stack: {p.get('stack_error') or 'none taken'}"
        return f"{_rank(p)} hung{place}{at}{stuck} ({_on(p)}); {where}"
    if p.get("signal"):
        how = f"killed by {p['signal']}"
    else:
        how = f"exited with code {p.get('rc')}"
    start = " during its start-up" if p.get("during_start_up") else ""
    return f"{_rank(p)} {how}{at}{start} ({_on(p)}); {_quote_tail(p.get('stderr_tail'))}"


DRAIN_REASON_PREFIX = "deadpool job "   # the reason launch/keeper.py drains a lost node with


def slurm_clause(s: dict) -> str:
    """Slurm's view of a lost node: ``Slurm node3: DOWN+NOT_RESPONDING, Reason=Not responding`` (its host named;
    a Reason that is the watcher's own drain says so)."""
    reason = ""
    if s.get("reason"):
        ours = " (deadpool's drain)" if s["reason"].startswith(DRAIN_REASON_PREFIX) else ""
        reason = f", Reason={s['reason']}{ours}"
    return f"Slurm {s.get('host')}: {s.get('state') or 'state unknown'}{reason}"


def cause_line(f: dict) -> str:
    """A summary failure entry (summary.py ``_failure``) as one line a person reads: what failed, where, and how
    it was seen, e.g. "rank 2 hung in `all_reduce` (distributed_c10d.py:2501) at step 40 for 60.0 s (node2);
    stack (py-spy) in events.jsonl (hang_detected) and summary.json"."""
    parts = [process_line(p) for p in f.get("processes") or []]
    hosts = {s.get("lost_node"): s.get("host") for s in f.get("slurm") or []}
    nodes = [f"node{n}" + (f" (host {hosts[n]})" if hosts.get(n) else "") for n in f.get("failed_nodes") or []]
    if not parts:
        cause = f.get("cause")
        if f.get("kind") == "planned swap" or (cause or "").startswith("planned"):
            parts.append(f"{', '.join(nodes) or 'a node'} left on request (planned swap"
                         + (f": {f['reason']}" if f.get("reason") else "") + ")")
        elif f.get("reasons"):
            parts.append("; ".join(f.get("reasons")))
        elif nodes:
            seen = f.get("t_fault_source") or "no trace"
            parts.append(f"{', '.join(nodes)} lost whole (no training process exit or hang reported by its agent; "
                         f"fault time from: {seen})")
        else:
            parts.append(f.get("outcome") or "no node lost")
    parts += [slurm_clause(s) for s in f.get("slurm") or []]
    if f.get("kind") not in (None, "not injected", "planned swap"):
        parts.append(f"injected: {f['kind']} {f['target']}")
    return "; ".join(parts)
