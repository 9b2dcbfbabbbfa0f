"""Shared by the tests that launch local runs: launch one, then check that none of its processes outlived it
and that it left no MPI shared-memory segment in /dev/shm (which is memory)."""
import glob
import os
import shutil
import threading
import warnings

from deadpool_hpc.config import RunConfig
from deadpool_hpc.faultinject.spec import parse_fault
from deadpool_hpc.process.fence import is_alive
from deadpool_hpc.events import read_events
from deadpool_hpc.launch import LocalExecutor


def faults(*specs: str) -> list:
    """Faults from "kind target@when" strings, e.g. "kill node1@10", "hang rank2@40"."""
    return [parse_fault(kind, spec) for kind, spec in (s.split(" ") for s in specs)]


def _mpi_segments() -> set[str]:
    return set(glob.glob("/dev/shm/mpich_shm_*"))


def _mapped_anywhere() -> set[str]:
    """Paths under /dev/shm that some live process maps (another job's segments are not ours to judge)."""
    out = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                out.update(line.split()[-1] for line in f if "/dev/shm/" in line)
        except OSError:
            pass
    return out


def launch_reaped(cfg: RunConfig, timeout: float) -> dict:
    """``LocalExecutor(timeout=timeout).run(cfg)``; whatever happened, no process that said hello in the run may be
    left alive, and no MPICH segment may be left in /dev/shm by it (control/mpi.py:unlink_mpi_shm)."""
    before = _mpi_segments()
    summary = LocalExecutor(timeout=timeout).run(cfg)
    for e in read_events(os.path.join(cfg.output.run_dir, "events.jsonl")):
        if e["event"] == "hello":
            assert not is_alive(e), f"pid {e['pid']} ({e.get('role')}) outlived the run"
    left = _mpi_segments() - before - _mapped_anywhere()
    assert not left, f"the run left MPI shared-memory segments in /dev/shm: {sorted(left)}"
    return summary


SMALL_RUN_STEPS = 24   # the fault tests' runs (test_never_hang, test_startup) and their shared baseline
EXAMPLE_STEPS = 44     # the examples' runs (test_your_loop: examples/ddp_gpt.py; test_fsdp2: examples/fsdp2_gpt.py, ...)


def run_example(tmp_path, name, *specs, timeout=240, **kw) -> dict:
    """A run of an example (``kw`` names ``nodes``, ``train_fn`` and ``train_args``, and any RunConfig field on top)
    of EXAMPLE_STEPS steps with one spare in ``tmp_path/name``, with ``specs`` ("kill node1@30", "hang rank2@40");
    launched with ``launch_reaped``."""
    cfg = RunConfig(**{**dict(spares=1, steps=EXAMPLE_STEPS, run_dir=str(tmp_path / name), faults=faults(*specs),
                              rendezvous_timeout=4.0, hang_timeout=3.0), **kw}).validate()
    return launch_reaped(cfg, timeout)


def example_digest(failure_free, **settings) -> str:
    """The parameter digest of an example's failure-free run of EXAMPLE_STEPS steps (``failure_free``: the session's
    shared baselines, tests/conftest.py) with ``settings``; fails if the example's loss does not drop by 20 %."""
    s = failure_free(steps=EXAMPLE_STEPS, **settings)
    assert s["final_loss"] < 0.8 * s["first_loss"], "the example does not train"
    return s["param_digest"]


def check_recovered(s, digest, targets, failed_nodes):
    """Each fault of the example run ``s`` (in order: ``targets``, whose nodes are ``failed_nodes``) hot-swapped with
    at most one step recomputed, and the parameters bitwise the failure-free run's (``digest``)."""
    assert s["completed"] and s["errors"] == [], s
    assert s["steps_completed"] == EXAMPLE_STEPS
    assert [f["target"] for f in s["failures"]] == targets, s["failures"]
    for f, nodes in zip(s["failures"], failed_nodes):
        assert f["outcome"] == "hot swap" and f["failed_nodes"] == nodes, f
        assert f["recomputed_steps"] <= 1, f
    assert s["param_digest"] == digest, "recovered run diverged from the failure-free run"


# Hydra (MPICH's mpiexec: the local launcher's process manager, not Slurm's) ends the whole job when one of its
# proxies cannot write a PMI answer to a process that was just SIGKILLed (../shared/notes/ft-probes.md: mpiexec is a
# single point of failure of the one-machine emulation; srun has no such proxy). Seen in 2 of about 8 clean-clone CI
# runs, both in test_second_failure_at_each_recovery_phase[agree]: a node killed while its MPI library asked PMI
# for the failed processes. Such a run, and only such a run, is started once more, with a warning.
HYDRA_COLLAPSE = "unable to forward PMI response to MPI process"


def hydra_collapsed(s: dict, run_dir) -> bool:
    """Whether hydra ended the run ``s`` of ``run_dir`` (HYDRA_COLLAPSE), rather than the run itself."""
    log = os.path.join(str(run_dir), "launcher.log")
    return not s.get("completed") and os.path.exists(log) and HYDRA_COLLAPSE in open(log, errors="replace").read()


def _collapse_warning(name: str) -> None:
    warnings.warn(f"run {name!r}: a hydra proxy could not write a PMI answer to a killed process and mpiexec ended "
                  f"the job (the local emulation's process manager); started once more")


def run_faults(tmp_path, name, *specs, timeout=240, again=True, **kw) -> dict:
    """A 3 + 2 node demo run of SMALL_RUN_STEPS steps in ``tmp_path/name`` with ``specs`` ("kill node1@10", ...) and
    ``kw`` (RunConfig fields) on top, launched with ``launch_reaped`` (``again``: once more if hydra ended it,
    HYDRA_COLLAPSE)."""
    cfg = RunConfig(**{**dict(nodes=3, spares=2, steps=SMALL_RUN_STEPS, run_dir=str(tmp_path / name),
                              faults=faults(*specs), rendezvous_timeout=4.0), **kw}).validate()
    s = launch_reaped(cfg, timeout)
    if again and hydra_collapsed(s, cfg.output.run_dir):
        _collapse_warning(name)
        shutil.rmtree(cfg.output.run_dir)
        s = launch_reaped(cfg, timeout)
    return s


def run_driven(tmp_path, name, drive, *specs, join_s=240, **kw):
    """``run_faults`` in a thread while ``drive(run_dir, thread)``, in the caller's thread, acts on the run from
    outside (real signals to its processes) and returns what the test needs to know of it; returns (the summary, or
    None if the launch raised; what ``drive`` returned). A run hydra ended is started *and driven* once more
    (run_faults' own second start would run without the outside faults: seen, a run that lost two nodes' state
    completed). Fails the test if the run outlives ``join_s`` seconds after ``drive`` returned."""
    run_dir = tmp_path / name
    for attempt in (1, 2):
        out: dict = {}
        th = threading.Thread(target=lambda: out.update(s=run_faults(tmp_path, name, *specs, again=False, **kw)),
                              daemon=True)
        th.start()
        got = drive(run_dir, th)
        th.join(join_s)
        assert not th.is_alive(), f"run {name!r} did not end within {join_s} s of what the test did to it"
        s = out.get("s")
        if attempt == 1 and s is not None and hydra_collapsed(s, run_dir):
            _collapse_warning(name)
            shutil.rmtree(run_dir)
            continue
        return s, got


def run_events(run_dir) -> list[dict]:
    return list(read_events(os.path.join(str(run_dir), "events.jsonl")))
