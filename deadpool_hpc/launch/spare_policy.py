"""When to ask Slurm for replacement nodes, and when to give a request up: a pure policy (no Slurm, no clock).

The run keeps a pool of idle spares; each lost node takes one. With ``--spare-floor K`` > 0, whenever fewer than K
spares are left the job asks Slurm for one more node per missing spare, each as a small companion job of its own
(launch/companion.py submits, watches and cancels them; this module only decides). ``SparePolicy.decide`` is given
the time, the pool size and the companion jobs outstanding, and answers what to submit and what to cancel:

- **submit** while ``pool < floor``: as many as make the companions still expected (pending, or started but not
  yet in the pool) equal to the missing spares. Never more than ``floor`` are outstanding at a time, however many
  nodes are lost at once (a storm asks for ``floor``, not for one node per loss).
- **cancel** a companion still pending ``wait`` seconds after it was submitted (Slurm has no node for it now: the
  job goes on with what it has); one whose node failed its checks (release it); and every one at the job's end.
- after a cancel for the wait, nothing is asked again until the pool shrinks further (a new loss): a cluster
  with no free node is not asked every ``wait`` seconds for ever. The same after a companion that ended without
  this policy cancelling it (``scancel`` by hand, its node released itself or died while it joined, Slurm ended it),
  but not after the end of one whose node had joined (``left``): that is a lost node like any other, and the pool
  says so. A pool that grows (a node joined, a spare came back) ends that pause.

Nothing else: when the pool is empty the job's own requeue (docs/slurm.md) acts, as without this policy.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass

PENDING, RUNNING, JOINED, FAILED, GONE, LEFT = "pending", "running", "joined", "failed", "gone", "left"
STATES = (PENDING, RUNNING, JOINED, FAILED, GONE, LEFT)


@dataclass(frozen=True)
class Companion:
    """One companion job as the caller last saw it: its Slurm ``job_id``, when it was ``submitted`` (seconds, the
    caller's clock) and its ``state``: pending (queued), running (its node is up but not in the pool yet), joined
    (its node is one of the pool's spares), failed (its node failed its checks), gone (Slurm ended it), left (its
    node had joined and its job ended: a node lost, which the pool's size already says, not a request given up)."""

    job_id: str
    submitted: float
    state: str = PENDING

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"companion {self.job_id} state {self.state!r}: accepted: {', '.join(STATES)}")

    @property
    def outstanding(self) -> bool:
        """Asked for and not in the pool yet: pending, or started and not joined."""
        return self.state in (PENDING, RUNNING)


class Action(typing.NamedTuple):
    """What to do: ``kind`` "submit" (``job_id`` None) or "cancel" (that job), and why (a few words, the event's)."""

    kind: str
    job_id: str | None
    reason: str


class SparePolicy:
    """The decisions for one job. ``floor``: ``--spare-floor`` (0: never submits); ``wait``: ``--spare-wait``
    (seconds > 0). Raises ValueError for a floor < 0 or a wait <= 0."""

    def __init__(self, floor: int, wait: float) -> None:
        if not isinstance(floor, int) or isinstance(floor, bool) or floor < 0:
            raise ValueError(f"spare floor {floor!r}: accepted: an integer >= 0")
        if not isinstance(wait, (int, float)) or isinstance(wait, bool) or not wait > 0:
            raise ValueError(f"spare wait {wait!r}: accepted: seconds > 0")
        self.floor = floor
        self.wait = float(wait)
        self._paused_at: int | None = None   # the pool size when a request was given up (None: not paused)
        self._cancelled: set[str] = set()    # companions this policy cancelled
        self._ended: set[str] = set()        # companions seen gone

    def decide(self, now: float, pool: int, companions: typing.Iterable[Companion],
               ending: bool = False) -> list[Action]:
        """The actions for this moment: cancels first, then submits. ``now``: seconds on the same clock as each
        companion's ``submitted``; ``pool``: idle spares the job has now (>= 0); ``companions``: every companion
        job submitted so far by this policy's caller (a gone one may be left out once it was passed as gone);
        ``ending``: the job is ending, cancel all."""
        comps = list(companions)
        live = [c for c in comps if c.state not in (GONE, LEFT)]
        if ending:
            self._cancelled |= {c.job_id for c in live}
            return [Action("cancel", c.job_id, "the job ends") for c in live]
        if self._paused_at is not None and pool > self._paused_at:
            self._paused_at = None
        actions: list[Action] = []
        for c in comps:
            if c.state == GONE and c.job_id not in self._ended:
                self._ended.add(c.job_id)
                if c.job_id not in self._cancelled:   # ended, and not by this policy
                    self.pause(pool)
        for c in live:
            if c.state == PENDING and now - c.submitted >= self.wait:
                actions.append(Action("cancel", c.job_id, f"not started within {self.wait:g} s"))
                self.pause(pool)
            elif c.state == FAILED:
                actions.append(Action("cancel", c.job_id, "its node failed its checks"))
        cancelled = {a.job_id for a in actions}
        self._cancelled |= cancelled
        expected = sum(1 for c in live if c.outstanding and c.job_id not in cancelled)
        missing = self.floor - pool
        if missing > 0 and (self._paused_at is None or pool < self._paused_at):
            self._paused_at = None
            why = f"{pool} spare(s) left, floor {self.floor}"
            actions += [Action("submit", None, why)] * max(0, missing - expected)
        return actions

    def pause(self, pool: int) -> None:
        """A request was given up with ``pool`` spares: ask for nothing more until the pool shrinks below that, or
        grows past it."""
        self._paused_at = pool if self._paused_at is None else min(self._paused_at, pool)
