"""Checks of a node before it is trusted: the site's command, a timed matmul, an all-reduce with each neighbour
node. A node that fails one is fenced and replaced by a spare before it trains a step, instead of failing the
first generation's rendezvous or slowing every step of the job.

Three checks, run at start-up by every node (spares included) before any role is given, and again every
``--spare-check-every`` seconds by an idle spare, so that a spare gone bad leaves the pool before a recovery needs it
(a promotion then waits for nothing):

- ``HealthCheck``: the site's command (``--health-check CMD``), below;
- ``SpeedCheck``: a small matmul timed by each training process on its device (worker/preflight.py), compared
  with the other nodes' figures: a node whose figure exceeds ``--preflight-factor`` (default 3) times the median
  of the others' is far slower (a throttled or degraded GPU, a node whose CPU share shrank) and is replaced by a
  spare before training, cause ``preflight_slow`` (NVIDIA's resiliency extension and DLRover check nodes the same
  way before a job trusts them). A node over the factor times its matmul again (``RETIMES`` more times,
  ``RETIME_GAP_S`` apart) and is judged on its best figure; an idle spare is fenced after two slow re-checks in a
  row: a burst of load on shared cores (seen in CI, the Slurm tests' jobs beside the local tests) is not a slow node.
  The nodes time their matmuls at about the same moment: each agent, once its own training processes have built their
  model, tells every other agent (``preflight`` ``built``) and waits for
  theirs: the active nodes' until the start-up deadline (the first step waits for every rank anyway), the spares'
  up to ``SYNC_S`` more, so that on a machine whose cores the nodes share (the local emulation) every node runs
  under the same load. A spare not built by then is not waited for (a spare frozen at start-up must not hold the
  job back); it times its matmul later and judges itself against the figures it got.
- the link check (``LinkCheck``, part of the same start-up step, before the matmul): the nodes built at the sync
  (every agent's view of them) form a ring, and each node's training processes all-reduce 1 MiB with the same
  local rank of the node before and after it (worker/preflight.py ``link_pair``: a two-member gloo group met
  through the agents' link store), once its matmul is timed (the matmuls keep their common start). A pair whose
  partner came and whose all-reduce failed (a device or group that did not come up, a timeout, a wrong sum) is a
  failed link; each node tells the others its links with its matmul figure. A node is fenced (cause
  ``preflight_link``) when both links it checked failed and a partner of one of them passed with its other
  neighbour: the fault is then this node's, not the partner's (the second round of DLRover's pairwise network
  check, on a ring). A pair with no evidence either way (two nodes in all, a node between two bad ones, a node
  with one link checked) is logged (``link_check``, ``blamed: false``) and judged by nothing: the first
  generation's rendezvous then fails as before. A partner that did not come (frozen, lost, built after the sync,
  another view of the ring) judges nothing either: its own fault is found by its own checks. A partner lost
  during the check costs at most ``LINK_WAIT_S`` + ``LINK_TIMEOUT_S`` (10 s) of the start-up. An idle spare's re-check
  all-reduces with one training node (a different one each time; ``link_ask`` to its agent, which hands it to its
  training
  processes), once its matmul passed: a training node's links work (it trains), so the spare is fenced (cause
  ``preflight_link``) once its all-reduces with two different training nodes in a row failed, neither by the
  partner's own device (one may be that training node's gloo path, broken while it trains over another). A result
  from before a recovery round or a new generation is stale and judges nothing; a judged re-check's keys are
  dropped from both agents' link stores (a week of re-checks would pile up).

The site's command:

Each node agent runs ``CMD`` (``sh -c``) once at start-up, while its training processes import torch and build the
model, in a session of its own, with the agent's environment (``DEADPOOL_NODE`` is the node's index; under Slurm
``SLURMD_NODENAME`` its name) and its output in ``RUN_DIR/health-check-node<N>.log``. Exit 0 means healthy. Any other
exit, or a command still running at ``--startup-timeout``, is a failure of the node like a training process that
never comes up: the node is fenced and a spare takes its place (``node_failed`` with cause ``health_check``), before
it trains a step. What a site puts there: ``nvidia-smi -q`` checks, a DCGM diagnostic (``dcgmi diag -r 1``), an
NCCL all-reduce test of the node, a file-system probe.

Not checked here: a spare again at its promotion (it passed its last re-check, at most ``--spare-check-every``
seconds before), a node's speed against the job's while it trains (the straggler check, agent/stragglers.py), and
NCCL's paths on a GPU node (the link check is gloo over TCP).
"""
from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import time

