"""Will this layout survive these injected faults? A pure simulation, run before any process starts.

Owns the rules a fault spec is checked against (``check``); owns no process and no signal (injection is
inject.py). The simulation replays the faults in order, as the recovery would handle them:

- a *round* is one recovery agreement (agreement.decide). Faults at one step are lost together and
  start a round; a phase fault (``--kill node2@rebuild``) joins round ``nth``: before its decision for
  the phases detect/agree/decided, after it (so the round fails and another follows) for rebuild/restore,
  and at the first step after it (a new loss) for resume;
- a *window* is the run of rounds between two stretches of training: every node lost in a window is lost
  "together". A rank survives a window when at least one of its K replica holders (the same local index on
  the next K active nodes, a ring: placement.py) is on a node not lost in the window and not
  replaced in the previous window (a promoted node's replicas are only re-made by its first step);
- each lost active node takes the first live spare; with none left the run saves a checkpoint and is
  requeued (``--requeue``), or cannot go on;
- a node that lost a training process at a step (``--kill rank2@40``, ``--hang rank2@40``: its agent lives on)
  comes back as the last spare from the next step's faults on (agent/comeback.py), unless ``--no-spare-return``;
  once only, when ``--quarantine`` is on: a fault run's steps take seconds, so a second failure of a node that came
  back is taken to fall inside the quarantine. A whole node lost (``node1``) never comes back;
- the start-up phases (``--kill node1@startup``, ``@build``, ``@first``) are one window before step 0: every rank's
  state is still its initial one, which each rank rebuilds itself (agreement.decide's fresh start), so no replica
  is needed there, only a spare for each lost active node. A spare node never reaches ``first`` (it takes no
  snapshot), and start-up faults are not combined with recovery-phase faults: how many rounds a start-up takes
  (one or two) depends on when each node gets there.

``check`` raises ConfigError naming the faults and the reason; ``rounds`` returns the simulated rounds
for tests and docs.
"""
from __future__ import annotations

from ..errors import ConfigError
from ..placement import holder_nodes, promotion

PRE_DECISION = ("detect", "agree", "decided")
POST_DECISION = ("rebuild", "restore")


def check(cfg) -> None:
    """Raise ConfigError if the run ``cfg`` (a RunConfig) cannot survive ``cfg.faults``."""
    _Sim(cfg).run()


def rounds(cfg) -> list[dict]:
    """The simulated recovery rounds: [{"lost_nodes", "promoted", "requeued"}] in order."""
    sim = _Sim(cfg)
    sim.run()
    return sim.log


