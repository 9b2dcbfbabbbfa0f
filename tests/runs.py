"""Shared by the tests that launch local runs: launch one, then check that none of its processes outlived it."""
import os

from deadpool_hpc.config import RunConfig, parse_fault
from deadpool_hpc.control.fence import is_alive
from deadpool_hpc.events import read_events
from deadpool_hpc.launch.local import launch


def faults(*specs: str) -> list:
    """Faults from "kind target@when" strings, e.g. "kill node1@10", "hang rank2@40"."""
    return [parse_fault(kind, spec) for kind, spec in (s.split(" ") for s in specs)]


def launch_reaped(cfg: RunConfig, timeout: float) -> dict:
    """``launch(cfg)``; whatever happened, no process that said hello in the run may be left alive."""
    summary = launch(cfg, timeout=timeout)
    for e in read_events(os.path.join(cfg.run_dir, "events.jsonl")):
        if e["event"] == "hello":
            assert not is_alive(e), f"pid {e['pid']} ({e.get('role')}) outlived the run"
    return summary
