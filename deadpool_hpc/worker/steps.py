"""The order of one training step around the protected state, and what the step loop asks of that state.

Owns: the per-step sequence of the snapshot protocol on the worker's side (replica/writer.py describes the protocol):
for the state at the start of step s,

1. *wait committed*: before the first collective of the step (DDP's gradient all-reduce, FSDP2's first all-gather),
   wait until the agent says every holder acknowledged snapshot s (``before_collective``);
2. *all-reduce*: the state reports that the step's gradient all-reduce completed (``reduced``); the forward of the
   next step clears that (``forward_starts``);
3. *claim*: before the update, wait committed again (the ZeRO step has no collective before it) and, once this step's
   all-reduce completed (every rank's snapshot s is committed), claim the slot of snapshot s + 1 early, so that the
   grant comes while the optimizer updates (``before_update``);
4. *update*: the user's optimizer step (not here);
5. *snapshot*: after the step, copy the state at the start of step s + 1 into the agent's slot (``snapshot``: the one
   call site of the copy).

Does not own: the slots and the copy itself (replica/writer.py), the state (worker/protect.py, worker/zero.py), the
step loop and recovery (worker/context.py, worker/recovery.py).

``StepState`` is the protocol both ``ctx.protect``'s state (``Protected``) and ``ctx.zero_adamw``'s optimizer
(``ShardedAdamW``) implement; ``StepHooks`` is what they call back during a step (``StepSequence``, or ``NO_HOOKS``
for a state driven without a context, as in unit tests).
"""
from __future__ import annotations

import threading
from typing import Callable, Protocol, runtime_checkable

import torch


class StepHooks(Protocol):
    """What a protected state calls during a training step (``StepSequence``)."""

    def forward_starts(self) -> None: ...

    def before_collective(self) -> None: ...

    def reduced(self) -> None: ...

    def before_update(self) -> None: ...


class _NoHooks:
    """The hooks of a state driven without a context: nothing to wait for, nothing to claim."""

    def forward_starts(self) -> None:
        pass

    def before_collective(self) -> None:
        pass

    def reduced(self) -> None:
        pass

    def before_update(self) -> None:
        pass


NO_HOOKS: StepHooks = _NoHooks()


@runtime_checkable
class StepState(Protocol):
    """What ``ctx.protect`` and ``ctx.zero_adamw`` hand to the step loop.

    ``hooks``: set by the context (a ``StepSequence``); ``local_nbytes``: bytes of the payload's local prefix (kept in
    the node's slot, never sent; 0: none); ``on_host``: the state lives in host memory, so its snapshot is a memory
    copy worth doing at once after the update (an early claim); ``sharded``: the state's tensors are this rank's
    shards of the model as built (FSDP2), so a process built as another rank cannot rebuild this rank's initial
    state; ``loader_guard``: the protected data loader's guard (worker/state/loader.py), or None."""

    hooks: StepHooks
    local_nbytes: int
    on_host: bool
    sharded: bool
    loader_guard: object | None

    def bind(self, rank: int, watch, from_replica: bool = False, kept: list[bool] | None = None) -> None:
        """This process is now training rank ``rank``; ``from_replica``: the state restored next is a replica its source
        sent; ``kept``: which kept regions a checkpoint's record says are this rank's."""

    def layout_tensors(self) -> list[torch.Tensor]:
        """Tensors of the payload's dtypes and shapes, in payload order (the slots are sized from them)."""

    def state_tensors(self) -> list:
        """The current state, in payload order (tensors, or lists of 1-D uint8 pieces)."""

    def restore_targets(self) -> list[torch.Tensor]:
        """Where a payload is read into before ``gather`` applies it."""

    def gather(self) -> None:
        """Apply the payload read into ``restore_targets()`` (a collective every rank joins)."""

    def end_of_run(self) -> None:
        """(every rank, after the last step) Whatever the final digest needs from the other ranks."""

    def param_digest(self) -> str:
        """sha256 (hex) over the final parameters."""


