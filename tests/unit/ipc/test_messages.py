"""The agent channel's typed messages of the recovery path (ipc/messages.py): each survives its wire form, the wire
form is the dict the agent and the worker exchanged before the messages had types (so the frames are the same), and
a body that lacks a key or has one of the wrong type is refused by name. Pure logic, no processes.
Run: DEADPOOL_SLURM_TESTS=0 .venv/bin/python -m pytest -q tests/unit/ipc/test_messages.py
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from deadpool_hpc.ipc.messages import Exit, Failure, Finish, Left, Restore, Role, RoundFailed, Spare, Train, View

VIEW = View(3, (0, 2, 3), (4,))
PLAN = Restore(cut_step=41, slot=1, crc=123456789, fresh=False, from_replica=True, promoted=True, is_source=False,
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
    old_round = {**common, "what": "train", "rank": 1, "world_size": 3, "is_source": False, "fresh": False,
                 "resume": RESUME, "cut_step": 41, "slot": 1, "crc": 123456789, "recomputed_steps": 1,
                 "high_water": 41, "t_fail": 1700000000.5, "t_agreed": 1700000000.75, "failed_nodes": [1],
                 "round": 2, "promoted": True, "from_replica": True}
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


def test_the_swap_link_and_return_messages_keep_the_wire_form_of_the_dicts_they_replace():
    from deadpool_hpc.control.messages import Over, Rejoin, SpareLinkAsk, SwapAnswer, SwapAsk

    assert _same_frame(SwapAsk(2, 5).to_wire(), {"node": 2, "generation": 5})
    assert _same_frame(SwapAnswer(True).to_wire(), {"ok": True})
    assert _same_frame(SwapAnswer(False, busy=1).to_wire(), {"ok": False, "busy": 1})
    assert _same_frame(SwapAnswer(False, why="no spare node left").to_wire(), {"ok": False, "why": "no spare node left"})
    assert _same_frame(SpareLinkAsk("r3/", 1, 4).to_wire(), {"tag": "r3/", "a": 1, "b": 4})
    assert _same_frame(Rejoin(2).to_wire(), {"returns": 2})
    assert _same_frame(Over(75).to_wire(), {"code": 75}) and Over.from_wire({}) == Over(75)
    from deadpool_hpc.ipc.messages import Slots   # agent/node.py's answer to a layout
    assert _same_frame(Slots(64, 2, bell=True).to_wire(), {"nbytes": 64, "count": 2, "bell": True})
    for msg in (SwapAsk(2, 5), SwapAnswer(False, busy=1), SwapAnswer(False, why="x"), SpareLinkAsk("r3/", 1, 4),
                Rejoin(2), Over(0)):
        assert type(msg).from_wire(json.loads(json.dumps(msg.to_wire()))) == msg
    with pytest.raises(ValueError, match="link_ask message: key 'a' is '1'; expected an int"):
        SpareLinkAsk.from_wire({"tag": "r1/", "a": "1", "b": 2})
    with pytest.raises(ValueError, match="swap_ask message lacks key 'generation'"):
        SwapAsk.from_wire({"node": 1})


def test_the_control_threads_notices_keep_the_wire_form_of_the_dicts_they_replace():
    from deadpool_hpc.control.messages import Fenced, Preempt, Suspect, Teardown

    # control/peers.py's suspicion (last_heard may be null), and a node's own (control/plane.py declare_failed)
    assert _same_frame(Suspect((2,), "silent", None).to_wire(), {"ranks": [2], "reason": "silent", "last_heard": None})
    work = {"rank": 1, "step": 7, "end": "SIGKILL", "node": 2, "generation": 0, "t": 5.0}
    own = Suspect((2,), "exit", 5.5, returning=False, work=work)
    assert _same_frame(own.to_wire(), {"ranks": [2], "reason": "exit", "returning": False, "last_heard": 5.5,
                                       "work": work})
    passed_on = dict(own.to_wire(), origin=2)   # as Peers.disseminate sends it on
    assert Suspect.from_wire(json.loads(json.dumps(passed_on))) == Suspect((2,), "exit", 5.5, False, work, 2)
    assert _same_frame(Teardown(3).to_wire(), {"g": 3}) and Teardown.from_wire({"g": 3, "origin": 1}).origin == 1
    assert _same_frame(Fenced("silent").to_wire(), {"reason": "silent"}) and Fenced.from_wire({}) == Fenced("")
    assert Preempt().to_wire() == {} and Preempt.from_wire({}) == Preempt()
    with pytest.raises(ValueError, match=r"suspect message: key 'ranks' is \['1'\]; expected a list of ints"):
        Suspect.from_wire({"ranks": ["1"], "reason": "", "last_heard": None})


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


# ---- every kind that crosses a process has a schema --------------------------------------------------------------
import ast  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import paths  # noqa: E402

from deadpool_hpc.agent import ringlink as _ringlink  # noqa: E402,F401 - registers the ring link's
from deadpool_hpc.control import messages as _control_messages  # noqa: E402,F401 - registers the control plane's
from deadpool_hpc.control import membership as _membership  # noqa: E402,F401 - registers readmit
from deadpool_hpc.faultinject import messages as _fault_messages  # noqa: E402,F401 - registers fault injection's
from deadpool_hpc.process import forkserver as _forkserver  # noqa: E402,F401 - registers the fork server's
from deadpool_hpc.ipc import schema  # noqa: E402
from deadpool_hpc.replica import headers as _replica_headers  # noqa: E402,F401 - registers the replica stream's

PKG = os.path.join(paths.ROOT, "deadpool_hpc")
# the calls that carry a message kind, by method name: (plane, where the kind is among the arguments). The plane of a
# ``send`` depends on what it is called on (the control plane's ``peers``, the agent's ``channel``, a ``client``)
_SENDS = {"send_many": 1, "send_to_suspect": 1, "broadcast": 0, "disseminate": 0, "tell_returning": 0}
# files whose ``kind == "..."`` / ``kind in (...)`` tests read a plane's kinds (their dispatchers)
_DISPATCH = {"process/forkserver.py": schema.FORKSERVER, "agent/ringlink.py": schema.WATCH,
             "agent/node.py": schema.TO_AGENT, "agent/store.py": schema.TO_AGENT, "agent/channel.py": schema.TO_AGENT,
             "control/plane.py": schema.CONTROL, "control/peers.py": schema.CONTROL,
             "worker/client.py": schema.TO_WORKER}
# files that encode messages of a plane of their own with ipc/wire.py ``encode`` (``wire.encode``)
_ENCODES = {"control/peers.py": schema.CONTROL, "process/forkserver.py": schema.FORKSERVER,
            "agent/ringlink.py": schema.WATCH}
_LOCAL = {(schema.TO_AGENT, "closed")}   # ChannelServer.poll's own report that a connection ended: never on a wire


def _kind_of(node, consts: dict) -> str | None:
    """The kind an argument names: a string, a module constant holding one, or ``SomeMessage.KIND``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and node.id in consts:
        return consts[node.id]
    if isinstance(node, ast.Attribute) and node.attr == "KIND":
        return f"{ast.unparse(node.value)}.KIND"
    return None


