"""Shared by every test module: the failure-free baselines, one run per set of settings for the whole session.

A recovered run is checked against the run that never failed with the same arithmetic: the same layout (nodes x
ranks per node), steps, training function, its arguments and the seed. Those runs were once launched by each
module (and some tests) for itself, up to three times for the same settings; ``failure_free(**settings)`` launches
each set once per session and hands every caller the same summary (issue 24).

The settings that cannot change the parameters are not part of the key, and the baseline runs without them: spares
(a spare trains nothing until it is promoted), faults, timeouts, the replica count and transport, requeueing and the
log interval. The examples (``examples.*``) and the test training functions (``trainfns:*``) are importable by the
runs' processes: this folder and the checkout are put on PYTHONPATH for every local test and every baseline
(not for the Slurm tests' jobs, which find the package the way a user's job does).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading

import pytest

from deadpool_hpc.config import RunConfig

import fasttier  # tests/fasttier.py: the fast tier's guard (pytest_runtest_protocol below)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# RunConfig fields that do not change a run's parameters: a baseline is keyed and launched without them
NOT_IN_KEY = frozenset({"spares", "faults", "hang_timeout", "rendezvous_timeout", "startup_timeout",
                        "collective_timeout", "heartbeat_deadline", "heartbeat_ceiling", "replicas", "replica_transport", "requeue",
                        "log_every", "run_dir", "summary_path", "replicate", "heartbeat_period",
                        "max_requeues", "interleave_replication", "persist_every", "health_check", "fork_server",
                        "metrics_port", "metrics_textfile", "crash_loop_limit"})
# training functions whose arithmetic is the demo's (trainfns.py: they only sleep or freeze one rank once)
SAME_AS_DEMO = {"trainfns:paced": "deadpool_hpc.train.demo:train", "trainfns:frozen_rank2": "deadpool_hpc.train.demo:train",
                "trainfns:why_it_failed": "deadpool_hpc.train.demo:train",
                "trainfns_startup:train": "deadpool_hpc.train.demo:train"}



def pytest_sessionstart(session):
    """Fills, before any test and outside the fast tier's guard, a cache that a library fills by starting a process
    the first time it is used: matplotlib's font list (``fc-list``, when ~/.cache/matplotlib has none). Without it
    the first in-process test that draws (project/test_scale_study.py) fails on a machine that never drew."""
    try:
        import matplotlib.font_manager  # noqa: F401
    except ImportError:
        pass


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The fast tier (``-m "not e2e"``) starts no process: while a test without the ``e2e`` marker is set up, runs
    and is torn down (module and session fixtures it is the first to ask for included), every way of starting a
    process raises an error naming the test (tests/fasttier.py, tests/README.md)."""
    if item.get_closest_marker("e2e") is not None:
        return (yield)
    with fasttier.refused_while(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """An unmarked test that caught the refusal (``pytest.raises(Exception)``, a retry loop) fails all the same."""
    result = yield
    msg = fasttier.refusal(item)
    if msg:
        pytest.fail(msg, pytrace=False)
    return result


def _with_test_code(pythonpath: str | None) -> str:
    """PYTHONPATH with the checkout (``examples``) and this folder (``trainfns``) in front."""
    return os.pathsep.join([ROOT, HERE] + ([pythonpath] if pythonpath else []))


@pytest.fixture(autouse=True)
def importable_test_code(request, monkeypatch):
    """The runs a local test launches import ``examples.*`` and ``trainfns:*``. Not for the Slurm tests: a job
    inherits the submitter's environment (``--export=ALL``), and they check how a job finds the package itself."""
    if os.sep + "slurm" + os.sep not in str(request.node.path):
        monkeypatch.setenv("PYTHONPATH", _with_test_code(os.environ.get("PYTHONPATH")))


@pytest.fixture
def local_group():
    """A default process group of this process alone (gloo over a HashStore: no process, no socket), destroyed after
    the test: what the worker context installs for DDP and FSDP2 before ``run``."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def baseline_settings(**settings) -> dict:
    """The settings of a failure-free run that decide its parameters (a default named or not: the same run)."""
    bad = set(settings) - {ff.name for ff in RunConfig.flat_fields()}
    if bad:
        raise TypeError(f"not RunConfig fields: {sorted(bad)}")
    kw = {k: v for k, v in settings.items() if k not in NOT_IN_KEY}
    if "train_fn" in kw:
        kw["train_fn"] = SAME_AS_DEMO.get(kw["train_fn"], kw["train_fn"])
    defaults = RunConfig()
    return {k: v for k, v in kw.items() if v != getattr(defaults, k)}


def baseline_key(**settings) -> tuple:
    """``baseline_settings`` as a hashable key."""
    return tuple(sorted((k, repr(v)) for k, v in baseline_settings(**settings).items()))


# local test files that run in the Slurm tests' worker, after them, to balance the two halves: they mostly wait
# (heartbeat deadlines, socket timeouts). Measured side by side (ci21): Slurm half 785 s, local half 851 s; these two
# files took 45 s of the local half.
WITH_THE_SLURM_HALF = ("tests/unit/agent/test_channel.py", "tests/e2e/test_control_plane_scale.py")


def _half(nodeid: str) -> str:
    """The half a test runs in: ``slurm`` for tests/slurm and WITH_THE_SLURM_HALF, ``local`` for every other test."""
    path = nodeid.split("::")[0]
    return "slurm" if "/slurm/" in "/" + path or path in WITH_THE_SLURM_HALF else "local"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Two halves that run side by side under ``-n 2 --dist loadgroup`` (pyproject's addopts, issue 24): the Slurm
    tests, one after the other in one worker (they share one cluster, and each test cleans its queue), and every
    other test, in order, in the other worker. Each half spends about 40 % of its time waiting (Slurm's requeue
    and node timers, heartbeat deadlines), which the other half's work fills. xdist's own ``loadgroup`` reads an
    ``xdist_group`` marker by renaming the test's nodeid, which pytest 9 no longer allows; its scope scheduler
    with the two halves as the scopes does the same."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScheduling, LoadScopeScheduling

    if " ".join(config.getoption("markexpr", "").split()) == "not e2e":
        return LoadScheduling(config, log)  # the fast tier: in-process tests only (no cluster, no runs), any order

    class Halves(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _half(nodeid)

    return Halves(config, log)


def _shared_dir(tmp_path_factory) -> str:
    """A folder every xdist worker of this session sees (the workers' base temp folders share a parent); the
    session's own base temp without xdist."""
    base = tmp_path_factory.getbasetemp()
    d = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "baselines"
    d.mkdir(exist_ok=True)
    return str(d)


@pytest.fixture(scope="session")
def failure_free(tmp_path_factory):
    """``failure_free(**settings) -> summary`` of the failure-free run with those RunConfig settings (no spare,
    no fault), launched the first time a key is asked for and shared for the rest of the session, by every xdist
    worker too: the first worker that asks launches it under a file lock (fcntl) and writes its summary beside the
    run; a worker that asks later waits on the lock and reads it. The run must complete with no failure and no
    error (asserted here, once)."""
    from runs import launch_reaped  # tests/runs.py

    done: dict[tuple, dict] = {}
    lock = threading.Lock()
    shared = _shared_dir(tmp_path_factory)

    def get(**settings) -> dict:
        key = baseline_key(**settings)
        with lock:
            if key not in done:
                name = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
                run_dir = os.path.join(shared, name, "run")
                summary = os.path.join(shared, name, "summary.json")
                os.makedirs(os.path.dirname(run_dir), exist_ok=True)
                with open(os.path.join(shared, name + ".lock"), "w") as lk:
                    fcntl.flock(lk, fcntl.LOCK_EX)
                    if os.path.exists(summary):
                        with open(summary) as fh:
                            done[key] = json.load(fh)
                    else:
                        kw = baseline_settings(**settings)
                        mp = pytest.MonkeyPatch()
                        mp.setenv("PYTHONPATH", _with_test_code(os.environ.get("PYTHONPATH")))
                        try:
                            s = launch_reaped(RunConfig(**kw, spares=0, run_dir=run_dir).validate(), 300)
                        finally:
                            mp.undo()
                        assert s["completed"] and s["failures"] == [] and s["errors"] == [], s
                        s["run_dir"] = run_dir
                        with open(summary + ".tmp", "w") as fh:
                            json.dump(s, fh)
                        os.replace(summary + ".tmp", summary)  # never read half-written
                        done[key] = s
            return done[key]

    return get
