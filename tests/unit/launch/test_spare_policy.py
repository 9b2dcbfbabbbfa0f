"""The replacement-node policy (launch/spare_policy.py) over a fake clock and pool, and the config section that turns
it on (config.py ``replacement``)."""
from __future__ import annotations

import re

import pytest

from deadpool_hpc.config import RunConfig, only_under_slurm_batch, run_parameters
from deadpool_hpc.errors import ConfigError
from deadpool_hpc.launch.spare_policy import FAILED, GONE, JOINED, LEFT, RUNNING, Companion, SparePolicy


class Cluster:
    """A fake Slurm for the policy: every submit becomes a pending companion at the fake clock's time; the test
    moves the clock, the pool and the companions' states."""

    def __init__(self, policy: SparePolicy, pool: int):
        self.policy, self.pool, self.now = policy, pool, 0.0
        self.jobs: dict[str, Companion] = {}
        self.submitted = self.cancelled = 0

    def tick(self, dt: float = 1.0, ending: bool = False):
        self.now += dt
        acts = self.policy.decide(self.now, self.pool, self.jobs.values(), ending=ending)
        for a in acts:
            if a.kind == "submit":
                jid = str(100 + self.submitted)
                self.submitted += 1
                self.jobs[jid] = Companion(jid, self.now)
            else:
                self.cancelled += 1
                self.jobs[a.job_id] = Companion(a.job_id, self.jobs[a.job_id].submitted, GONE)
        return acts

    def outstanding(self) -> int:
        return sum(1 for c in self.jobs.values() if c.outstanding)

    def set(self, jid: str, state: str) -> None:
        self.jobs[jid] = Companion(jid, self.jobs[jid].submitted, state)


def test_nothing_happens_at_or_above_the_floor_or_with_floor_zero():
    assert SparePolicy(1, 30).decide(0.0, 1, []) == []
    assert SparePolicy(2, 30).decide(0.0, 3, []) == []
    assert SparePolicy(0, 30).decide(0.0, 0, []) == []   # off


def test_below_the_floor_one_companion_per_missing_spare_and_not_twice():
    c = Cluster(SparePolicy(2, 60), pool=2)
    assert c.tick() == []
    c.pool = 1
    acts = c.tick()
    assert [a.kind for a in acts] == ["submit"] and "1 spare(s) left, floor 2" in acts[0].reason
    assert c.tick() == [] and c.tick() == []   # one is outstanding: not asked again
    c.pool = 0
    assert [a.kind for a in c.tick()] == ["submit"] and c.outstanding() == 2


def test_a_storm_never_has_more_than_floor_outstanding():
    c = Cluster(SparePolicy(2, 60), pool=2)
    for pool in (1, 0, 0, 0, 0):   # losses faster than Slurm answers; the pool cannot go below 0
        c.pool = pool
        c.tick(0.1)
        assert c.outstanding() <= 2
    assert c.submitted == 2
    c.set("100", RUNNING)          # started, not in the pool yet: still expected, nothing more asked
    c.tick()
    assert c.submitted == 2


def test_pending_past_the_wait_is_cancelled_and_not_asked_again_until_a_new_loss():
    c = Cluster(SparePolicy(1, 30), pool=1)
    c.pool = 0
    c.tick()                       # submitted at t=1
    assert c.tick(28.9) == []      # t=29.9: still within the wait
    acts = c.tick(1.1)             # t=31
    assert [(a.kind, a.job_id) for a in acts] == [("cancel", "100")] and "not started within 30 s" in acts[0].reason
    for _ in range(5):             # the pool is as it was: the job goes on with what it has
        assert c.tick(30) == []
    assert c.submitted == 1


def test_after_a_give_up_a_grown_pool_then_a_new_loss_asks_again():
    c = Cluster(SparePolicy(1, 10), pool=0)
    c.tick()
    c.tick(20)                     # cancelled: paused at pool 0
    assert c.cancelled == 1
    c.pool = 1                     # a spare came back
    assert c.tick() == []
    c.pool = 0                     # and is lost again: a new loss
    assert [a.kind for a in c.tick()] == ["submit"]


def test_a_companion_ended_by_someone_else_is_not_asked_again_until_a_new_loss():
    c = Cluster(SparePolicy(1, 60), pool=0)
    c.tick()
    c.set("100", GONE)             # scancel by hand, or its node released itself
    assert c.tick() == [] and c.tick() == []
    c.pool = 1                     # a spare came back
    assert c.tick() == []
    c.pool = 0                     # and is lost: a new loss
    assert [a.kind for a in c.tick()] == ["submit"]


