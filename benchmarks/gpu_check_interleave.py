"""Case c of benchmarks/gpu_check.sh: step time with replication on and off, interleaved in ONE run.

One ``deadpool`` run (the product's local launcher, ``LocalExecutor``) alternates blocks of ``--block`` K steps with
replication on and off (``RunConfig.interleave_replication``, the internal section's benchmark knob: steps 0..K-1
on, K..2K-1 off, ...), so both phases see the same processes, the same GPU and the same moment. The step times are
rank 0's ``step`` events (``step_s``) past ``--warmup``; the phase of the step with 1-based index ``n`` is on when
``(n - 1) // K`` is even (worker/steps.py ``StepSequence.replicating``; benchmarks/overhead.py reads them the same
way). Prints the median step time of each phase and their ratio, on / off (goal <= 1.01), and writes them to
``--out`` (JSON) for gpu_check.sh's table.

    .venv/bin/python -m benchmarks.gpu_check_interleave                 # the ~1 B-parameter model, NCCL (a GPU)
    .venv/bin/python -m benchmarks.gpu_check_interleave --tiny          # a tiny model on the CPU (gloo): the plumbing

The ~1 B model: examples/fsdp2_gpt.py with 20 layers of d_model 2048 (12 * 20 * 2048^2 = 1.0e9 parameters), FSDP2
with bf16 compute parameters (MixedPrecisionPolicy) and fp32 parameters and AdamW state in the shards, 2 nodes, no
spare. WRITTEN, NOT RUN ON A DEVICE for the ~1 B case; ``--tiny`` runs here (tests/e2e/test_gpu_check.py).
Exit 0 when the run completed (whatever the ratio: gpu_check.sh judges it), 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

BIG = dict(n_layer=20, d_model=2048, n_head=16, context=256, batch_size=4, micro_batches=1, bf16=1)
TINY = dict(n_layer=1, d_model=32, n_head=2, context=16, batch_size=2, micro_batches=1, bf16=0)


def phases(events, block: int, warmup: int) -> dict[str, list[float]]:
    """{"on": [step seconds], "off": [...]}: rank 0's ``step`` events (``step`` is 1-based) past ``warmup``, split
    by the replication phase of blocks of ``block`` steps (the first block on)."""
    out: dict[str, list[float]] = {"on": [], "off": []}
    for e in events:
        if e.get("event") == "step" and e["step"] > warmup and (e.get("rank") in (None, 0)):
            out["on" if ((e["step"] - 1) // block) % 2 == 0 else "off"].append(e["step_s"])
    return out


def medians(split: dict[str, list[float]]) -> dict:
    """The medians of each phase (seconds), their ratio on / off and the counts; ValueError when a phase is empty."""
    if not split["on"] or not split["off"]:
        raise ValueError(f"a phase has no step past the warm-up (on: {len(split['on'])}, off: {len(split['off'])}): "
                         f"accepted: --steps larger than --warmup + 2 blocks")
    on, off = statistics.median(split["on"]), statistics.median(split["off"])
    return {"on_s": on, "off_s": off, "ratio": on / off, "on_steps": len(split["on"]), "off_steps": len(split["off"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU with gloo (the plumbing, not the figure)")
    ap.add_argument("--block", type=int, default=5, help="K: steps per on / off block (default 5)")
    ap.add_argument("--steps", type=int, default=None, help="steps of the run (default 60; --tiny 40)")
    ap.add_argument("--warmup", type=int, default=10, help="steps left out at the start (default 10)")
    ap.add_argument("--run-dir", default=None, help="the run's directory (default: a temporary one, kept)")
    ap.add_argument("--out", default=None, help="also write the result here (JSON)")
    ap.add_argument("--timeout", type=float, default=480.0, help="seconds the run may take (default 480)")
    a = ap.parse_args(argv)
    from deadpool_hpc.config import RunConfig
    from deadpool_hpc.events import read_events
    from deadpool_hpc.launch import LocalExecutor

    steps = a.steps or (40 if a.tiny else 60)
    run_dir = a.run_dir or tempfile.mkdtemp(prefix="gpu-check-c.")
    cfg = RunConfig(nodes=2, spares=0, steps=steps, backend="gloo" if a.tiny else "nccl",
                    train_fn="examples.fsdp2_gpt:train", train_args=TINY if a.tiny else BIG,
                    interleave_replication=a.block, run_dir=run_dir).validate()
    summary = LocalExecutor(timeout=a.timeout).run(cfg)
    result = {"completed": bool(summary.get("completed")), "block": a.block, "steps": steps, "warmup": a.warmup,
              "model": "tiny" if a.tiny else "~1B", "backend": cfg.layout.backend, "run_dir": run_dir}
    try:
        result.update(medians(phases(read_events(os.path.join(run_dir, "events.jsonl")), a.block, a.warmup)))
    except (OSError, ValueError) as exc:
        result["error"] = str(exc)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(result, fh)
    if "ratio" in result:
        print(f"gpu_check c: one run, blocks of {a.block} steps, replication on {result['on_s'] * 1e3:.1f} ms / off "
              f"{result['off_s'] * 1e3:.1f} ms (medians of {result['on_steps']} / {result['off_steps']} steps) = "
              f"{result['ratio']:.3f} (goal <= 1.01); run {run_dir}")
    else:
        print(f"gpu_check c: no ratio: {result.get('error')}; completed {result['completed']}; run {run_dir}")
    return 0 if result["completed"] and "ratio" in result else 1


if __name__ == "__main__":
    sys.exit(main())
