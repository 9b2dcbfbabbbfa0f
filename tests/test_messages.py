"""The agent channel's typed messages of the recovery path (ipc/messages.py): each survives its wire form, the wire
form is the dict the agent and the worker exchanged before the messages had types (so the frames are the same), and
a body that lacks a key or has one of the wrong type is refused by name. Pure logic, no processes.
Run: DEADPOOL_SLURM_TESTS=0 .venv/bin/python -m pytest -q tests/test_messages.py
"""
from __future__ import annotations

import json

import pytest

from deadpool_hpc.ipc.messages import Exit, Failure, Finish, Left, Restore, Role, RoundFailed, Spare, Train, View

VIEW = View(3, (0, 2, 3), (4,))
PLAN = Restore(cut_step=41, slot=1, crc=123456789, fresh=False, pulled=True, promoted=True, serving=False,
               recomputed_steps=1, failed_nodes=(1,), round=2, t_fail=1700000000.5, t_agreed=1700000000.75)
RESUME = {"step": 20, "world_size": 3, "generation": 1, "high_water": 21}


def _same_frame(a: dict, b: dict) -> bool:
    """What ipc/wire.py puts on the wire: the body as sorted-key JSON."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_every_message_survives_its_wire_form():
    for msg in (Failure(3), Left(3, 40, "a peer failed"), RoundFailed(4, "rendezvous timed out"),
                Train(VIEW, 1, 3, 41, None), Train(VIEW, 1, 3, 41, RESUME, PLAN), Spare(VIEW), Exit(75), Finish()):
        wire = json.loads(json.dumps(msg.to_wire()))   # as a frame carries it: tuples come back as lists
        back = Role.from_wire(wire) if isinstance(msg, Role) else type(msg).from_wire(wire)
        assert back == msg, (msg, back)


def test_the_wire_form_is_the_dicts_the_agent_and_the_worker_exchanged_before():
    common = {"active_nodes": [0, 2, 3], "spare_nodes": [4], "spares_left": 1, "generation": 3}
    # agent/node.py's recovery round, as it was written out key by key (21 keys)
    old_round = {**common, "what": "train", "rank": 1, "world_size": 3, "serving": False, "fresh": False,
                 "resume": RESUME, "cut_step": 41, "slot": 1, "crc": 123456789, "recomputed_steps": 1,
                 "high_water": 41, "t_fail": 1700000000.5, "t_agreed": 1700000000.75, "failed_nodes": [1],
                 "round": 2, "promoted": True, "pulled": True}
    assert len(old_round) == 21 and _same_frame(Train(VIEW, 1, 3, 41, RESUME, PLAN).to_wire(), old_round)
    old_start = {**common, "what": "train", "rank": 1, "world_size": 3, "high_water": -1, "resume": None}
    assert _same_frame(Train(VIEW, 1, 3, -1, None).to_wire(), old_start)
    assert _same_frame(Spare(VIEW).to_wire(), {**common, "what": "spare"})
    assert _same_frame(Exit(75).to_wire(), {"what": "exit", "code": 75})
    assert _same_frame(Finish().to_wire(), {"what": "finish"})
    assert _same_frame(Left(3, 40, "x" * 300).to_wire(), {"generation": 3, "done_step": 40, "why": "x" * 200})
    assert _same_frame(RoundFailed(3, "e").to_wire(), {"generation": 3, "error": "e"})
    assert _same_frame(Failure(3).to_wire(), {"generation": 3})
    # a spare's first role used to carry a trainer's keys (rank null, ...) that nobody read: a spare reads it alike
    assert Role.from_wire({**common, "what": "spare", "rank": None, "world_size": 3, "high_water": -1,
                           "resume": None}) == Spare(VIEW)
    assert Train(VIEW, 1, 3, 41, None).restore is None and VIEW.spares_left == 1


@pytest.mark.parametrize("body, match", [
    ({"what": "train"}, "role message lacks key"),
    ({"what": "leave"}, "'what' is 'leave'; expected one of"),
    ({"what": "exit", "code": "75"}, "key 'code' is '75'; expected an int"),
    ({"what": "exit", "code": True}, "key 'code' is True; expected an int"),
    ({"what": "spare", "generation": 1, "active_nodes": [0, "1"], "spare_nodes": []}, "key 'active_nodes'"),
])
def test_a_bad_role_is_refused_by_name(body, match):
    with pytest.raises(ValueError, match=match):
        Role.from_wire(body)


def test_a_recovery_role_with_a_bad_restore_key_is_refused():
    wire = Train(VIEW, 1, 3, 41, None, PLAN).to_wire()
    with pytest.raises(ValueError, match="key 'fresh' is 0; expected a boolean"):
        Role.from_wire(dict(wire, fresh=0))
    with pytest.raises(ValueError, match="left message lacks key 'done_step'"):
        Left.from_wire({"generation": 1, "why": ""})


# ---- the control plane's own messages (control/messages.py) -----------------------------------------------------
def test_the_control_planes_messages_keep_the_wire_form_of_the_dicts_they_replace():
    from deadpool_hpc.control.decision import int_runs
    from deadpool_hpc.control.messages import Abort, Collect, Finished, Ready, Report, Sync

    rep = {"own_rank": 0, "own": [40, 41], "held": {"2": [41]}, "done_step": 41, "start_step": 0}
    spare = {"own_rank": None, "own": [], "held": {}, "done_step": -1, "start_step": 0}
    old_ready = {"round": ["auto", 3], "report": {"0": rep, "1": spare}, "applied": 3,
                 "assignment": int_runs([0, 2, 4]), "spare_nodes": [1]}
    ready = Ready(round=("auto", 3), report={0: Report(0, (40, 41), {2: (41,)}, 41, 0), 1: Report()}, applied=3,
                  assignment=(0, 2, 4), spare_nodes=(1,))
    assert _same_frame(ready.to_wire(), old_ready) and ready.unasked
    assert Ready.from_wire(json.loads(json.dumps(old_ready))) == ready
    asked = Ready.from_wire(dict(old_ready, round=[0, 7]))
    assert asked.round == (0, 7) and not asked.unasked
    assert _same_frame(Collect(round=(0, 7), g=3).to_wire(), {"round": [0, 7], "g": 3})
    assert _same_frame(Sync("ckpt-4").to_wire(), {"tag": "ckpt-4"})
    assert _same_frame(Finished(200).to_wire(), {"steps": 200}) and Finished.from_wire({}) == Finished(None)
    assert _same_frame(Abort("boom", 2).to_wire(), {"error": "boom", "mpi_rank": 2})


@pytest.mark.parametrize("change, match", [
    (lambda w: w.update(round=["later", 3]), r"key 'round' is \['later', 3\]; expected \[coordinator, round\]"),
    (lambda w: w["report"]["0"].update(own=[1, "2"]), r"key 'report\[0\].own' is \[1, '2'\]; expected a list of ints"),
    (lambda w: w["report"].update(x={}), r"key 'report' is .*; expected an object of int -> an object"),
    (lambda w: w.pop("applied"), "ready message lacks key 'applied'"),
])
def test_a_bad_recovery_report_is_refused_by_name(change, match):
    from deadpool_hpc.control.messages import Ready, Report

    wire = Ready(round=("auto", 3), report={0: Report(0, (1,))}, applied=3, assignment=(0,), spare_nodes=()).to_wire()
    wire = json.loads(json.dumps(wire))
    change(wire)
    with pytest.raises(ValueError, match=match):
        Ready.from_wire(wire)