def test_the_end_of_a_joined_nodes_job_is_a_loss_not_a_request_given_up():
    c = Cluster(SparePolicy(1, 60), pool=0)
    c.tick()
    c.set("100", JOINED)
    c.pool = 1                     # its node joined the pool
    assert c.tick() == []
    c.set("100", LEFT)             # then that node was lost (promoted and crashed, say): its job ended
    c.pool = 0
    assert [a.kind for a in c.tick()] == ["submit"]   # asked again at once, no pause


def test_a_started_companion_is_not_cancelled_by_the_wait():
    c = Cluster(SparePolicy(1, 10), pool=0)
    c.tick()
    c.set("100", RUNNING)
    assert c.tick(100) == []


def test_a_joined_companion_counts_in_the_pool_not_as_outstanding():
    c = Cluster(SparePolicy(2, 10), pool=0)
    c.tick()
    assert c.submitted == 2
    c.set("100", JOINED)
    c.pool = 1                     # its node is a spare now
    assert c.tick() == []          # 1 missing, 1 outstanding (101)


def test_a_node_that_failed_its_checks_is_released_and_replaced():
    c = Cluster(SparePolicy(1, 60), pool=0)
    c.tick()
    c.set("100", FAILED)
    acts = c.tick()
    assert [(a.kind, a.job_id) for a in acts] == [("cancel", "100"), ("submit", None)]
    assert "failed its checks" in acts[0].reason


def test_at_the_end_every_live_companion_is_cancelled_and_nothing_submitted():
    c = Cluster(SparePolicy(2, 60), pool=0)
    c.tick()
    c.set("100", RUNNING)
    acts = c.tick(ending=True)
    assert sorted((a.kind, a.job_id) for a in acts) == [("cancel", "100"), ("cancel", "101")]
    assert c.tick(ending=True) == []   # all gone


@pytest.mark.parametrize("floor, wait, needle", [(-1, 10, "spare floor -1"), (True, 10, "spare floor True"),
                                                 (1, 0, "spare wait 0"), (1, float("nan"), "spare wait nan")])
def test_the_policy_refuses_bad_numbers(floor, wait, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        SparePolicy(floor, wait)
    with pytest.raises(ValueError, match="state 'queued': accepted: pending"):
        Companion("1", 0.0, "queued")


# ---- the config section --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, needle", [
    (dict(spare_floor=-1), "--spare-floor -1: accepted: an integer >= 0"),
    (dict(spare_floor=1.5), "--spare-floor 1.5: accepted: an integer >= 0"),
    (dict(spare_wait=0), "--spare-wait 0: accepted: seconds > 0"),
    (dict(spare_wait=float("inf")), "--spare-wait inf: accepted: seconds > 0"),
])
def test_the_replacement_section_names_bad_values(kwargs, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        RunConfig(**kwargs).validate()


def test_the_section_is_derived_everywhere_and_refused_outside_a_slurm_batch_job():
    cfg = RunConfig(spare_floor=2, spare_wait=45).validate()
    assert (cfg.replacement.spare_floor, cfg.replacement.spare_wait) == (2, 45)
    assert RunConfig.from_json(cfg.to_json()).replacement == cfg.replacement
    params = run_parameters()
    assert params["spare_floor"][0](0) and not params["spare_floor"][0](-1) and not params["spare_wait"][0](0)
    only_under_slurm_batch(RunConfig(), "deadpool run (local)")   # 0: off, accepted anywhere
    with pytest.raises(ConfigError, match=re.escape("--spare-floor 2 with deadpool run (local): replacement nodes "
                                                    "are Slurm jobs")):
        only_under_slurm_batch(cfg, "deadpool run (local)")


def test_the_cli_offers_the_options():
    import argparse

    from deadpool_hpc.launch.options import add_run_options, options_markdown

    p = argparse.ArgumentParser()
    add_run_options(p)
    a = p.parse_args(["--spare-floor", "1", "--spare-wait", "20"])
    assert (a.spare_floor, a.spare_wait) == (1, 20.0)
    assert "- `--spare-floor K`" in options_markdown() and "- `--spare-wait SECONDS`" in options_markdown()
