"""worker/recovery.py's ``Recovery`` built and used alone (no ``Context``): the agent's ``Failure`` notice read as a
typed message, answered at once while the process waits for its role, and the roles a spare follows. The agent's
channel is a recorder whose ``get`` hands out the roles (pure logic, no process)."""
from __future__ import annotations

import threading
import types

import pytest

from deadpool_hpc.config import RunConfig
from deadpool_hpc.ipc.messages import Exit, Failure, Left, Role, Spare, View


def recovery(roles=(), during_wait=None):
    """A Recovery over a recording channel: ``get`` first calls ``during_wait(rec)`` (what arrives while the process
    waits), then hands out the next of ``roles``."""
    from deadpool_hpc.worker.recovery import Recovery

    sent, woken, events, failure = [], [], [], threading.Event()
    pending = list(roles)

    def get(kind, timeout):
        assert kind == Role.KIND
        if during_wait is not None:
            during_wait(rec)
        return pending.pop(0).to_wire()

    client = types.SimpleNamespace(send=lambda *a: sent.append(a), wake=lambda: woken.append(1), get=get,
                                   lost=threading.Event())
    log = types.SimpleNamespace(emit=lambda kind, **kw: events.append(kind))
    rec = Recovery(RunConfig(nodes=2, spares=1, steps=4), client, groups=None, log=log, faults=None,
                   steps=types.SimpleNamespace(step=0), failure=failure, watch=None, node=2,
                   first_rank=None, mesh_groups=[])
    return rec, sent, woken, events, failure


def test_a_failure_notice_sets_the_flag_of_a_training_process_and_a_malformed_one_is_refused():
    rec, sent, woken, _, failure = recovery()
    rec.on_failure(Failure(2).to_wire())
    assert failure.is_set() and woken == [1] and sent == []
    with pytest.raises(ValueError, match="generation"):
        rec.on_failure({})


def test_a_spare_waiting_for_its_role_answers_a_failure_notice_with_its_left_and_follows_an_exit():
    spare = Spare(View(1, (0, 1), (2,)))
    rec, sent, _, events, failure = recovery(
        roles=[Exit(75)], during_wait=lambda r: r.on_failure(Failure(1).to_wire()))
    assert (rec.rank, rec.generation) == (None, 0)
    assert rec.follow(spare) is False   # the spare's wait ends with the Exit
    assert rec.role == spare and rec.generation == 1 and rec.exit_code == 75 and events == ["spare_ready"]
    assert sent == [(Left.KIND, Left(1, -1, "spare").to_wire())] and not failure.is_set()
