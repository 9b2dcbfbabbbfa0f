"""GPU path check for one CUDA device: what one GPU can show of the GPU path (written, and ready for a GPU machine).

1. **Side-stream snapshot**: a model of about ``--params`` parameters (default 1e9, fp32, AdamW) trains for
   ``--steps`` steps twice, interleaved in ``--rounds`` rounds: without snapshots, and with the unique state
   (parameters + both AdamW moments) copied device-to-host after each step into a *pinned shared-memory* buffer
   (``ipc/shm.py``: memfd + ``cudaHostRegister``), on a side CUDA stream that waits on an event recorded after
   the optimizer step, overlapped with the next forward/backward; the next optimizer step waits for the copy
   (the update may not overwrite what is being copied). Prints the on/off step-time ratio (median of per-round
   ratios) and the copy's bandwidth. The copy is checked: the host bytes equal the device state of that step.
2. **NCCL abort + re-init**: world size 1, ``GenerationGroups(backend="nccl")`` joins generation g through a
   store (the unique id travels through it, as through the node agents' store), runs an all-reduce, is aborted
   (``ProcessGroupNCCL.abort``) and generation g+1 is built; prints the abort and re-init times (medians).

Usage: ``bash benchmarks/gpu_check.sh`` (under 8 minutes on one H200 with the defaults). Without CUDA it runs
part 1's code path on the CPU with a tiny model (a self-test of the script; no ratio is meaningful) and skips
part 2. Exit status: 0 when every check passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deadpool_hpc.ipc.shm import SharedBuffer  # noqa: E402


def model_of(params: float, device) -> torch.nn.Module:
    """A stack of square Linear layers (width 4096, or smaller for a tiny model) with about ``params`` weights."""
    width = 4096 if params >= 4096 * 4096 * 2 else 256
    layers = max(1, int(params // (width * width + width)))
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*mods).to(device)


class SideStreamSnapshot:
    """Copies a list of device tensors into one pinned shared buffer on a side stream (GPU), or synchronously
    (CPU). ``start()`` after the optimizer step; ``wait()`` before the next optimizer step."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.buf = SharedBuffer.create(self.nbytes, "deadpool-gpu-check")
        self.cuda = tensors[0].is_cuda
        self.pinned = self.buf.pin() if self.cuda else False
        self.views, off = [], 0
        for t in tensors:
            n = t.numel() * t.element_size()
            self.views.append(self.buf.tensor[off:off + n].view(t.dtype).view(t.shape))
            off += n
        self.stream = torch.cuda.Stream() if self.cuda else None
        self.done = None
        self.copy_s: list[float] = []

    def start(self) -> None:
        if not self.cuda:
            t = time.perf_counter()
            for v, x in zip(self.views, self.tensors):
                v.copy_(x)
            self.copy_s.append(time.perf_counter() - t)
            return
        ready = torch.cuda.Event()
        ready.record()                        # after the optimizer step on the compute stream
        self.stream.wait_event(ready)
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            t0.record()
            for v, x in zip(self.views, self.tensors):
                v.copy_(x, non_blocking=True)
            t1.record()
        self.done = (t0, t1)

    def wait(self) -> None:
        if self.done is not None:
            torch.cuda.current_stream().wait_stream(self.stream)  # the update must not overwrite what is copied
            t0, t1 = self.done
            t1.synchronize()
            self.copy_s.append(t0.elapsed_time(t1) / 1000.0)
            self.done = None

    def close(self) -> None:
        self.buf.close()  # unpins (cudaHostUnregister) and unmaps