def _plane_of_send(rel: str, receiver: str) -> str | None:
    last = receiver.rsplit(".", 1)[-1]
    if last == "peers" or rel == "control/peers.py" and receiver == "self":
        return schema.CONTROL
    if last in ("channel", "srv"):
        return schema.TO_WORKER
    if last == "client" or rel in ("worker/client.py", "faultinject/inject.py") and receiver == "self":
        return schema.TO_AGENT
    return None


def kinds_in_the_code() -> dict[tuple[str, str], list[str]]:
    """(plane, kind) -> where (file:line) for every message kind the package sends, registers a handler for or
    dispatches on. A ``Message``'s own ``KIND`` counts as typed by construction and is left out."""
    found: dict[tuple[str, str], list[str]] = {}
    for d, _dirs, files in os.walk(PKG):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(d, f)
            rel = os.path.relpath(path, PKG).replace(os.sep, "/")
            with open(path) as fh:
                tree = ast.parse(fh.read(), path)
            consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                      and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                      for t in n.targets if isinstance(t, ast.Name)}
            hits = []
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    name, recv, args = node.func.attr, ast.unparse(node.func.value), node.args
                    if name == "send" and len(args) >= 2:
                        plane = _plane_of_send(rel, recv)
                        at = 1 if plane in (schema.CONTROL, schema.TO_WORKER) else 0
                        if plane is not None:
                            hits.append((plane, args[at], node))
                    elif name in _SENDS and len(args) > _SENDS[name]:
                        hits.append((schema.CONTROL, args[_SENDS[name]], node))
                    elif name == "on" and args and recv.rsplit(".", 1)[-1] in ("cp", "client"):
                        plane = schema.CONTROL if recv.endswith("cp") else schema.TO_WORKER
                        hits.append((plane, args[0], node))
                    elif name in ("_req", "request", "submit") and args and rel == "worker/client.py":
                        hits.append((schema.TO_AGENT, args[0], node))
                    elif name == "get" and args and recv.rsplit(".", 1)[-1] == "client":
                        hits.append((schema.TO_WORKER, args[0], node))
                    elif name == "encode" and args and rel in _ENCODES:
                        hits.append((_ENCODES[rel], args[0], node))
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
                    if node.func.id == "encode_frame":
                        plane = {"agent/channel.py": schema.TO_WORKER, "worker/client.py": schema.TO_AGENT}.get(rel)
                    else:
                        plane = _ENCODES.get(rel) if node.func.id == "encode" else None
                    if plane is not None:
                        hits.append((plane, node.args[0], node))
                elif isinstance(node, ast.Compare) and rel in _DISPATCH and isinstance(node.left, ast.Name) \
                        and node.left.id == "kind":
                    for op, right in zip(node.ops, node.comparators):
                        items = right.elts if isinstance(op, ast.In) and isinstance(right, (ast.Tuple, ast.Set)) \
                            else [right] if isinstance(op, ast.Eq) else []
                        hits += [(_DISPATCH[rel], item, node) for item in items]
            for plane, arg, node in hits:
                kind = _kind_of(arg, consts)
                if kind is not None and not kind.endswith(".KIND"):
                    found.setdefault((plane, kind), []).append(f"{rel}:{node.lineno}")
    return found