from ..control.messages import PeerPreflight, PreflightBuilt, PreflightFigure
from ..ipc.messages import LinkAnswer, LinkAsk, LinkPair, LinkResult, MatmulAsk, MatmulFigure


SYNC_S = 10.0               # seconds an agent waits for the other nodes' "built", and then for their figures
PREFLIGHT_TIMEOUT_S = 60.0  # seconds a node's training processes have to answer a matmul check (at least)
RETIMES = 2                 # a node found slow at start-up times its matmul again, up to this many times,
# this far apart, and keeps its best figure: a burst of load on shared cores is not a slow node
RETIME_GAP_S = 0.5
LINK_WAIT_S = 5.0           # seconds a training process waits for its link partner to come
LINK_TIMEOUT_S = 5.0        # the link pair's gloo timeout, seconds (its set-up and each all-reduce)
LINK_REPS = 3               # all-reduces per pair (worker/preflight.py REPS)
LINK_BOUND_S = LINK_WAIT_S + (2 + LINK_REPS) * LINK_TIMEOUT_S + 5.0   # the most a link check's answer takes


def judge(mine: float, others: list[float], factor: float) -> tuple[bool, float | None]:
    """Whether a node whose matmul took ``mine`` seconds is far slower than the ``others`` nodes' figures:
    (slow, median of the others). With no other figure, or ``factor`` 0 (off), nothing is slow."""
    if not others or not factor:
        return False, (statistics.median(others) if others else None)
    med = statistics.median(others)
    return mine > factor * med, med


def link_pair_of(key: str) -> tuple[int, int] | None:
    """The two nodes of a link store key (``link/A-B/...``, worker/preflight.py ``link_pair``), or None."""
    m = re.match(r"^link/(\d+)-(\d+)/", key)
    return (int(m.group(1)), int(m.group(2))) if m else None


def ring_pairs(me: int, nodes) -> list[tuple[int, int, int]]:
    """``me``'s pairs on the ring of the sorted ``nodes``: (peer, a, b) for the node before and the node after it (a
    < b, the pair's members; one pair when there are two nodes, none with fewer or when ``me`` is not in ``nodes``)."""
    ring = sorted(set(nodes))
    if me not in ring or len(ring) < 2:
        return []
    i = ring.index(me)
    return [(q, min(me, q), max(me, q)) for q in sorted({ring[i - 1], ring[(i + 1) % len(ring)]} - {me})]


def blame(mine: dict[int, bool], theirs: dict[int, dict[int, bool]], me: int) -> list[int] | None:
    """Whether the links say the fault is this node's. ``mine``: peer -> ok, for this node's pairs whose partner
    came; ``theirs``: peer -> that peer's own such map (as it told). Returns the failed peers when two or more of
    this node's links were checked, every one failed, and one of those partners passed with another node; else None
    (no fault, or none that can be pinned on this node: one failed link alone may be its partner's fault)."""
    if len(mine) < 2 or any(mine.values()):
        return None
    if any(ok for q in mine for r, ok in theirs.get(q, {}).items() if r != me):
        return sorted(mine)
    return None


class PreflightStopped(Exception):
    """This node failed while its start-up checks ran (a training process exited, a planned fault fired: its agent's
    ``pending_exit`` is set). Raised by the ``tick`` a node agent hands ``SpeedCheck.at_startup`` (agent/node.py
    ``_tick_or_stop``) to end the checks' waits; ``at_startup`` lets it through, and its caller ends the start-up
    without a verdict (the agent's loop acts on the failure)."""


