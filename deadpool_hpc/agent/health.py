"""Node health detectors: the extension point through which a site asks for a *planned* swap of a node.

A detector watches something the control plane cannot see (Slurm's view of the node, a health check, an operator's
request) and says, for the node its agent runs on, "this node should leave": the agent then retires the node at
the next step boundary (agent/planned.py): no step is recomputed, a spare takes its place. Failure
detection proper (a process's exit, a hang, heartbeats among agents) is the control plane's own and is not
pluggable: a detector can only *add* reasons to leave, never hide a failure.

Interface (docs/plugins.md has a working example):

- an entry point in the group ``deadpool_hpc.detectors`` names a *factory*, ``factory(node: NodeInfo)``, called
  once by each node agent at start-up; it returns a detector, or None when it does not apply there (e.g. no
  Slurm job);
- a detector has ``interval_s`` (float, seconds between checks, > 0) and ``check() -> Unhealthy | Slow | None``;
  ``check`` runs on the agent's health thread, never on its main loop, so it may block (a subprocess, a file
  read) for up to a few seconds. ``Unhealthy``: swap this node out at the next step boundary. ``Slow(factor,
  reason)``: this node runs ``factor`` times slower than it should (DCGM's clocks against their maximum, a NIC that
  negotiated a lower speed): a figure for the job-level straggler check (agent/stragglers.py), judged with the same
  factor, window and rules as the training processes' own work per step; the detector keeps being asked.

A factory that fails to import or raises is a ``PluginError`` (deadpool_hpc/plugins.py) naming the plugin: the
launchers check the imports before anything starts (``check_plugins``), and an agent whose factory raises ends
the run at start-up. A ``check`` that raises later is logged (``detector_error``, once per distinct message) and
does not disturb the run.

Built in: ``swap-request`` (``SwapRequestFile``), the file ``RUN_DIR/swap/NODE.json`` that ``deadpool swap``
writes (NODE: the Slurm node name under Slurm, else ``node<index>``).
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass

from ..plugins import PluginError, entry_points, load, names

GROUP = "deadpool_hpc.detectors"
SWAP_DIR = "swap"  # RUN_DIR/swap/NODE.json: planned-swap requests (deadpool swap)


@dataclass(frozen=True)
class NodeInfo:
    """What a detector factory learns about the node its agent runs on.

    node: the agent's index (its MPI rank; node ``node<index>`` of ``--kill``/``--hang``); hostname: this host's
    name; slurm_node: Slurm's name for the node (``SLURMD_NODENAME``), None outside Slurm; slurm_job_id: None
    outside Slurm; run_dir: the run directory (absolute)."""
    node: int
    hostname: str
    slurm_node: str | None
    slurm_job_id: str | None
    run_dir: str

    @property
    def name(self) -> str:
        """The node's name for operators: Slurm's, else ``node<index>``."""
        return self.slurm_node or f"node{self.node}"


@dataclass(frozen=True)
class Unhealthy:
    """A detector's verdict: this node should be swapped out at the next step boundary. ``reason``: free text for
    the event log and the summary (e.g. Slurm's drain reason)."""
    reason: str


@dataclass(frozen=True)
class Slow:
    """A detector's figure: this node runs ``factor`` (> 1) times slower than it should; ``reason``: free text for the
    ``straggler_detected`` event. Counts for ``3 x interval_s`` seconds after the check that said it (a detector that
    stops saying so is believed)."""
    factor: float
    reason: str


def installed() -> list[str]:
    """Names of the detector entry points installed in this environment."""
    return names(GROUP)


def check_plugins() -> list[str]:
    """Import every installed detector plugin (launchers call this before starting anything). Returns their
    names. Raises PluginError naming the first that fails to import."""
    return [ep.name for ep in entry_points(GROUP) if load(ep, "detector") is not None]


def load_detectors(node: NodeInfo) -> list[tuple[str, object]]:
    """Build every installed detector that applies to ``node``: ``[(name, detector)]``. Raises PluginError if a
    factory fails to import, raises, or returns an object without ``check()`` and a positive ``interval_s``."""
    out = []
    for ep in entry_points(GROUP):
        factory = load(ep, "detector")
        try:
            det = factory(node)
        except Exception as exc:  # noqa: BLE001
            raise PluginError(f"detector plugin {ep.name!r} ({ep.value}) raised at start-up on {node.name}: "
                              f"{type(exc).__name__}: {exc}") from exc
        if det is None:
            continue
        interval = getattr(det, "interval_s", None)
        if not callable(getattr(det, "check", None)) or not isinstance(interval, (int, float)) or interval <= 0:
            raise PluginError(f"detector plugin {ep.name!r} ({ep.value}) returned {det!r}: a detector needs a "
                              f"check() method and interval_s > 0 (seconds); got interval_s={interval!r}")
        out.append((ep.name, det))
    return out


# ---- built-in: the operator's request file --------------------------------------------------------------------
def request_path(run_dir: str, node_name: str) -> str:
    return os.path.join(run_dir, SWAP_DIR, f"{node_name}.json")


def write_request(run_dir: str, node_name: str, reason: str) -> str:
    """Ask the agent of ``node_name`` to retire its node at the next step boundary (``deadpool swap``). The file
    is written under a temporary name and renamed, so an agent never reads half of it. Returns its path."""
    path = request_path(run_dir, node_name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump({"node": node_name, "reason": reason, "t": time.time()}, fh)
    os.replace(tmp, path)
    return path


class SwapRequestFile:
    """Detector ``swap-request``: RUN_DIR/swap/NODE.json exists (``deadpool swap``). Checked every 0.5 s: one
    stat() of a file in the run directory."""
    interval_s = 0.5

    def __init__(self, node: NodeInfo):
        self.path = request_path(node.run_dir, node.name)

    def check(self) -> Unhealthy | None:
        try:
            with open(self.path) as fh:
                body = json.load(fh)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            return Unhealthy(f"operator request ({self.path}, unreadable: {exc})")
        return Unhealthy(f"operator request: {body.get('reason') or 'deadpool swap'}")

    def consumed(self) -> None:
        """The agent acted on the request: remove it (a requeued attempt must not swap the node again)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def swap_request_detector(node: NodeInfo) -> SwapRequestFile:
    """Factory of the built-in ``swap-request`` detector (entry point in pyproject.toml)."""
    return SwapRequestFile(node)


# ---- the agent's health thread ----------------------------------------------------------------------------------
class DetectorRunner:
    """Runs the detectors of one node on a daemon thread, each every ``interval_s`` seconds; a verdict is queued
    for the agent's main loop (``pending``) and ``wake`` is called so the loop sees it at once. A detector that
    reported is not asked again until the agent has acted on its verdict (``consumed``: the node left, or the swap
    was refused and the detector may report again); one whose ``check`` raises is logged and asked again later. A
    ``Slow`` figure is kept for the straggler check (``slowness``), not queued, and the detector is asked again."""

    def __init__(self, detectors: list[tuple[str, object]], log, wake=lambda: None):
        self.detectors = dict(detectors)
        self.log = log
        self.wake = wake
        self._queue: list[tuple[str, Unhealthy]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._errors: dict[str, str] = {}
        self._active = dict(self.detectors)   # name -> detector still asked
        self._due = {name: time.monotonic() for name in self.detectors}
        self._slow: dict[str, tuple[float, str, float]] = {}   # name -> (factor, reason, until) of its last Slow
        self._thread = threading.Thread(target=self._run, name="health", daemon=True)

    def start(self) -> DetectorRunner:
        if self.detectors:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def pending(self) -> list[tuple[str, Unhealthy]]:
        with self._lock:
            out, self._queue = self._queue, []
        return out

    def slowness(self, now: float | None = None) -> tuple[float, str] | None:
        """The largest ``Slow`` figure a detector gave that still counts: (factor, "name: reason"), or None."""
        now = time.monotonic() if now is None else now
        with self._lock:
            live = [(f, f"{name}: {why}") for name, (f, why, until) in self._slow.items() if until > now]
        return max(live) if live else None

    def consumed(self, name: str) -> None:
        """The agent acted on ``name``'s verdict: tell the detector (optional ``consumed()``; an error there is
        logged, never raised) and ask it again from its next interval on."""
        det = self.detectors.get(name)
        if det is None:
            return
        try:
            if callable(getattr(det, "consumed", None)):
                det.consumed()
        except Exception as exc:  # noqa: BLE001 - a plugin's bug must not end the run
            self._error(name, f"consumed(): {type(exc).__name__}: {exc}")
        with self._lock:
            self._active[name] = det
            self._due[name] = time.monotonic() + float(det.interval_s)

    def _error(self, name: str, msg: str) -> None:
        if self._errors.get(name) != msg:
            self._errors[name] = msg
            self.log.emit("detector_error", detector=name, error=msg[:300])

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                name = min(self._active, key=lambda n: self._due[n]) if self._active else None
                wait = max(0.0, self._due[name] - time.monotonic()) if name else 0.5
            if self._stop.wait(min(wait, 0.5)) or name is None or self._due[name] > time.monotonic():
                continue
            det = self.detectors[name]
            with self._lock:
                self._due[name] = time.monotonic() + float(det.interval_s)
            try:
                verdict = det.check()
            except Exception as exc:  # noqa: BLE001 - a plugin's bug must not end the run
                self._error(name, f"{type(exc).__name__}: {exc}")
                continue
            if isinstance(verdict, Slow):
                try:
                    factor = float(verdict.factor)
                except (TypeError, ValueError):
                    factor = float("nan")
                if not factor > 1 or factor == float("inf"):
                    self._error(name, f"Slow(factor={verdict.factor!r}): accepted: a finite number > 1")
                    continue
                with self._lock:
                    self._slow[name] = (factor, str(verdict.reason)[:200], time.monotonic() + 3 * float(det.interval_s))
            elif verdict is not None:
                with self._lock:
                    self._active.pop(name, None)
                    self._queue.append((name, verdict))
                self.wake()