class StepSequence:
    """The step's order around the state (module docstring). ``step``: the current step (the state holds ``step``
    updates); ``generation``: a callable giving the current generation; ``failure``: the flag a peer's failure sets;
    ``watch``: the Watch the step's collectives wait under (its ``waited`` gets the commit waits); ``beat``: the
    progress page's beat (a wait is progress). ``replicate``/``interleave``: RunConfig's ``replicate`` and
    ``interleave_replication``; ``wait_timeout``: seconds a commit may take. ``writer`` (replica/writer.py) and
    ``state`` (a ``StepState``) are set by the context (``attach``, ``hold``)."""

    def __init__(self, *, world_size: int, replicate: bool, interleave: int, wait_timeout: float,
                 generation: Callable[[], int], failure: threading.Event, watch, beat: Callable[[], None]):
        self.world_size = world_size
        self.replicate, self.interleave = replicate, interleave
        self.wait_timeout = wait_timeout
        self.generation = generation
        self.failure, self.watch, self.beat = failure, watch, beat
        self.step = 0
        self.wait_s = 0.0        # seconds waited for commits
        self.state: StepState | None = None
        self.writer = None
        self._reduced = False    # this step's gradient all-reduce completed

    def hold(self, state: StepState) -> None:
        """Drive ``state``: it calls this sequence's hooks from now on."""
        self.state = state
        state.hooks = self

    def attach(self, writer) -> None:
        """The snapshot protocol's side of this process (replica/writer.py), once its slots exist."""
        self.writer = writer

    def replicating(self, step: int) -> bool:
        """Whether the state at the start of ``step`` is snapshotted and replicated: with replication on, every step,
        except in the off blocks of a benchmark's ``interleave_replication``."""
        k = self.interleave
        return self.replicate and (not k or (step // k) % 2 == 0)

    # ---- hooks: called by the state during the step ----------------------------------------------------------------
    def forward_starts(self) -> None:
        """A forward begins: no gradient all-reduce of this step has completed yet."""
        self._reduced = False

    def before_collective(self) -> None:
        """(1) Before the step's first collective: snapshot ``step`` must be committed at its holders."""
        self.wait_committed()

    def reduced(self) -> None:
        """(2) This step's gradient all-reduce completed."""
        self._reduced = True

    def before_update(self) -> None:
        """(3) Before the optimizer updates: the snapshot of the current state must be committed; past this step's
        all-reduce every rank's is (or there is one rank), so the slot of the next snapshot is claimed now. One
        all-reduce allows one early claim (an update with no backward of its own, e.g. a second ``opt.step()``,
        claims nothing)."""
        self.wait_committed()
        if self._reduced or self.world_size == 1:
            self._reduced = False
            self.claim_next()

    # ---- the loop's side ---------------------------------------------------------------------------------------------
    def wait_committed(self) -> None:
        """Until the agent says every holder acknowledged snapshot ``step`` of this generation (nothing to wait for
        when that step is not replicated). Raises PeerFailure on failure or timeout."""
        if not self.replicating(self.step):
            return
        waited = self.writer.wait_committed(self.step, self.generation(), self.failure, self.wait_timeout,
                                            beat=self.beat)
        self.wait_s += waited
        self.watch.waited += waited   # waiting for a holder is not this rank's own work

    def claim_next(self) -> None:
        """Claim the slot of the next step's snapshot now (a state in host memory only: ``StepState.on_host``): the
        grant comes while the optimizer updates, and ``snapshot`` then copies at once on this thread."""
        nxt = self.step + 1
        if self.replicating(nxt) and self.state.on_host:
            self.writer.claim_early(nxt, self.generation())

    def snapshot(self) -> None:
        """(5) Snapshot the state at the start of ``step`` into the agent's shared slot (replica/writer.py). With the
        slot already granted (``claim_next``) the copy is done here, at once: the state the optimizer just wrote is
        still in cache, and a copy running beside the next forward and backward slowed them down more than it cost
        itself (on 2 shared cores: +10 ms of the training thread's CPU per step of the micro GPT against +2 ms;
        docs/architecture.md's overhead paragraph describes the measurement). Otherwise the writer's copy thread
        claims, copies and says so."""
        if self.replicating(self.step):
            self.writer.snapshot(self.step, self.state.state_tensors(), torch.get_rng_state(), self.generation())
