"""The step's order around the protected state (worker/steps.py StepSequence): pure, in-process.

The writer is a recorder of the calls the sequence makes into the snapshot protocol (replica/writer.py is tested on
its own in test_desk.py and test_snapshot.py); the states are the real ones (``Protected`` over a real module and a
torch.optim optimizer, ``ShardedAdamW``)."""
from __future__ import annotations

import threading
import types

import pytest
import torch

from deadpool_hpc.worker.protect import Protected
from deadpool_hpc.worker.steps import NO_HOOKS, StepSequence, StepState
from deadpool_hpc.worker.zero import ShardedAdamW


class Writer:
    """Records the protocol calls (what ``SnapshotWriter`` would be asked), waits ``wait`` seconds per commit."""

    def __init__(self, wait: float = 0.0):
        self.calls: list[tuple] = []
        self.wait = wait

    def wait_committed(self, step, generation, failure, timeout, beat=None):
        self.calls.append(("wait", step, generation))
        return self.wait

    def claim_early(self, step, generation):
        self.calls.append(("claim", step, generation))

    def snapshot(self, step, tensors, rng, generation):
        self.calls.append(("snapshot", step, generation))
        return "inline"


def sequence(world_size=2, on_host=True, replicate=True, interleave=0, wait=0.0, generation=3):
    seq = StepSequence(world_size=world_size, replicate=replicate, interleave=interleave, wait_timeout=5.0,
                       generation=lambda: generation, failure=threading.Event(),
                       watch=types.SimpleNamespace(waited=0.0), beat=lambda: None)
    seq.hold(types.SimpleNamespace(on_host=on_host, state_tensors=lambda: [], hooks=None))
    seq.attach(Writer(wait))
    return seq


def ddp_step(seq):
    """What a DDP step of ``ctx.protect`` calls, in order: forward, commit wait before the gradient all-reduce,
    all-reduce done, optimizer pre-hook; then the loop's snapshot of the next step."""
    seq.forward_starts()
    seq.before_collective()
    seq.reduced()
    seq.before_update()
    seq.step += 1
    seq.snapshot()


def test_a_step_waits_before_the_all_reduce_and_the_update_claims_early_and_snapshots_the_next_step():
    seq = sequence()
    seq.step = 7
    ddp_step(seq)
    assert seq.writer.calls == [("wait", 7, 3), ("wait", 7, 3), ("claim", 8, 3), ("snapshot", 8, 3)]


def test_one_all_reduce_allows_one_early_claim():
    """A second opt.step() without a backward of its own waits for the commit again but claims nothing."""
    seq = sequence()
    ddp_step(seq)
    seq.step -= 1   # (a second update inside the same step function)
    seq.writer.calls.clear()
    seq.before_update()
    assert seq.writer.calls == [("wait", 0, 3)]


def test_a_forward_after_the_all_reduce_takes_the_claim_back():
    """The all-reduce of a step whose update did not come (a failed step recomputed) does not license the claim of
    the next forward's update."""
    seq = sequence()
    seq.reduced()
    seq.forward_starts()
    seq.before_update()
    assert seq.writer.calls == [("wait", 0, 3)]


def test_one_rank_claims_without_an_all_reduce():
    seq = sequence(world_size=1)
    seq.before_update()
    assert seq.writer.calls == [("wait", 0, 3), ("claim", 1, 3)]


def test_a_state_off_the_host_is_copied_by_the_writer_without_an_early_claim():
    seq = sequence(on_host=False)
    ddp_step(seq)
    assert [c[0] for c in seq.writer.calls] == ["wait", "wait", "snapshot"]


def test_interleaved_replication_waits_claims_and_snapshots_only_replicated_steps():
    """interleave_replication=2: steps 0, 1 replicate, 2, 3 do not. The update of step 1 claims nothing (step 2 is
    not replicated), the loop does not snapshot step 2, and the update of step 2 waits for nothing."""
    seq = sequence(interleave=2)
    seq.step = 1
    ddp_step(seq)
    assert seq.writer.calls == [("wait", 1, 3), ("wait", 1, 3)]
    seq.writer.calls.clear()
    ddp_step(seq)   # step 2 -> 3: not replicated
    assert seq.writer.calls == []
    assert [seq.replicating(s) for s in range(6)] == [True, True, False, False, True, True]


def test_replication_off_never_touches_the_writer():
    seq = sequence(replicate=False)
    ddp_step(seq)
    assert seq.writer.calls == []


def test_commit_waits_are_counted_as_waits_not_own_work():
    seq = sequence(wait=0.25)
    ddp_step(seq)
    assert seq.wait_s == pytest.approx(0.5) and seq.watch.waited == pytest.approx(0.5)


def test_both_state_kinds_are_step_states_and_start_without_hooks(local_group):
    model = torch.nn.Linear(4, 2)
    prot = Protected(1, model, torch.optim.AdamW(model.parameters()))
    zero = ShardedAdamW(torch.nn.Linear(4, 2), 1)
    for state in (prot, zero):
        assert isinstance(state, StepState)
        assert state.hooks is NO_HOOKS
    assert zero.local_nbytes == 0 and not zero.on_host and zero.loader_guard is None
    assert prot.local_nbytes > 0 and prot.on_host and not prot.sharded


def test_protect_s_optimizer_step_runs_the_update_s_part_of_the_sequence(local_group):
    """A real torch.optim step of a protected module calls the sequence (through its step pre-hook): the commit
    wait and, one rank, the early claim, before the update; the layout's dry step at protect() called nothing."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prot = Protected(1, model, opt)
    seq = sequence(world_size=1)
    seq.hold(prot)
    assert prot.hooks is seq
    prot.bind(0, None)
    before = model.weight.detach().clone()
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    assert seq.writer.calls == [("wait", 0, 3), ("claim", 1, 3)]
    assert not torch.equal(model.weight, before)   # the update ran after the hooks
    seq.step = 1
    seq.snapshot()
    assert seq.writer.calls[-1] == ("snapshot", 1, 3)


# ---- the context's surface (worker/context.py) -----------------------------------------------------------------------
def fake_context(world_size=1):
    from deadpool_hpc.config import RunConfig
    from deadpool_hpc.worker.context import Context

    sent = []
    client = types.SimpleNamespace(progress=types.SimpleNamespace(beat=lambda: None), on=lambda *a: None,
                                   send=lambda *a, **k: sent.append(a), wake=lambda: None)
    ctx = Context(RunConfig(nodes=world_size, spares=0, steps=4), client, groups=None, log=None, node=0, local=0)
    return ctx, sent


# docs/worker-contract.md's table, and what worker/entry.py reads after the training function
DOCUMENTED = {"rank", "world_size", "device", "process_group", "generation", "config", "protect", "device_mesh",
              "init_device_mesh", "watch", "step", "zero_adamw", "run"}
FOR_THE_ENTRY_POINT = {"exit_code", "attached", "refusal"}


def test_the_context_shows_the_training_function_only_what_the_contract_documents(local_group):
    ctx, _ = fake_context()
    public = {n for n in dir(ctx) if not n.startswith("_")}
    assert public == DOCUMENTED | FOR_THE_ENTRY_POINT
    assert ctx.step == 0 and ctx.rank is None and ctx.exit_code == 0 and not ctx.attached and ctx.refusal is None
