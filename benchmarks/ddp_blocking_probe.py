"""How a plain DDP step on gloo fails when a peer dies or freezes (the evidence behind docs/your-loop.md).

3 processes, plain torch (no deadpool): DistributedDataParallel over the micro GPT, its own reducer (blocking gloo
all-reduce at the end of backward), process-group timeout ``--timeout``. At step 3 rank 2 either SIGKILLs itself
(``--how kill``) or SIGSTOPs itself (``--how stop``; SIGKILLed by the parent once the survivors have reported). Each
survivor reports how long its ``loss.backward()`` (or the next forward) took to raise, and what it raised.

    python benchmarks/ddp_blocking_probe.py --how kill
    python benchmarks/ddp_blocking_probe.py --how stop --timeout 10
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, world: int, port: int, how: str, timeout: float, q) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from deadpool_hpc.train.model import GPT, GPTConfig

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=dt.timedelta(seconds=timeout))
    torch.manual_seed(0)
    model = DDP(GPT(GPTConfig(n_layer=1, n_head=2, d_model=32, context=32)))
    opt = torch.optim.AdamW(model.parameters())
    for step in range(10**6):
        if step == 3 and rank == world - 1:
            q.put({"rank": rank, "pid": os.getpid(), "t_fault": time.time()})
            q.close()
            q.join_thread()   # the message is out before the signal
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        x = torch.randint(0, 256, (4, 32))
        t0 = time.time()
        try:
            _, loss = model(x, x)
            opt.zero_grad()
            loss.backward()
        except Exception as exc:  # noqa: BLE001 - what it raises is the result
            q.put({"rank": rank, "step": step, "t_raised": time.time(), "blocked_s": time.time() - t0,
                   "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"})
            return
        opt.step()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--how", choices=["kill", "stop"], default="kill")
    p.add_argument("--timeout", type=float, default=10.0)
    a = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    world = 3
    procs = [ctx.Process(target=worker, args=(r, world, port, a.how, a.timeout, q)) for r in range(world)]
    for pr in procs:
        pr.start()
    fault, out = None, []
    deadline = time.time() + a.timeout * 3 + 60
    while len(out) < world - 1 and time.time() < deadline:
        try:
            m = q.get(timeout=1)
        except Exception:  # noqa: BLE001 - queue.Empty
            continue
        if "t_fault" in m:
            fault = m
        else:
            out.append(m)
    if fault is not None:
        try:
            os.kill(fault["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pr in procs:
        pr.join(10)
        if pr.is_alive():
            pr.kill()
    for m in out:
        t = m.pop("t_raised")
        m["after_fault_s"] = round(t - fault["t_fault"], 3) if fault else None
        m["blocked_s"] = round(m["blocked_s"], 3)
    print(json.dumps({"how": a.how, "timeout_s": a.timeout, "survivors": out}, indent=1))


if __name__ == "__main__":
    main()