class LinkCheck:
    """The agent's half of the link check (the module docstring): ``channel`` to this node's ``P`` training
    processes. ``run`` at start-up (blocking); ``ask`` then ``collect`` for an idle spare's re-check."""

    def __init__(self, channel, P: int):
        self.channel, self.P = channel, P
        self._id = 0
        self._answers: dict[int, dict[int, LinkResult]] = {}   # local rank -> its results by peer node
        self._pairs: list[tuple[int, int, int]] = []
        self.asked_at: float | None = None   # while a check is under way

    def on_local(self, local: int, answer: LinkAnswer) -> None:
        """Training process ``local``'s answer (worker/preflight.py ``link_answer``), read by the agent's channel
        dispatch (agent/node.py, which drops a malformed one): kept when it answers the ask under way."""
        if answer.id == self._id:
            self._answers[local] = answer.pairs

    def ask(self, me: int, pairs: list[tuple[int, int, int]], tag: str = "") -> None:
        """Ask this node's training processes to check ``pairs`` (``ring_pairs``' form); ``tag`` makes the keys of
        a later check new (``r3/``)."""
        self._id += 1
        self._answers = {}
        self._pairs = pairs
        self.asked_at = time.monotonic()
        for local in range(self.P):
            self.channel.send(local, "link", link_request(self._id, me, pairs, tag, local))

    def collect(self) -> dict[int, dict] | None:
        """None while an answer is missing (up to ``LINK_BOUND_S`` after ``ask``); else peer -> ``{"seen", "ok",
        "seconds", "error", "partner_fault"}`` over this node's training processes (seen: every one met its partner;
        ok: every one's all-reduces were right; seconds: the slowest median all-reduce; partner_fault: every failure
        was the partner's device)."""
        if len(self._answers) < self.P and time.monotonic() - self.asked_at < LINK_BOUND_S:
            return None
        self.asked_at = None
        out = {}
        for q, _, _ in self._pairs:
            per = [self._answers.get(lo, {}).get(q) or LinkResult(seen=True, ok=False, error=(
                   f"training process {lo} did not answer within {LINK_BOUND_S:.0f} s")) for lo in range(self.P)]
            seen = all(r.seen for r in per)
            ok = seen and all(r.ok for r in per)
            secs = [r.seconds for r in per if r.seconds is not None]
            bad = [r for r in per if r.seen and not r.ok]
            out[q] = {"seen": seen, "ok": ok, "seconds": round(max(secs), 6) if ok and secs else None,
                      "error": bad[0].error if bad else None,
                      "partner_fault": bool(bad) and all(r.partner for r in bad)}
        return out

    def run(self, tick, me: int, nodes) -> dict[int, dict]:
        """Check ``me``'s links on the ring of ``nodes`` (blocking, ticking the agent's loop): ``collect``'s
        answer, {} with no pair."""
        pairs = ring_pairs(me, nodes)
        if not pairs:
            return {}
        self.ask(me, pairs)
        while (res := self.collect()) is None:
            tick(0.005)
        return res


def link_request(rid, me: int, pairs, tag: str, local: int) -> dict:
    """The ``link`` message to local process ``local`` of node ``me`` for ``pairs`` (peer, a, b)."""
    return LinkAsk(id=rid, wait_s=LINK_WAIT_S, timeout_s=LINK_TIMEOUT_S,
                   pairs=tuple(LinkPair(peer=q, rank=0 if me == a else 1, key=f"{a}-{b}/{tag}{local}")
                               for q, a, b in pairs)).to_wire()


