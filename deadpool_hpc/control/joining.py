"""Membership for a node that was not there at start-up: a replacement node from another Slurm allocation joins the
running job as a spare (docs/replacement-nodes.md, "How a replacement joins").

MPI carries the control messages among the agents ``srun`` started; a newcomer is in another MPI world, so it joins
over TCP with the job's signed wire instead (the measurements that ruled MPI's dynamic processes out are in the
docs). The rules, beside the readmission of a returning node (control/membership.py), which is the same idea:

- **Where.** Every agent of a run with ``--spare-floor`` listens for joins (links.py); the lowest live agent writes
  its address to ``RUN_DIR/companions/join.json`` (``publish``; rewritten when the lowest live agent changes). The
  address is not a secret: every message on the link carries the HMAC of the job's secret, which a companion job
  gets from Slurm with its environment as the main job's tasks do, never on a command line or in a file.
- **Admission** (``may_admit``, ``free_slot``, ``admit``): only the lowest live agent admits, only between
  recoveries, and only into a *free slot*: the node id of a node lost whole (suspected, not returning, in no member
  list: the decision that took it out is applied). The newcomer takes that id, so virtual process ids stay
  ``node x P + local`` and every table sized by the MPI world keeps its size; it gets a fresh identity record (its
  own addresses, pid, host) and is appended to ``spare_nodes`` like a readmitted node: no new generation, no
  training stopped. With no free slot (nothing lost yet, or the decision not applied yet) the answer is a refusal
  that asks to retry (``JoinRefused``).
- **Control messages** (control/peers.py): the admitting agent is the newcomer's *sponsor*: the newcomer's only
  link. Every other agent routes messages for the slot through the sponsor (``Relay`` over MPI, then the link), and
  the newcomer sends everything through it; messages that MPI delivers from the slot's old rank are dropped for good
  (the old agent is fenced). Heartbeats, probes, bells, the ring link and the replica plane go to the newcomer's own
  addresses, which every agent learns from ``Joined``.
- **Its sponsor lost.** The link's end is a suspicion at once, both ways (as a closed ring link). The sponsor's
  loss leaves the joined node without a path for its control messages (its heartbeats are UDP and go on): it
  queues what it sends and *re-attaches* to the lowest live agent of the MPI world (``Attach`` to that agent's join
  listener, whose address every identity record carries), which takes the link over and tells every live agent
  (``Rerouted``). A joined node that finds no agent to re-attach to within its deadline leaves (it is suspected
  and replaced like any lost spare). So any single node may die, a sponsor included, and cost one node.

Messages: ``Join`` / ``JoinRefused`` / ``Admit`` and ``Attach`` / ``Attached`` on the join link (plane JOIN);
``Joined`` and ``Rerouted`` (the sponsor to every other live agent) and ``Relay`` (a message passed on for the slot)
on the control plane.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import time
from dataclasses import dataclass

from ..errors import WireError
from ..ids import Generation, NodeId
from ..ipc.schema import CONTROL, JOIN, Message
from .decision import ProcRuns
from .links import Handshake, Link, LinkClosed
from .membership import Readmit, _add, admitter, joined_nodes, on_readmit

JOIN_FILE = "join.json"           # in RUN_DIR/companions: the lowest live agent's join address
RETRY_S = 0.5                     # seconds a refused newcomer waits before it asks again
ANSWER_S = 10.0                   # seconds a newcomer waits for the answer to its ``Join``
IDENTS_BYTES = 40_000             # identity records per ``Idents`` message, in JSON bytes (a message is <= 64 KiB)


@dataclass(frozen=True)
class Join(Message, plane=JOIN, kind="join"):
    """(a replacement node's agent -> the lowest live agent) Admit me as a spare. host: the node's name
    (SLURMD_NODENAME); job_id: its companion job's Slurm id; identity: its identity record (fence identity, bell,
    heartbeat, ring-link and replica addresses: control/bootstrap.py's keys); nonce: echoed in the answer; t: when
    (Unix seconds)."""

    host: str
    job_id: str
    identity: dict
    nonce: str
    t: float


@dataclass(frozen=True)
class JoinRefused(Message, plane=JOIN, kind="join_refused"):
    """Not now (``retry``: ask again, after RETRY_S) or never (the run ends, the newcomer leaves); ``reason``;
    ``coordinator``: the agent to ask instead, when known."""

    reason: str
    retry: bool
    nonce: str
    coordinator: NodeId | None = None


@dataclass(frozen=True)
class Admit(Message, plane=JOIN, kind="admit"):
    """(the sponsor -> the newcomer) You are node ``node`` (a free slot: a lost node's id) of a world of ``size``
    agents, a spare of generation ``generation`` whose view is ``assignment`` / ``spare_nodes`` / ``members``;
    ``suspected``: the agents the sponsor suspects; ``coordinator``: the sponsor (your link); ``idents_total``:
    every agent's identity record by node id (yours included) follows in ``Idents`` messages, this many in all;
    ``routes``: the other joined nodes' sponsors; ``resume``: the checkpoint this attempt resumed from (None: none);
    ``nonce``: your Join's; ``t``: when (Unix seconds)."""

    node: NodeId
    size: int
    generation: Generation
    assignment: ProcRuns
    spare_nodes: tuple[NodeId, ...]
    members: ProcRuns
    suspected: tuple[NodeId, ...]
    coordinator: NodeId
    idents_total: int
    routes: dict[NodeId, NodeId]
    resume: dict | None
    nonce: str
    t: float


@dataclass(frozen=True)
class Idents(Message, plane=JOIN, kind="idents"):
    """(after ``Admit``) Identity records ``start`` .. ``start + len(records) - 1`` by node id."""

    start: int
    records: list


@dataclass(frozen=True)
class Joined(Message, plane=CONTROL, kind="joined"):
    """(the sponsor -> every other live agent) Node ``node`` is a replacement node now, reached through
    ``sponsor``; ``identity``: its record; ``job_id``: its companion job; ``readmit``: the readmission it amounts
    to (a ``Readmit``'s wire form: the generation it joins and that generation's view)."""

    node: NodeId
    sponsor: NodeId
    identity: dict
    job_id: str
    readmit: dict


@dataclass(frozen=True)
class Attach(Message, plane=JOIN, kind="attach"):
    """(a joined node whose sponsor is lost -> a live agent of the MPI world) Be my sponsor: I am node ``node``, of
    companion job ``job_id``; ``nonce``: echoed in the answer; ``t``: when (Unix seconds)."""

    node: NodeId
    job_id: str
    nonce: str
    t: float


@dataclass(frozen=True)
class Attached(Message, plane=JOIN, kind="attached"):
    """(the new sponsor -> the joined node) Your messages go through me now; ``suspected``: the agents I suspect."""

    sponsor: NodeId
    suspected: tuple[NodeId, ...]
    nonce: str


@dataclass(frozen=True)
class Rerouted(Message, plane=CONTROL, kind="rerouted"):
    """(the new sponsor -> every other live agent) Joined node ``node`` is reached through ``sponsor`` now."""

    node: NodeId
    sponsor: NodeId


@dataclass(frozen=True)
class Relay(Message, plane=CONTROL, kind="relay"):
    """A control message passed on for a joined node: ``inner`` / ``body`` (its kind and body) from ``src`` to
    ``to``; one of them is the joined node, the hop between them its sponsor."""

    to: NodeId
    src: NodeId
    inner: str
    body: dict


# ---- the rules (pure over the control plane's view) --------------------------------------------------------------
def may_admit(cp) -> str | None:
    """Why the agent of ``cp`` cannot admit a newcomer now, or None: only the lowest live agent of the MPI world
    (``admitter``), never during a recovery (its failure flag up)."""
    if cp.me != admitter(cp):
        return "not the lowest live agent of the MPI world"
    if cp.failure.is_set():
        return "a recovery is under way"
    return None


def free_slot(cp) -> NodeId | None:
    """The lowest node id whose node was lost and taken out (suspected, not returning, none of its processes in the
    view's members or assignment), or None. A lost joined node's slot is free again."""
    with cp.peers.lock:
        lost = sorted(n for n in cp.peers.suspected if n not in cp.peers.returning)
    used = {m // cp.P for m in cp.members} | {m // cp.P for m in cp.assignment}
    return next((n for n in lost if n not in used and n != cp.me), None)


def _chunks(records: list) -> list[tuple[int, list]]:
    out, start, size = [], 0, 0
    for i, rec in enumerate(records):
        n = len(json.dumps(rec))
        if i > start and size + n > IDENTS_BYTES:
            out.append((start, records[start:i]))
            start, size = i, 0
        size += n
    return out + [(start, records[start:])]


def admit(cp, link: Link, join: Join, slot: NodeId, resume: dict | None = None) -> tuple[Admit, Readmit]:
    """(the lowest live agent, between recoveries) Make the newcomer on ``link`` node ``slot``: its identity record
    taken, messages for the slot routed through this agent, trusted again, appended to the spare pool; ``Admit``
    queued on the link (which the control thread owns from here on) and ``Joined`` sent to every other live agent.
    ``resume``: the checkpoint this attempt resumed from (the agent's). Returns both messages. Raises LinkClosed
    when the newcomer left before its answer, WireError when an identity record is too large to send (the view is
    left unchanged either way)."""
    ident = dict(join.identity)
    cp.take_identity(slot, ident)
    before = cp.membership
    _add(cp, slot)   # the view with the slot a spare (what the Admit carries); nothing is sent to it yet
    with cp.peers.lock:
        suspected = tuple(sorted(n for n in cp.peers.suspected if n != slot))
    now = time.time()
    readmit = Readmit(node=slot, generation=cp.generation, assignment=tuple(cp.assignment),
                      spare_nodes=tuple(cp.spare_nodes), members=tuple(cp.members), suspected=suspected,
                      coordinator=cp.me, t=now)
    answer = Admit(node=slot, size=cp.size, generation=cp.generation, assignment=tuple(cp.assignment),
                   spare_nodes=tuple(cp.spare_nodes), members=tuple(cp.members), suspected=suspected,
                   coordinator=cp.me, idents_total=len(cp.idents), routes=joined_nodes(cp), resume=resume,
                   nonce=join.nonce, t=now)
    try:   # first on the link: from here on the control thread owns it
        link.send(Admit.KIND, answer.to_wire())
        for start, records in _chunks(list(cp.idents)):
            link.send(Idents.KIND, Idents(start=start, records=records).to_wire())
    except (LinkClosed, WireError):
        cp.adopt(before)   # nobody else heard of it
        raise
    cp.peers.relays.attach(slot, link)
    cp.peers.readmit(slot)
    cp.peers.broadcast(Joined.KIND, Joined(node=slot, sponsor=cp.me, identity=ident, job_id=join.job_id,
                                           readmit=readmit.to_wire()).to_wire())
    return answer, readmit


def on_joined(cp, msg: Joined) -> None:
    """(every other agent) Node ``msg.node`` is a joined node reached through ``msg.sponsor``: its identity record
    and route first, then the readmission as for a returning node (kept until its generation is applied here)."""
    if msg.node == cp.me:
        return
    cp.take_identity(msg.node, dict(msg.identity))
    cp.peers.relays.route(msg.node, msg.sponsor)
    on_readmit(cp, Readmit.from_wire(msg.readmit))


def may_attach(cp, node: NodeId) -> str | None:
    """Why the agent of ``cp`` cannot become joined node ``node``'s sponsor, or None: it must be of the MPI world
    (not a joined node itself), and ``node`` a joined node this agent trusts."""
    if cp.world is None:
        return "a joined node sponsors nobody"
    with cp.peers.lock:
        known = node in cp.peers.relays.routes
    if not known:
        return f"node {node} is not a joined node here"
    if cp.peers.is_suspected(node):
        return f"node {node} is suspected here"
    return None


def attach(cp, link: Link, msg: Attach) -> None:
    """(the new sponsor) Take joined node ``msg.node``'s link over: ``Attached`` on it, then every live agent told.
    Raises LinkClosed when it left before its answer (nothing changed)."""
    with cp.peers.lock:
        suspected = tuple(sorted(cp.peers.suspected))
    link.send(Attached.KIND, Attached(sponsor=cp.me, suspected=suspected, nonce=msg.nonce).to_wire())
    cp.peers.relays.attach(msg.node, link)
    cp.peers.broadcast(Rerouted.KIND, Rerouted(node=msg.node, sponsor=cp.me).to_wire())


def reattach(idents: list, candidates: list, me: NodeId, job_id: str, secret: bytes,
             timeout: float = 2.0) -> tuple[socket.socket, Attached, bytes] | None:
    """(a joined node without a sponsor) Ask each agent of ``candidates`` in turn (node ids; their join addresses
    are in ``idents``) to become its sponsor, ``timeout`` seconds each. Returns (socket, Attached, the bytes read
    past it) from the first that accepts, or None."""
    for n in candidates:
        address = idents[n].get("join") if n < len(idents) else None
        if not address:
            continue
        nonce = secrets.token_hex(8)
        try:
            sock = socket.create_connection((address[0], int(address[1])), timeout=timeout)
        except OSError:
            continue
        h = Handshake(sock, secret)
        try:
            h.send(Attach.KIND, Attach(node=me, job_id=job_id, nonce=nonce, t=time.time()).to_wire(), timeout)
            kind, body = h.receive(timeout)
            if kind == Attached.KIND:
                answer = Attached.from_wire(body)
                if answer.nonce == nonce:
                    return sock, answer, h.rest()
        except (TimeoutError, LinkClosed, ValueError):
            pass
        sock.close()
    return None


# ---- the address -------------------------------------------------------------------------------------------------
def address_file(run_dir: str) -> str:
    return os.path.join(run_dir, "companions", JOIN_FILE)


def publish(run_dir: str, node: NodeId, address: list, generation: int) -> None:
    """Write the join address of agent ``node`` (atomically: a reader sees the old file or the new one)."""
    path = address_file(run_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump({"node": node, "address": address, "generation": generation, "t": time.time()}, fh)
    os.replace(tmp, path)


def read_address(run_dir: str) -> list | None:
    """The published join address [host, port], or None while there is none (or it is being replaced)."""
    try:
        with open(address_file(run_dir)) as fh:
            got = json.load(fh)
    except (OSError, ValueError):
        return None
    address = got.get("address") if isinstance(got, dict) else None
    return address if isinstance(address, list) and len(address) == 2 else None


def mark_joined(run_dir: str, job_id: str, node: NodeId) -> None:
    """``RUN_DIR/companions/<job_id>.joined``: the companion job's node is a spare of the run now (the replacement
    policy, launch/spare_policy.py, counts it in the pool)."""
    path = os.path.join(run_dir, "companions", f"{job_id}.joined")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(f"node{node} {time.time():.3f}\n")


# ---- the newcomer ----------------------------------------------------------------------------------------------
def _waiting(log, reason: str, last: str, tries: int) -> str:
    """``join_waiting`` once per new reason (the newcomer asks again); returns ``reason``."""
    if log is not None and reason != last:
        log.emit("join_waiting", reason=reason[:300], tries=tries)
    return reason


def _receive_idents(h: Handshake, total: int, timeout: float) -> list:
    """The ``total`` identity records that follow an Admit (``Idents`` messages). Raises ValueError for anything
    else or a gap, TimeoutError, LinkClosed."""
    records: list = []
    while len(records) < total:
        kind, body = h.receive(timeout)
        part = Idents.from_wire(body) if kind == Idents.KIND else None
        if part is None or part.start != len(records):
            raise ValueError(f"expected identity records from {len(records)}, got {kind!r}")
        records += part.records
    return records[:total]


@dataclass(frozen=True)
class Admission:
    """What a joined agent starts from (``ControlPlane(admission=...)``, agent/__main__.py): its ``admit``, its
    ``link`` to its sponsor, its ``waker`` (control/waker.py: the bell and heartbeat sockets its identity names), its
    own ``identity`` record, every agent's (``idents``, by node id), and when it asked (``t_asked``, Unix seconds)."""

    admit: Admit
    link: Link
    waker: object
    identity: dict
    idents: list
    t_asked: float


class JoinFailed(RuntimeError):
    """The newcomer could not join: refused for good, or nobody admitted it in time (the message says which)."""


def request(run_dir: str, secret: bytes, host: str, job_id: str, identity: dict, timeout: float,
            log=None, stop=None) -> tuple[socket.socket, Admit, list, bytes]:
    """(a replacement node's agent) Ask the lowest live agent of the run in ``run_dir`` to admit this node, again
    after each refusal that says to retry, for at most ``timeout`` seconds. Returns the connected socket (its link
    to its sponsor), the ``Admit``, every agent's identity record (by node id) and the bytes read past them (the
    link's first frames). ``stop()``: checked between tries (the main job ended). Raises JoinFailed."""
    end = time.monotonic() + timeout
    tries, last = 0, "no join address published yet"
    while time.monotonic() < end and not (stop is not None and stop()):
        address = read_address(run_dir)
        if address is None:
            time.sleep(RETRY_S)
            continue
        nonce = secrets.token_hex(8)
        tries += 1
        try:
            sock = socket.create_connection((address[0], int(address[1])), timeout=min(5.0, ANSWER_S))
        except OSError as exc:
            last = _waiting(log, f"cannot connect to {address[0]}:{address[1]}: {exc}", last, tries)
            time.sleep(RETRY_S)
            continue
        h = Handshake(sock, secret)
        wait = min(ANSWER_S, max(0.1, end - time.monotonic()))
        try:
            h.send(Join.KIND, Join(host=host, job_id=job_id, identity=identity, nonce=nonce,
                                   t=time.time()).to_wire(), wait)
            kind, body = h.receive(wait)
            if kind == Admit.KIND:
                answer = Admit.from_wire(body)
                idents = _receive_idents(h, answer.idents_total, wait)
        except (TimeoutError, LinkClosed, ValueError) as exc:
            sock.close()
            last = _waiting(log, f"{address[0]}:{address[1]}: {exc}", last, tries)
            time.sleep(RETRY_S)
            continue
        if kind == Admit.KIND:
            if answer.nonce != nonce:
                sock.close()
                raise JoinFailed(f"an admission for another request (nonce {answer.nonce!r}, sent {nonce!r})")
            return sock, answer, idents, h.rest()
        sock.close()
        refused = JoinRefused.from_wire(body) if kind == JoinRefused.KIND else None
        if refused is None:
            raise JoinFailed(f"unexpected answer {kind!r} to a join")
        if not refused.retry:
            raise JoinFailed(f"refused: {refused.reason}")
        last = _waiting(log, refused.reason, last, tries)
        time.sleep(RETRY_S)
    raise JoinFailed(f"not admitted within {timeout:g} s ({tries} tries; last: {last})")