class _Sim:
    def __init__(self, cfg):
        self.cfg = cfg
        self.N, self.S, self.P = cfg.layout.nodes, cfg.layout.spares, cfg.layout.ranks_per_node
        self.K = cfg.replication.replicas if cfg.replication.replicate else 0
        self.log: list[dict] = []
        self._reset()

    def _reset(self) -> None:
        self.active = list(range(self.N))                  # physical node of each logical node (slot)
        self.spares = list(range(self.N, self.N + self.S))  # live spare nodes, in promotion order
        self.dead: dict[int, str] = {}                      # physical node -> when it was lost
        self.back: list[int] = []                           # nodes coming back as spares from the next step on
        self.returned: set[int] = set()                     # nodes that came back once

    # ---- the replay --------------------------------------------------------------------------------------
    def run(self) -> None:
        # a node slowed from a step on is not lost there: the straggler check may swap it out a window later (a
        # planned swap, when a spare is free then) or only report it, so it takes no part in the replay
        faults = [f for f in self.cfg.internal.faults if not (f.kind == "slow" and f.step is not None)]
        start = [f for f in faults if f.at_start]
        phase = [f for f in faults if f.phase is not None and not f.at_start]
        round_no = 0
        replaced_before: set[int] = set()
        if start:
            if phase:
                raise ConfigError(f"{start[0]} and {phase[0]}: a start-up fault cannot be combined with a "
                                  f"recovery-phase fault (the start-up may take one round or two, so recovery "
                                  f"{phase[0].nth} is not fixed); accepted: start-up faults with step faults")
            for f in start:
                if f.phase == "first" and self._resolve(f) not in self.active:
                    raise ConfigError(f"{f}: node{self._resolve(f)} is a spare, which takes no snapshot, so it never "
                                      f"reaches the first phase; accepted: a training node (0..{self.N - 1}), or "
                                      f"startup / build for a spare")
            round_no = 1
            self._promote(self._lose(start, "start-up", False), round_no, start)
        for s in sorted({f.step for f in faults if f.phase is None}):
            for node in self.back:   # back in the pool since the last step's faults (agent/comeback.py)
                del self.dead[node]
                self.spares.append(node)
                self.returned.add(node)
            self.back = []
            new, where = [f for f in faults if f.phase is None and f.step == s], f"step {s}"
            window: set[int] = set()     # logical nodes lost in this window
            replaced: set[int] = set()   # logical nodes given a new node in this window
            unfilled: set[int] = set()   # lost after a decision: filled by the next round
            must_train = False
            while True:
                round_no += 1
                pre = new + [f for f in phase if f.nth == round_no and f.phase in PRE_DECISION]
                lost = self._lose(pre, where, must_train)
                window |= lost
                self._check_replicas(window, replaced_before, pre)
                replaced |= set(self._promote(lost | unfilled, round_no, pre))
                post = [f for f in phase if f.nth == round_no and f.phase in POST_DECISION]
                unfilled = self._lose(post, f"recovery {round_no}", True)
                window |= unfilled
                self._check_replicas(window, replaced_before, pre + post)
                resume = [f for f in phase if f.nth == round_no and f.phase == "resume"]
                if unfilled:  # the round failed after its decision: another round follows, same window
                    new, where, must_train = [], f"recovery {round_no}", False
                elif resume:  # a new window: the nodes just promoted have not re-made their replicas yet
                    replaced_before, window, replaced = replaced, set(), set()
                    new, where, must_train = resume, f"the first step after recovery {round_no}", True
                else:
                    break
            # a later step's window finds the promoted nodes' replicas re-made: the first step after a recovery
            # commits every rank's snapshot at all its holders before any update (worker/context.py)
            replaced_before = set()
        late = [f for f in phase if f.nth > round_no]
        if late:
            f = late[0]
            raise ConfigError(f"{f}: no recovery happens before it (a phase fault needs an earlier fault at a step, "
                              f"e.g. --kill node1@10)" if not round_no else
                              f"{f}: the faults given cause {round_no} recover{'y' if round_no == 1 else 'ies'}, so "
                              f"recovery {f.nth} never happens; accepted: a phase of recovery 1..{round_no}")

    def _slot_of(self, node: int) -> int | None:
        return self.active.index(node) if node in self.active else None

    def _resolve(self, f) -> int:
        """Physical node a fault hits now."""
        return self.active[f.index // self.P] if f.target_kind == "rank" else f.index

    def _lose(self, faults, when: str, must_train: bool) -> set[int]:
        """Kill the targets of ``faults`` (at ``when``); returns the logical nodes (slots) lost. Spares lost leave
        the pool. ``must_train``: the targets must be training then (post-decision and resume phases)."""
        lost: set[int] = set()
        for f in faults:
            node = self._resolve(f)
            if node in self.dead:
                raise ConfigError(f"{f}: node{node} is already lost ({self.dead[node]}); accepted: a node alive then")
            if must_train and node not in self.active:
                raise ConfigError(f"{f}: node{node} is not training at {when} (it is a spare), so it never reaches "
                                  f"the {f.phase} phase; accepted: a node that trains then")
            self.dead[node] = f"{f} at {when}"
            if f.target_kind == "rank" and f.phase is None and self.cfg.comeback.enabled and \
                    not (node in self.returned and self.cfg.comeback.quarantine):
                self.back.append(node)
            if node in self.spares:
                self.spares.remove(node)
            slot = self._slot_of(node)
            if slot is not None:
                lost.add(slot)
        return lost

    def _check_replicas(self, window: set[int], replaced_before: set[int], faults) -> None:
        if not window:
            return
        named = ", ".join(map(str, faults))
        if self.K == 0:
            raise ConfigError(f"{named}: without replicas (--no-replicate or --replicas 0) a lost node's state exists "
                              f"nowhere; accepted: --replicas 1 or more")
        for slot in sorted(window):
            holders = holder_nodes(slot, self.N, self.K)
            if all(h in window or h in replaced_before for h in holders):
                raise ConfigError(
                    f"{named}: logical node {slot} and every holder of its replica (logical node(s) "
                    f"{', '.join(map(str, holders))}) are lost together, so the state of its ranks survives nowhere; "
                    f"accepted: --replicas {self.K + 1} (needs --nodes >= {self.K + 2}) or faults at different steps")

    def _promote(self, lost: set[int], round_no: int, faults) -> dict[int, int]:
        if not lost:
            return {}
        if len(lost) > len(self.spares):
            if not self.cfg.persistence.requeue:
                total = len(self.cfg.internal.faults)
                raise ConfigError(f"{total} fault(s) requested ({', '.join(map(str, self.cfg.internal.faults))}): at "
                                  f"{', '.join(map(str, faults))} no spare node is left (only {self.S} spare node(s)); "
                                  f"accepted: more --spares, fewer faults, or --requeue (which saves a checkpoint and "
                                  f"restarts when no spare is left)")
            if any(f.phase is not None for f in self.cfg.internal.faults):
                raise ConfigError("phase faults (nodeN@PHASE) cannot be combined with a requeue (the requeued attempt "
                                  "starts its recovery count again); accepted: enough --spares for every loss")
            self.log.append({"round": round_no, "lost_slots": sorted(lost), "promoted": {}, "requeued": True})
            self._reset()
            return {}
        by_node = promotion([self.active[sl] for sl in lost], self.spares)   # decide's own rule (placement.py)
        promoted = {}
        for slot in sorted(lost, key=lambda sl: self.active[sl]):
            promoted[slot] = by_node[self.active[slot]]
            self.active[slot] = promoted[slot]
        del self.spares[:len(by_node)]
        self.log.append({"round": round_no, "lost_slots": sorted(lost), "promoted": promoted, "requeued": False})
        return promoted
