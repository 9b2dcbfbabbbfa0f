"""The NCCL path's collective watchdog (dataplane/watchdog.py), pure logic: works that never complete, works that
fail, the failure flag and the collective timeout, on a fake clock; and the choice of waiter by backend."""
import threading
import time

import pytest
import torch

from deadpool_hpc.dataplane import collectives
from deadpool_hpc.dataplane.watchdog import CollectiveWatchdog, waiter_for
from deadpool_hpc.errors import PeerFailure


class Work:
    """A fake async work: never completes unless told to; may end with an error."""

    def __init__(self):
        self.done = False
        self.error = None
        self.waited = 0

    def is_completed(self):
        return self.done

    def exception(self):
        return self.error

    def wait(self):
        self.waited += 1   # NCCL: a stream wait, returns at once


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def dog(timeout=10.0, gen=None):
    failure, aborted, clock = threading.Event(), [], Clock()
    gen = gen or [0]
    d = CollectiveWatchdog(failure, timeout, lambda: aborted.append(gen[0]), lambda: gen[0], clock=clock, start=False)
    return d, failure, aborted, clock, gen


def test_a_work_that_never_completes_is_aborted_at_the_timeout_once():
    d, failure, aborted, clock, _ = dog(timeout=10.0)
    d.track(Work())
    clock.t += 9.9
    assert d.scan() is None and aborted == []
    clock.t += 0.2
    assert "did not complete within 10 s" in d.scan()
    assert aborted == [0] and failure.is_set() and d.outstanding() == 0
    with pytest.raises(PeerFailure, match="aborted generation 0's communicators"):
        d.track(Work())
    assert d.scan() is None and aborted == [0]   # once per generation


def test_the_failure_flag_with_outstanding_works_aborts_them_all_together():
    d, failure, aborted, clock, _ = dog()
    works = [Work(), Work(), Work()]
    for w in works:
        d.track(w)
    works[0].done = True
    assert d.scan() is None and d.outstanding() == 2
    failure.set()
    assert d.scan() == "a peer failed while collectives were outstanding"
    assert aborted == [0] and d.outstanding() == 0


def test_the_failure_flag_without_outstanding_works_aborts_nothing():
    d, failure, aborted, clock, _ = dog()
    w = Work()
    d.track(w)
    w.done = True
    failure.set()
    assert d.scan() is None and aborted == []
    with pytest.raises(PeerFailure, match="a peer failed"):
        d.check()


def test_a_failed_work_aborts_the_others_still_waiting():
    d, failure, aborted, clock, _ = dog()
    bad, stuck = Work(), Work()
    d.track(bad)
    d.track(stuck)
    bad.done, bad.error = True, RuntimeError("NCCL error: remote process exited\nmore")
    assert d.scan() == "a collective failed: NCCL error: remote process exited"
    assert aborted == [0]


def test_completed_works_keep_nothing_outstanding_and_never_abort():
    d, failure, aborted, clock, _ = dog(timeout=1.0)
    for _ in range(100):
        w = Work()
        d.track(w)
        w.done = True
    clock.t += 5
    assert d.scan() is None and d.outstanding() == 0 and aborted == []


def test_a_new_generation_starts_clean():
    d, failure, aborted, clock, gen = dog(timeout=1.0)
    d.track(Work())
    clock.t += 2
    assert d.scan() is not None and aborted == [0]
    gen[0] = 1
    failure.clear()   # the recovery clears the flag
    d.track(Work())   # the new generation's works are tracked again
    d.check()
    clock.t += 0.5
    assert d.scan() is None
    clock.t += 1
    assert d.scan() is not None and aborted == [0, 1]


def test_a_work_of_an_abandoned_generation_is_forgotten():
    d, failure, aborted, clock, gen = dog(timeout=1.0)
    d.track(Work())
    gen[0] = 1
    clock.t += 5
    assert d.scan() is None and aborted == [] and d.outstanding() == 0


def test_the_thread_aborts_a_stuck_collective_within_the_real_timeout():
    failure, aborted = threading.Event(), []
    d = CollectiveWatchdog(failure, 0.2, lambda: aborted.append(time.monotonic()), poll=0.01)
    try:
        watch = collectives.Watch(failure, timeout=0.2, waiter=d)
        w = Work()
        t0 = time.monotonic()
        collectives.wait(w, watch)   # NCCL: returns at once, the stream ordered after the work
        assert time.monotonic() - t0 < 0.1 and w.waited == 1
        deadline = time.monotonic() + 5
        while not aborted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert aborted and 0.15 < aborted[0] - t0 < 2.0
        with pytest.raises(PeerFailure):
            collectives.wait(Work(), watch)
    finally:
        d.close()


def test_bad_settings_and_backends_are_named():
    with pytest.raises(ValueError, match=r"timeout 0 s.*accepted: both > 0"):
        CollectiveWatchdog(threading.Event(), 0, lambda: None, start=False)
    with pytest.raises(ValueError, match=r"backend 'mpi'.*accepted: nccl, gloo"):
        waiter_for("mpi", threading.Event(), 1.0, lambda: None, lambda: 0)


def test_gloo_keeps_the_polled_wait():
    assert waiter_for("gloo", threading.Event(), 1.0, lambda: None, lambda: 0) is None
    d = waiter_for("nccl", threading.Event(), 1.0, lambda: None, lambda: 0)
    try:
        assert isinstance(d, CollectiveWatchdog)
    finally:
        d.close()
    # the polled path is today's: a work that never completes under gloo times out on the training thread
    watch = collectives.Watch(threading.Event(), timeout=0.05)
    with pytest.raises(PeerFailure, match="did not complete within 0 s"):
        collectives.wait(Work(), watch)
    assert watch.waited >= 0.05


def test_abort_all_aborts_the_generations_nccl_groups_inside_one_group_call_once(monkeypatch):
    """GenerationGroups.abort_all with fake NCCL backends (no GPU here): start, every abort, end; once a generation;
    gloo has nothing to abort."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from deadpool_hpc.dataplane.groups import GenerationGroups

    calls = []

    class Backend:
        def __init__(self, name):
            self.name = name

        def _group_start(self):
            calls.append("start")

        def _group_end(self):
            calls.append("end")

        def abort(self):
            calls.append(self.name)
            if self.name == "sub2":
                raise RuntimeError("already aborted")

    class PG:
        def __init__(self, name):
            self.b = Backend(name)

        def _get_backend(self, device):
            assert device.type == "cuda"
            return self.b

    default = PG("default")
    monkeypatch.setattr(c10d, "_get_default_group", lambda: default)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    g = GenerationGroups("nccl")
    g.generation = 4
    g._sub = {(0, 1): PG("sub1"), (2, 3): PG("sub2"), (0, 1, 2, 3): default}
    assert g.abort_all() is True
    assert calls == ["start", "default", "sub1", "sub2", "end"]
    assert g.abort_all() is False and len(calls) == 5   # once per generation
    g.generation = 5
    assert g.abort_all() is True and calls[-1] == "end" and len(calls) == 10
    assert GenerationGroups("gloo").abort_all() is False
