"""Training functions for the end-to-end tests (``--train-fn trainfns:NAME`` with this folder on PYTHONPATH).

Each is an ordinary user function (docs/worker-contract.md) with one twist the test needs.
"""
from __future__ import annotations

import os
import sys
import time

import torch

from deadpool_hpc.train.demo import train as demo_train


def frozen_rank2(ctx) -> None:
    """The demo, but training rank 2's training thread sleeps "for ever" at step ``DEADPOOL_TEST_FREEZE_STEP``
    (default 25), once per run (a marker file in the run directory): its process and heartbeat thread stay
    alive, only its progress stops (issue 11, item 2)."""
    freeze_at = int(os.environ.get("DEADPOOL_TEST_FREEZE_STEP", "25"))
    marker = os.path.join(ctx.config.output.run_dir, "froze")

    run = ctx.run

    def run_frozen(step_fn):
        def step(s: int):
            if s == freeze_at and ctx.rank == 2 and not os.path.exists(marker):
                open(marker, "w").close()
                time.sleep(10**6)
            return step_fn(s)
        run(step)

    ctx.run = run_frozen
    demo_train(ctx)


def waiting_for_a_peer_that_never_answers() -> None:
    """Where why_it_failed's hang happens: a name the test looks for in the stack and in ``deadpool status``."""
    while True:
        time.sleep(0.05)


def why_it_failed(ctx) -> None:
    """The demo, with training rank 1 failing twice, once each way (marker files in the run directory): at step
    ``DEADPOOL_TEST_EXIT_STEP`` (default 6) it writes a message to stderr and exits with code 3, as a native library
    that gives up does; at step ``DEADPOOL_TEST_HANG_STEP`` (default 18) its training thread stays for ever inside
    ``waiting_for_a_peer_that_never_answers``."""
    exit_at = int(os.environ.get("DEADPOOL_TEST_EXIT_STEP", "6"))
    hang_at = int(os.environ.get("DEADPOOL_TEST_HANG_STEP", "18"))
    exited, hung = (os.path.join(ctx.config.output.run_dir, name) for name in ("exited-once", "hung-once"))
    run = ctx.run

    def run_failing(step_fn):
        def step(s: int):
            if ctx.rank == 1 and s == exit_at and not os.path.exists(exited):
                open(exited, "w").close()
                print("loader: reading shard 7", file=sys.stderr)
                print("fatal: shard 7 is corrupt (checksum mismatch); giving up", file=sys.stderr, flush=True)
                os._exit(3)
            if ctx.rank == 1 and s == hang_at and not os.path.exists(hung):
                open(hung, "w").close()
                waiting_for_a_peer_that_never_answers()
            return step_fn(s)
        run(step)

    ctx.run = run_failing
    demo_train(ctx)


def paced(ctx) -> None:
    """The demo, with each step lasting at least ``DEADPOOL_TEST_STEP_S`` seconds (a sleep before it): a run
    whose length in seconds the test knows, whatever the machine's speed."""
    pace = float(os.environ.get("DEADPOOL_TEST_STEP_S", "0.25"))
    run = ctx.run

    def run_paced(step_fn):
        def step(s: int):
            time.sleep(pace)
            return step_fn(s)
        run(step)

    ctx.run = run_paced
    demo_train(ctx)


def heavy_rank2(ctx) -> None:
    """The demo, with training rank 2 doing more work in each step than the others: ``DEADPOOL_TEST_EXTRA_MM``
    (default 600) products of 256 x 256 matrices before it, ~0.15-0.3 s on these cores (its own work, as a rank with
    longer sequences or a bigger shard would; CPU work, not a sleep, so that a busy machine slows it as much as the
    others' steps): slowness that follows the rank to whichever node holds it. The parameters are the demo's."""
    n = int(os.environ.get("DEADPOOL_TEST_EXTRA_MM", "600"))
    a = torch.full((256, 256), 1e-3)
    run = ctx.run

    def run_heavy(step_fn):
        def step(s: int):
            if ctx.rank == 2:
                for _ in range(n):
                    torch.mm(a, a)
            return step_fn(s)
        run(step)

    ctx.run = run_heavy
    demo_train(ctx)


def big_mlp(ctx) -> None:
    """A 2-layer MLP whose ZeRO-1 state (parameter shard + 2 AdamW moments) is ``DEADPOOL_TEST_STATE_MB`` MB per
    rank (default 200): a real-size replica, with little compute per step."""
    mb = float(os.environ.get("DEADPOOL_TEST_STATE_MB", "200"))
    shard = int(mb * 2**20 / 12)                 # 3 float32 tensors of `shard` elements
    total = shard * ctx.world_size
    width = 64
    hidden = max(1, total // (2 * width))
    torch.manual_seed(1337)
    model = torch.nn.Sequential(torch.nn.Linear(width, hidden, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(hidden, width, bias=False))
    opt = ctx.zero_adamw(model, lr=1e-3)

    def step(s: int) -> dict:
        g = torch.Generator().manual_seed(s * 1000 + ctx.rank)
        x = torch.randn(4, width, generator=g)
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        return {"loss": opt.step(s, loss)}

    ctx.run(step)


def abort_rank1(ctx) -> None:
    """The demo, but training rank 1's process calls ``os.abort()`` (SIGABRT, a native crash) when it reaches step
    ``DEADPOOL_TEST_ABORT_STEP`` (default 50), every time, on whichever node holds rank 1: a crash that follows the
    work (a bad batch), not the node."""
    abort_at = int(os.environ.get("DEADPOOL_TEST_ABORT_STEP", "50"))
    run = ctx.run

    def run_aborting(step_fn):
        def step(s: int):
            if s == abort_at and ctx.rank == 1:
                os.abort()
            return step_fn(s)
        run(step)

    ctx.run = run_aborting
    demo_train(ctx)


def cuda_unusable_rank1(ctx) -> None:
    """The demo, but training rank 1's process finds its CUDA context unusable at step ``DEADPOOL_TEST_UNUSABLE_STEP``
    (default 10), once per run (a marker file in the run directory): it raises DeviceUnusable, as
    dataplane/groups.py's ``abandon`` does after an NCCL abort on a GPU, and so exits with CUDA_UNUSABLE_EXIT
    (worker/entry.py). The exit code's handling, on the CPU."""
    from deadpool_hpc.dataplane.backend import DeviceUnusable

    at = int(os.environ.get("DEADPOOL_TEST_UNUSABLE_STEP", "10"))
    marker = os.path.join(ctx.config.output.run_dir, "unusable")
    run = ctx.run

    def run_unusable(step_fn):
        def step(s: int):
            if s == at and ctx.rank == 1 and not os.path.exists(marker):
                open(marker, "w").close()
                raise DeviceUnusable("the CUDA context of cuda:1 is unusable after the NCCL abort (test)")
            return step_fn(s)
        run(step)

    ctx.run = run_unusable
    demo_train(ctx)