def train(model, opt, steps: int, batch: torch.Tensor, snap: SideStreamSnapshot | None) -> float:
    """Seconds per step (median) over ``steps`` steps."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        loss = model(batch).float().pow(2).mean()
        loss.backward()
        if snap is not None:
            snap.wait()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if snap is not None:
            snap.start()
        if batch.is_cuda:  # the compute stream only: the snapshot's copy runs on into the next step
            torch.cuda.current_stream().synchronize()
        times.append(time.perf_counter() - t)
    if snap is not None:
        snap.wait()
    return statistics.median(times[1:] if len(times) > 2 else times)


def state_tensors(model, opt) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        st = opt.state[p]
        out += [p.data, st["exp_avg"], st["exp_avg_sq"]]
    return out


def check_snapshot(args, device) -> bool:
    params = args.params if device.type == "cuda" else 2e5
    model = model_of(params, device)
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    width = model[0].in_features
    batch = torch.randn(args.batch, width, device=device)
    train(model, opt, 2, batch, None)  # warm-up; creates the AdamW state
    snap = SideStreamSnapshot(state_tensors(model, opt))
    print(f"[snapshot] model {n / 1e9:.3f} B parameters on {device}; unique state {snap.nbytes / 2**30:.2f} GiB "
          f"per step into a shared buffer (pinned: {snap.pinned})", flush=True)
    ratios = []
    for r in range(args.rounds):
        off = train(model, opt, args.steps, batch, None)
        on = train(model, opt, args.steps, batch, snap)
        ratios.append(on / off)
        print(f"[snapshot] round {r}: step {off * 1e3:.1f} ms off, {on * 1e3:.1f} ms on, ratio {on / off:.3f}",
              flush=True)
    # correctness: the host copy of the last step equals the device state now (no step ran since)
    ok = all(torch.equal(v.cpu() if v.is_cuda else v, x.detach().cpu()) for v, x in zip(snap.views, snap.tensors))
    bw = snap.nbytes / statistics.median(snap.copy_s) / 1e9 if snap.copy_s else float("nan")
    print(f"[snapshot] on/off step-time ratio: median {statistics.median(ratios):.3f} over {len(ratios)} rounds; "
          f"copy {statistics.median(snap.copy_s) * 1e3:.1f} ms ({bw:.1f} GB/s); host copy equals device state: {ok}",
          flush=True)
    snap.close()
    return ok


def check_nccl(args) -> bool:
    import torch.distributed as dist

    from deadpool_hpc.dataplane.groups import GenerationGroups

    os.environ.setdefault("LOCAL_RANK", "0")
    groups = GenerationGroups(backend="nccl", timeout=60.0, rendezvous_timeout=60.0)
    dev = torch.device("cuda", 0)
    store = dist.HashStore()  # world size 1: the unique id goes through the store, as through the agents' store
    inits, aborts, ok = [], [], True
    for g in range(args.nccl_rounds):
        t = time.perf_counter()
        groups.join(g, store, 0, 1)
        x = torch.ones(1 << 20, device=dev)
        dist.all_reduce(x)
        torch.cuda.synchronize()
        inits.append(time.perf_counter() - t)
        ok = ok and bool(x[0].item() == 1.0)
        t = time.perf_counter()
        groups.abandon()  # ProcessGroupNCCL.abort(), registry cleared
        aborts.append(time.perf_counter() - t)
        print(f"[nccl] generation {g}: init + first all-reduce {inits[-1] * 1e3:.1f} ms, abort "
              f"{aborts[-1] * 1e3:.1f} ms", flush=True)
    print(f"[nccl] medians: re-init {statistics.median(inits[1:] or inits) * 1e3:.1f} ms (first {inits[0] * 1e3:.1f} "
          f"ms), abort {statistics.median(aborts) * 1e3:.1f} ms; all-reduce correct: {ok}", flush=True)
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=1e9, help="model parameters (default 1e9)")
    ap.add_argument("--batch", type=int, default=64, help="rows per batch (default 64)")
    ap.add_argument("--steps", type=int, default=10, help="steps per measurement (default 10)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved on/off rounds (default 3)")
    ap.add_argument("--nccl-rounds", type=int, default=5, help="NCCL generations built and aborted (default 5)")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    print(f"torch {torch.__version__}, cuda {torch.version.cuda}, device "
          f"{torch.cuda.get_device_name(0) if cuda else 'none (CPU self-test of the script)'}", flush=True)
    ok = check_snapshot(a, torch.device("cuda", 0) if cuda else torch.device("cpu"))
    if cuda:
        ok = check_nccl(a) and ok
    else:
        print("[nccl] skipped: no CUDA device", flush=True)
    print("GPU CHECK " + ("PASSED" if ok else "FAILED"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