def test_every_message_kind_in_the_code_has_a_schema():
    found = kinds_in_the_code()
    # the scan sees what it must: kinds of each plane written as strings (a dispatcher's, a sender's)
    assert {(schema.CONTROL, "decision"), (schema.CONTROL, "inject"), (schema.TO_AGENT, "store_set"),
            (schema.TO_WORKER, "link")} <= set(found)
    untyped = {pk: where for pk, where in found.items() if pk[1] not in schema.KINDS[pk[0]] and pk not in _LOCAL}
    assert not untyped, f"message kinds without a schema (ipc/schema.py): {untyped}"


def test_the_scan_finds_a_new_untyped_kind(tmp_path, monkeypatch):
    """A kind added without a schema fails the test above: the scan finds it in a module of the package."""
    mod = tmp_path / "deadpool_hpc"
    (mod / "agent").mkdir(parents=True)
    (mod / "agent" / "new.py").write_text('def f(cp, a):\n    cp.peers.send(1, "brand_new", {})\n'
                                          '    a.channel.send(0, "to_worker_new", {})\n    cp.on("heard", print)\n')
    (mod / "process").mkdir()
    (mod / "process" / "forkserver.py").write_text('def g(s):\n    return encode("fork_new", {}, s)\n')
    monkeypatch.setattr(sys.modules[__name__], "PKG", str(mod))
    assert set(kinds_in_the_code()) == {(schema.CONTROL, "brand_new"), (schema.TO_WORKER, "to_worker_new"),
                                        (schema.CONTROL, "heard"), (schema.FORKSERVER, "fork_new")}


def test_the_link_check_reads_its_answers_typed_and_drops_a_malformed_one():
    from types import SimpleNamespace

    from deadpool_hpc.agent.node import NodeAgent
    from deadpool_hpc.agent.preflight import LinkCheck, link_request
    from deadpool_hpc.ipc.messages import LinkAnswer, LinkAsk, LinkResult

    events = []
    agent = SimpleNamespace(log=SimpleNamespace(emit=lambda name, **f: events.append((name, f))))
    read = lambda local, body: NodeAgent._answer(agent, local, LinkAnswer, body)   # noqa: E731 - node.py's dispatch

    sent = []
    chk = LinkCheck(_fake_channel(sent), 2)
    chk.ask(1, [(0, 0, 1), (2, 1, 2)])
    ask = LinkAsk.from_wire(json.loads(json.dumps(sent[0][2])))
    assert [(p.peer, p.rank, p.key) for p in ask.pairs] == [(0, 1, "0-1/0"), (2, 0, "1-2/0")]
    assert sent[0][2] == link_request(1, 1, [(0, 0, 1), (2, 1, 2)], "", 0)
    ok = LinkResult(seen=True, ok=True, seconds=0.01)
    chk.on_local(0, read(0, json.loads(json.dumps(LinkAnswer(ask.id, {0: ok, 2: ok}).to_wire()))))
    assert read(1, {"id": ask.id, "pairs": {"0": {"seen": "yes"}}}) is None   # malformed: dropped, and said
    assert events == [("bad_message", {"kind": "link", "local": 1, "error": "link message: key 'pairs[0].seen' is "
                                       "'yes'; expected a boolean"})]
    chk.on_local(1, read(1, json.loads(json.dumps(LinkAnswer(ask.id, {0: ok, 2: LinkResult(seen=True, error="x",
                                                                                         partner=True)}).to_wire()))))
    got = chk.collect()
    assert got[0] == {"seen": True, "ok": True, "seconds": 0.01, "error": None, "partner_fault": False}
    assert got[2] == {"seen": True, "ok": False, "seconds": None, "error": "x", "partner_fault": True}


