"""The batch host's keeper and its stand-in (launch/keeper.py) without Slurm: who stands in for a dead batch host,
when, and that it acts once. The real thing: tests/slurm/test_slurm_companion.py (the batch host crashed first)."""
from __future__ import annotations

import os

from deadpool_hpc.events import read_events
from deadpool_hpc.launch import keeper
from deadpool_hpc.rundir import RunDir


def _hello(rank: int, host: str, t: float = 1.0) -> dict:
    return {"event": "hello", "t": t, "mpi_rank": rank, "role": "agent", "host": host}


def _decision(t: float, *failed: int) -> dict:
    return {"event": "decision", "t": t, "generation": 1, "failed_nodes": list(failed)}


EVENTS = [_hello(0, "nodeA"), _hello(1, "nodeB"), _hello(2, "nodeC"), _hello(3, "nodeD")]


def test_the_stand_in_is_the_lowest_task_neither_declared_dead_nor_exited():
    ev = EVENTS + [_decision(5.0, 0), _decision(9.0, 2)]
    assert keeper.dead_tasks(ev, since=0.0) == {0, 2}
    assert keeper.dead_tasks(ev, since=6.0) == {2}                 # an earlier attempt's decision does not count
    assert keeper.stand_in(4, {0, 2}, exited=set()) == 1
    assert keeper.stand_in(4, {0, 2}, exited={1}) == 3
    assert keeper.stand_in(2, {0}, exited={1}) is None
    assert keeper.batch_host_declared_dead(ev, 0.0, "nodeA") and keeper.batch_host_declared_dead(ev, 0.0, "nodeC")
    assert not keeper.batch_host_declared_dead(ev, 0.0, "nodeB") and not keeper.batch_host_declared_dead(ev, 6.0,
                                                                                                          "nodeA")
    assert not keeper.batch_host_declared_dead(ev, 0.0, None)
    moved = ev + [_hello(0, "nodeE", t=7.0), _decision(8.0, 0)]    # slot 0 retaken elsewhere, then lost again
    assert not keeper.batch_host_declared_dead(moved, 6.0, "nodeA")


def _run_dir(tmp_path, batch_host="nodeA"):
    (tmp_path / keeper.ALIVE_FILE).write_text(f"{batch_host}\n")
    return str(tmp_path)


def _stand_ins(run_dir):
    path = RunDir(run_dir).events
    return [e for e in read_events(path) if e["event"] == "keeper_stand_in"] if os.path.exists(path) else []


def test_a_decision_that_declares_the_batch_host_dead_makes_the_lowest_live_task_its_keeper(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAIN_FAILED", "0")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)   # no Slurm job: no companion jobs to look after
    run_dir = _run_dir(tmp_path)
    ins = {t: keeper.StandIn(run_dir, t, 4, exited=set, t_start=0.0) for t in range(4)}
    quiet = keeper.QUIET_S + 1
    for s in ins.values():
        s.step(EVENTS, quiet)
    assert not _stand_ins(run_dir) and all(s.keeper is None for s in ins.values())   # no decision, not stale yet
    ev = EVENTS + [_decision(5.0, 0)]
    for s in ins.values():
        s.step(ev, quiet=1.0)   # the file still moves now and then (node 0 declared dead, the batch host alive)
    assert not _stand_ins(run_dir)
    for s in ins.values():
        s.step(ev, quiet)
    took = _stand_ins(run_dir)
    assert [e["task"] for e in took] == [1] and ins[1].keeper is not None, took
    assert took[0]["batch_host"] == "nodeA" and "declared the batch host dead" in took[0]["why"]
    ins[1].step(ev, quiet)
    assert len(_stand_ins(run_dir)) == 1                    # once: it keeps the role
    ev += [_decision(9.0, 1)]                               # the stand-in's own node declared dead: the next task
    for s in ins.values():
        s.step(ev, quiet)
    assert [e["task"] for e in _stand_ins(run_dir)] == [1, 2]
    assert ins[1].keeper is None and ins[2].keeper is not None   # one keeper at a time
    ended = [e for e in read_events(RunDir(run_dir).events) if e["event"] == "keeper_stand_in_ended"]
    assert [(e["task"], e["why"]) for e in ended] == [(1, "another task is the stand-in now")], ended
    ev += [{"event": "finished", "t": 12.0}]
    ins[2].step(ev, quiet=keeper.ALIVE_STALE_S)
    assert ins[2].keeper is None                            # the run is over: nothing to keep


def test_batch_alive_untouched_makes_a_stand_in_without_any_decision(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAIN_FAILED", "0")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    run_dir = _run_dir(tmp_path)
    s0 = keeper.StandIn(run_dir, 0, 2, exited=lambda: set(), t_start=0.0)
    s0.step(EVENTS, quiet=keeper.ALIVE_STALE_S)
    assert [(e["task"], e["why"]) for e in _stand_ins(run_dir)] == [(0, "batch.alive untouched for 10 s")]


def test_a_stand_in_thread_stands_down_when_the_batch_host_touches_its_file_again(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAIN_FAILED", "0")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr(keeper, "QUIET_S", 0.05)
    run_dir = _run_dir(tmp_path)
    s = keeper.StandIn(run_dir, 0, 1, exited=set, t_start=0.0, period=0.02, stale_s=0.1)
    s.start()
    try:
        for _ in range(200):
            if s.keeper is not None:
                break
            s.stop.wait(0.02)
        assert s.keeper is not None and _stand_ins(run_dir)[0]["task"] == 0
        os.utime(os.path.join(run_dir, keeper.ALIVE_FILE), ns=(1, 1))   # the batch host's keeper is back
        for _ in range(200):
            if s.keeper is None:
                break
            s.stop.wait(0.02)
        assert s.keeper is None
    finally:
        s.stop.set()
        s.join(5)
    assert not s.is_alive()