class SpeedCheck:
    """The cross-node half of the timed matmul (the module docstring). ``cp``: the ControlPlane (its handlers get
    ``preflight``); ``channel``: to this node's training processes; ``P``: their number; ``log``: EventLog;
    ``factor``: --preflight-factor."""

    def __init__(self, cp, channel, P: int, log, factor: float):
        self.cp, self.channel, self.P, self.log, self.factor = cp, channel, P, log, factor
        self.link = LinkCheck(channel, P)
        self.built: set[int] = set()
        self.figures: dict[int, float] = {}   # node -> seconds, this start-up's
        self.links: dict[int, dict[int, bool]] = {}   # node -> its links (peer -> ok) whose partner came
        self.median: float | None = None      # of every node's figure at start-up: what a spare's re-check is held to
        self._id = 0
        self._answers: dict[int, MatmulFigure] = {}
        self.asked_at: float | None = None
        self._slow_in_a_row = 0   # an idle spare's re-checks over the factor, one after the other
        cp.on(PeerPreflight.KIND, self._on_peer)

    # ---- messages --------------------------------------------------------------------------------------------
    def _on_peer(self, src: int, msg: PeerPreflight) -> None:
        if isinstance(msg, PreflightBuilt):
            self.built.add(src)
        elif isinstance(msg, PreflightFigure):
            self.figures[src] = msg.seconds
            self.links[src] = dict(msg.links)

    def on_local(self, local: int, figure: MatmulFigure) -> None:
        """Training process ``local``'s figure (worker/preflight.py ``answer``), read by the agent's channel dispatch
        (agent/node.py, which drops a malformed one): kept when it answers the ask under way."""
        if figure.id == self._id:
            self._answers[local] = figure

    def ask_local(self) -> None:
        self._id += 1
        self._answers = {}
        self.asked_at = time.monotonic()
        for local in range(self.P):
            self.channel.send(local, MatmulAsk.KIND, MatmulAsk(self._id).to_wire())

    def local_figure(self) -> tuple[float | None, str | None] | None:
        """None while some answer is missing; else (this node's figure: the slowest process's seconds, error)."""
        if len(self._answers) < self.P:
            return None
        errors = [f"training process {lo}: {a.error}" for lo, a in sorted(self._answers.items()) if a.error]
        if errors:
            return None, "; ".join(errors)
        if any(a.seconds is None for a in self._answers.values()):
            return None, "a training process sent no figure and no error"
        return max(a.seconds for a in self._answers.values()), None

    # ---- start-up --------------------------------------------------------------------------------------------
    def at_startup(self, tick, deadline: float) -> tuple[str, str] | None:
        """Run the start-up checks, the matmul then the links (blocking, ticking the agent's loop). Returns (cause,
        why) when this node fails one (cause ``preflight_slow`` or ``preflight_link``; a slow node's links may time
        out too: slow is said first), or None. ``tick(timeout)`` runs the agent's loop between the waits; what it
        raises ends the checks (PreflightStopped: this node failed meanwhile)."""
        cp, me, t_start = self.cp, self.cp.me, time.monotonic()
        alive = lambda: set(cp.peers.alive())  # noqa: E731
        active = {m // self.P for m in cp.assignment}   # their build is waited for anyway: step 0 needs every rank
        self.built.add(me)
        cp.peers.send_many(sorted(alive() - {me}), PeerPreflight.KIND, PreflightBuilt().to_wire())
        spares_by = None   # when the active nodes were built: the spares get SYNC_S more
        while not alive() <= self.built and time.monotonic() < deadline:
            if active & alive() <= self.built:
                spares_by = spares_by or time.monotonic() + SYNC_S
                if time.monotonic() > spares_by:
                    break
            tick(0.005)
        ring = self.built & alive()   # the link check's, as seen at the sync
        t0 = time.monotonic()
        self.ask_local()
        # its own bound: the wait for the others may have used the start-up deadline up (an active node frozen)
        answer_by = max(deadline, t0 + PREFLIGHT_TIMEOUT_S)
        if (res := self._await_figure(tick, answer_by)) is None:
            return "preflight_slow", (f"the pre-flight matmul of training process(es) "
                                      f"{[lo for lo in range(self.P) if lo not in self._answers]} did not end "
                                      f"within {answer_by - t0:.0f} s")
        mine, error = res
        self.asked_at = None   # answered (an idle spare's first re-check is the next ask_local)
        if error:
            return "preflight_slow", f"the pre-flight matmul failed: {error}"
        t_link = time.monotonic()
        links = self.link.run(tick, me, ring)
        mine_links = {q: r["ok"] for q, r in links.items() if r["seen"]}
        peers = (self.built & alive()) - {me}   # a node built later gets our figures too and judges itself with them
        self.figures[me] = mine
        cp.peers.send_many(sorted(alive() - {me}), PeerPreflight.KIND,
                           PreflightFigure(seconds=mine, links=dict(mine_links)).to_wire())
        t_sent = time.monotonic()
        end = time.monotonic() + SYNC_S
        while not (peers & alive()) <= set(self.figures) and time.monotonic() < end:
            tick(0.005)
        others = [s for n, s in self.figures.items() if n != me]
        slow, med = judge(mine, others, self.factor)
        first, retimes = mine, 0
        while slow and retimes < RETIMES:   # a second opinion before a node is fenced for noise
            retimes += 1
            # bounded by the first figure, not PREFLIGHT_TIMEOUT_S: the other nodes are about to start
            again = self._retime(tick, RETIME_GAP_S, min(PREFLIGHT_TIMEOUT_S, max(2.0, 10 * first)))
            if again is None:
                break
            mine = min(mine, again)
            slow, med = judge(mine, others, self.factor)
        self.figures[me] = mine   # the best figure: what an idle spare's re-checks are held to (self.median)
        self.median = statistics.median(self.figures.values())
        self.log.emit("preflight", seconds=round(mine, 6), others_median=None if med is None else round(med, 6),
                      factor=self.factor, nodes=len(self.figures), slow=slow, waited_s=round(t0 - t_start, 3),
                      figures={str(n): round(s, 6) for n, s in sorted(self.figures.items())},
                      **({"first_seconds": round(first, 6), "retimes": retimes} if retimes else {}))
        failed = blame(mine_links, self.links, me)
        if links:
            self.log.emit("link_check", blamed=failed is not None, seconds=round(t_sent - t_link, 3),
                          pairs={str(q): r for q, r in sorted(links.items())},
                          partners={str(q): {str(r): ok for r, ok in self.links.get(q, {}).items()} for q in links})
        if slow:
            return "preflight_slow", (f"its pre-flight matmul took {mine * 1e3:.1f} ms, {mine / med:.1f} x the other "
                                      f"nodes' median ({med * 1e3:.1f} ms; --preflight-factor {self.factor:g})")
        if failed is not None:
            errors = "; ".join(f"node{q}: {links[q]['error']}" for q in failed)
            return "preflight_link", (f"its all-reduce with neighbour node(s) {failed} failed while they passed with "
                                      f"another node ({errors[:300]})")
        return None

    def _retime(self, tick, gap: float, limit: float) -> float | None:
        """This node's matmul timed again after ``gap`` seconds (ticking the agent's loop): its figure, or None when
        it failed or did not answer within ``limit`` seconds (the first figure then stands)."""
        end = time.monotonic() + gap
        while time.monotonic() < end:
            tick(0.005)
        self.ask_local()
        res = self._await_figure(tick, self.asked_at + limit)
        self.asked_at = None
        return None if res is None else res[0]

    def _await_figure(self, tick, end: float) -> tuple[float | None, str | None] | None:
        """``local_figure()`` once every training process answered, ticking the agent's loop (which watches the
        failure flag) meanwhile; None if the monotonic ``end`` passed first."""
        while (res := self.local_figure()) is None:
            tick(0.005)
            if time.monotonic() > end:
                return None
        return res

    # ---- an idle spare's re-check ----------------------------------------------------------------------------
    def spare_verdict(self) -> str | None:
        """After ``ask_local``: None while waiting; "" when the figure passes; else why this spare fails."""
        res = self.local_figure()
        if res is None:
            if time.monotonic() - self.asked_at > PREFLIGHT_TIMEOUT_S:
                return f"its training processes did not answer the matmul check within {PREFLIGHT_TIMEOUT_S:.0f} s"
            return None
        mine, error = res
        self.asked_at = None
        if error:
            return f"the matmul check failed: {error}"
        slow = bool(self.factor and self.median and mine > self.factor * self.median)
        self._slow_in_a_row = self._slow_in_a_row + 1 if slow else 0
        self.log.emit("spare_checked", seconds=round(mine, 6), startup_median=self.median, factor=self.factor,
                      slow=slow, in_a_row=self._slow_in_a_row)
        if self._slow_in_a_row >= 2:   # one slow figure may be a burst of the machine's load: two in a row are not
            return (f"its matmul took {mine * 1e3:.1f} ms, {mine / self.median:.1f} x the job's start-up median "
                    f"({self.median * 1e3:.1f} ms; --preflight-factor {self.factor:g})")
        return ""


class HealthCheck:
    """One run of the site's command; ``poll()`` -> None while it runs, else (exit code, seconds, output tail)."""

    def __init__(self, cmd: str, env: dict, log_path: str):
        self.cmd, self.log_path = cmd, log_path
        self.t0 = time.monotonic()
        self._out = open(log_path, "wb")
        self.proc = subprocess.Popen(["sh", "-c", cmd], env=env, stdout=self._out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.result: tuple[int, float, str] | None = None

    def poll(self) -> tuple[int, float, str] | None:
        if self.result is None and self.proc.poll() is not None:
            self._out.close()
            self.result = (self.proc.returncode, time.monotonic() - self.t0, self._tail())
        return self.result

    def kill(self) -> None:
        """End the command and everything it started (its session)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._out.close()

    def _tail(self, n: int = 400) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(max(0, os.path.getsize(self.log_path) - n))
                return fh.read().decode(errors="replace").strip()
        except OSError:
            return ""