def _fake_channel(sent: list):
    class _Channel:
        def send(self, local, kind, body, fds=()):
            sent.append((local, kind, body))
            return True
    return _Channel()


def test_the_replica_streams_and_the_fork_servers_messages_keep_the_dicts_they_replace():
    from deadpool_hpc.agent.ringlink import RingHello
    from deadpool_hpc.process.forkserver import Exited, Spawn, Spawned
    from deadpool_hpc.replica.headers import Ack, Go, Push, RestoreOffer

    assert _same_frame(Push(generation=2, rank=1, step=7, nbytes=64, crc=9).to_wire(),
                       {"generation": 2, "rank": 1, "step": 7, "nbytes": 64, "crc": 9})
    offer = {"generation": 2, "rank": 1, "step": 7, "ok": True, "source": ["10.0.0.2", 4000], "reason": "",
             "nbytes": 64, "crc": 9}
    assert RestoreOffer.from_wire(offer).to_wire() == offer
    assert _same_frame(Go(ok=False, retry=True, reason="busy").to_wire(), {"ok": False, "retry": True, "reason": "busy"})
    assert _same_frame(Ack(ok=True, reason="").to_wire(), {"ok": True, "reason": ""})   # a restore's
    assert _same_frame(Ack(ok=True, reason="", rank=1, step=7, crc=9).to_wire(),
                       {"rank": 1, "step": 7, "crc": 9, "ok": True, "reason": ""})     # a push's
    spawn = {"argv": ["run", "0"], "env": {"A": "1"}, "cwd": "/tmp"}
    assert Spawn.from_wire(spawn).to_wire() == spawn and Spawn.from_wire(spawn).argv == ("run", "0")
    assert Spawned(5).to_wire() == {"pid": 5} and Exited(5, -9).to_wire() == {"pid": 5, "rc": -9}
    assert RingHello(3).to_wire() == {"node": 3}
    with pytest.raises(ValueError, match="spawn message: key 'env' is .*; expected an object of str -> a string"):
        Spawn.from_wire(dict(spawn, env={"A": 1}))


def test_the_fault_injections_and_the_runs_end_keep_the_dicts_they_replace():
    from deadpool_hpc.faultinject.inject import NodeFaults, RankFaults
    from deadpool_hpc.faultinject.messages import FireNode, Inject, InjectSpare, NicDown
    from deadpool_hpc.faultinject.spec import parse_fault
    from deadpool_hpc.ipc.messages import AbortAsk, Trained

    sent = []
    log = SimpleNamespace(emit=lambda *a, **k: None, sync=lambda: None)
    faults = [parse_fault("slow", "node1@5:4"), parse_fault("kill", "node2@5"), parse_fault("kill", "node1@rebuild")]
    rank = RankFaults(faults, node=1, local=0, ranks_per_node=1, log=log, send=lambda k, b: sent.append((k, b)))
    rank.at_step(5, 0, active_nodes={0, 1}, spare_nodes=[2])
    rank.at_phase("rebuild", 1, 0)
    wire = [(k, json.loads(json.dumps(b))) for k, b in sent]
    assert [k for k, _ in wire] == ["fault", "inject_spare", "fault"]
    assert _same_frame(wire[0][1], {"kind": "slow", "target": "node1", "step": 5, "factor": 4.0})
    assert _same_frame(wire[1][1], {"node": 2, "kind": "kill", "target": "node2", "step": 5, "factor": None})
    assert _same_frame(wire[2][1], {"kind": "kill", "target": "node1", "phase": "rebuild", "factor": None})
    assert FireNode.from_wire(wire[0][1]) == FireNode("slow", "node1", 4.0, step=5)
    ask = InjectSpare.from_wire(wire[1][1])
    assert ask == InjectSpare(2, FireNode("kill", "node2", None, step=5))
    assert Inject.from_wire(Inject(ask.node, ask.fault).to_wire()) == Inject(2, ask.fault)
    assert _same_frame(Inject(ask.node, ask.fault).to_wire(), wire[1][1])   # passed on key for key
    # a spare's nic_down at a step: its agent tells its training processes the interface
    told = []
    node = NodeFaults([], node=2, log=log, pids=lambda: {}, rank_local=lambda r: None,
                      tell_local=lambda k, b: told.append((k, b)))
    node.on_message(Inject(2, FireNode("nic_down", "node2", None, step=7)))
    node.on_message(Inject(2, FireNode("nic_down", "node2", None, step=7)))   # once per target and step
    assert told == [("nic_down", {"ifname": NicDown.from_wire(told[0][1]).ifname})] and told[0][1]["ifname"]
    assert _same_frame(Trained(7).to_wire(), {"steps": 7}) and Trained.from_wire({}) == Trained(None)
    assert _same_frame(AbortAsk("ValueError: x").to_wire(), {"error": "ValueError: x"})
    assert len(AbortAsk("e" * 3000).to_wire()["error"]) == 2000
    with pytest.raises(ValueError, match="inject_spare message: key 'step' is '5'; expected an int or null"):
        InjectSpare.from_wire(dict(wire[1][1], step="5"))
    with pytest.raises(ValueError, match="fault message lacks key 'factor'"):
        FireNode.from_wire({"kind": "kill", "target": "node1", "step": 5})


class _Agent(SimpleNamespace):
    """What NodeAgent._on_local / _on_inject use of the agent, recording what they do."""

    def __init__(self):
        from deadpool_hpc.agent.node import NodeAgent

        super().__init__(events=[], fired=[], sent=[], finished=[], aborted=[], state=None)
        self.log = SimpleNamespace(emit=lambda name, **f: self.events.append((name, f)))
        self.peers = SimpleNamespace(fenced=None, send=lambda dest, kind, body: self.sent.append((dest, kind, body)))
        self.faults = SimpleNamespace(fire_node=self.fired.append, on_message=self.fired.append)
        self.cp = SimpleNamespace(finish=self.finished.append, abort=self.aborted.append)
        self._answer = lambda local, cls, body: NodeAgent._answer(self, local, cls, body)
        self.on_local = lambda local, kind, body: NodeAgent._on_local(self, local, kind, body)
        self.on_inject = lambda body: NodeAgent._on_inject(self, body)


def test_the_agent_reads_faults_and_the_runs_end_typed_and_refuses_a_malformed_fault():
    from deadpool_hpc.control.messages import Finished
    from deadpool_hpc.errors import JobAborted
    from deadpool_hpc.faultinject.messages import FireNode, Inject

    a = _Agent()
    a.on_local(0, "fault", {"kind": "kill", "target": "node1", "step": 5, "factor": None})
    a.on_local(0, "fault", {"kind": "kill", "target": "node1", "step": "5", "factor": None})   # malformed
    assert a.fired == [FireNode("kill", "node1", None, step=5)]
    assert a.events == [("bad_message", {"kind": "fault", "local": 0, "error": "fault message: key 'step' is '5'; "
                                         "expected an int or null"})]
    body = {"node": 3, "kind": "hang", "target": "node3", "step": 9, "factor": None}
    a.on_local(0, "inject_spare", body)
    a.on_local(0, "inject_spare", {"kind": "hang", "target": "node3", "step": 9, "factor": None})   # no node
    assert len(a.sent) == 1 and a.sent[0][:2] == (3, "inject") and _same_frame(a.sent[0][2], body)
    assert a.events[-1][1]["error"] == "inject_spare message lacks key 'node'"
    # the spare's agent (control thread): fired typed, a malformed one never
    a.fired.clear()
    a.on_inject(a.sent[0][2])
    a.on_inject({"node": 3, "kind": "hang", "target": 3, "factor": None})
    assert a.fired == [Inject(3, FireNode("hang", "node3", None, step=9))]
    assert a.events[-1] == ("bad_message", {"kind": "inject", "error": "inject message: key 'target' is 3; expected "
                                            "a string"})
    # the run's end: a malformed one ends it all the same (said), with its steps unknown
    a.on_local(0, "finished", {"steps": 200})
    a.on_local(0, "finished", {"steps": "200"})
    assert a.finished == [Finished(200), Finished(None)] and a.events[-1][1]["kind"] == "finished"
    with pytest.raises(JobAborted, match="training process 1 failed: ValueError: x"):
        a.on_local(1, "abort", {"error": "ValueError: x"})
    with pytest.raises(JobAborted, match="a malformed abort message"):
        a.on_local(1, "abort", {})
    assert a.aborted[0] == "ValueError: x" and "malformed" in a.aborted[1] and a.events[-1][1]["kind"] == "abort"
