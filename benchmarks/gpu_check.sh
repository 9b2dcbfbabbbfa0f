#!/usr/bin/env bash
# The device check: runs the product itself (`deadpool run`, the CLI a user runs) on whatever GPUs this machine has
# and prints one table. Run from anywhere on a machine with CUDA:
#     bash benchmarks/gpu_check.sh            # PYTHON=... to use another interpreter (default: .venv/bin/python)
# Without CUDA it says so and exits 0, having run nothing (tests/e2e/test_gpu_check.py checks that here).
#
# Cases (docs/gpu.md):
#   a  one GPU, --backend nccl, 2 nodes + 1 spare (three processes on the GPU, each its own communicator): the
#      failure-free run, then a kill and a hang of node1; each must hot-swap and end with the failure-free digest
#      (2 active nodes, not 1: a rank's replica lives on another active node, so hot swap needs 2)
#   b  one GPU, --backend gloo, three training processes whose state is CUDA tensors (benchmarks/gpu_check_train.py):
#      a kill, digest equal to the failure-free run (the device snapshot and restore with several ranks)
#   c  step time with replication on and off, a ~1 B-parameter FSDP2 model (bf16 compute parameters, fp32 Adam
#      state; examples/fsdp2_gpt.py), goal <= 1.01. `deadpool run` has no option to interleave on and off blocks in
#      one run (RunConfig.interleave_replication is set by benchmarks/overhead.py), so the runs alternate: on, off,
#      on, off; the ratio is the median step time of the on runs over the off runs'
#   d  two GPUs or more: --backend nccl across them (2 nodes x 2 ranks + 1 spare), a kill and a hang
# Budget: 8 minutes on one GPU: 9 runs of 20-40 s each; each has its own `timeout` (570 s if every one ran to it). Exit 0 when every row passed, 1 otherwise.
# WRITTEN, NOT RUN ON A DEVICE: no GPU was available where it was written.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 1)' \
        2>/dev/null; then
    echo "gpu_check: skipped: no CUDA device here (torch.cuda.is_available() is false); nothing was run"
    exit 0
fi
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
OUT=${GPU_CHECK_DIR:-$(mktemp -d /tmp/gpu-check.XXXXXX)}
mkdir -p "$OUT"
echo "gpu_check: $GPUS GPU(s); runs under $OUT"
"$PY" -c 'import torch; print("gpu_check: torch", torch.__version__, "CUDA", torch.version.cuda, "NCCL",
          ".".join(map(str, torch.cuda.nccl.version())), "on", torch.cuda.get_device_name(0))'

# run NAME SECONDS ARGS...: one `deadpool run`, its summary in $OUT/NAME.json, its exit status in $OUT/NAME.rc
run() {
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$PY" -m deadpool_hpc.launch.cli run --run-dir "$OUT/$name" --summary "$OUT/$name.json" "$@" \
        > "$OUT/$name.log" 2>&1
    echo $? > "$OUT/$name.rc"
}

SMALL=(--steps 60 --hang-timeout 20 --collective-timeout 30)
# a: NCCL on one GPU
run a-free 60 --backend nccl --nodes 2 --spares 1 "${SMALL[@]}"
run a-kill 60 --backend nccl --nodes 2 --spares 1 "${SMALL[@]}" --kill node1@30
run a-hang 90 --backend nccl --nodes 2 --spares 1 "${SMALL[@]}" --hang node1@30
# b: gloo over CUDA tensors, three training processes
GT=(--train-fn benchmarks.gpu_check_train:train)
run b-free 60 --backend gloo --nodes 3 --spares 1 "${GT[@]}" "${SMALL[@]}"
run b-kill 60 --backend gloo --nodes 3 --spares 1 "${GT[@]}" "${SMALL[@]}" --kill node1@30
# c: replication on / off, ~1 B parameters (12 * 20 layers * 2048^2 = 1.0e9), alternated
BIG=(--backend nccl --nodes 2 --spares 0 --steps 30 --train-fn examples.fsdp2_gpt:train --train-arg n_layer=20
     --train-arg d_model=2048 --train-arg n_head=16 --train-arg context=256 --train-arg batch_size=4
     --train-arg micro_batches=1 --train-arg bf16=1)
for i in 1 2; do
    run "c-on$i" 60 "${BIG[@]}"
    run "c-off$i" 60 "${BIG[@]}" --no-replicate
done
# d: NCCL across GPUs
if [ "$GPUS" -ge 2 ]; then
    run d-free 90 --backend nccl --nodes 2 --ranks-per-node 2 --spares 1 "${SMALL[@]}"
    run d-kill 90 --backend nccl --nodes 2 --ranks-per-node 2 --spares 1 "${SMALL[@]}" --kill node1@30
    run d-hang 120 --backend nccl --nodes 2 --ranks-per-node 2 --spares 1 "${SMALL[@]}" --hang node1@30
fi

"$PY" - "$OUT" "$GPUS" <<'EOF'
import json, os, statistics, sys

out, gpus = sys.argv[1], int(sys.argv[2])


def load(name):
    try:
        with open(os.path.join(out, name + ".json")) as fh:
            s = json.load(fh)
    except (OSError, ValueError):
        s = None
    with open(os.path.join(out, name + ".rc")) as fh:
        return s, int(fh.read().strip() or 1)


def step_median(name):
    steps = []
    with open(os.path.join(out, name, "events.jsonl")) as fh:
        for line in fh:
            e = json.loads(line)
            if e.get("event") == "step" and e.get("step", 0) > 10:
                steps.append(e["step_s"])
    return statistics.median(steps)


rows, ok = [], True


def row(case, what, passed, detail):
    global ok
    ok &= bool(passed)
    rows.append((case, what, "PASS" if passed else "FAIL", detail))


for case, faults in (("a", ("kill", "hang")), ("b", ("kill",)), ("d", ("kill", "hang"))):
    if case == "d" and gpus < 2:
        rows.append(("d", "nccl across GPUs", "skip", f"{gpus} GPU: needs 2 or more"))
        continue
    free, rc = load(f"{case}-free")
    digest = (free or {}).get("param_digest")
    row(case, "failure-free", rc == 0 and digest, f"rc {rc}, digest {str(digest)[:12]}")
    for f in faults:
        s, rc = load(f"{case}-{f}")
        s = s or {}
        rec = [x.get("recovery_s") for x in s.get("failures", [])]
        same = s.get("param_digest") == digest and digest is not None
        row(case, f"{f} node1@30", rc == 0 and s.get("swaps", 0) >= 1 and same,
            f"rc {rc}, swaps {s.get('swaps')}, recovery_s {rec}, digest {'equal' if same else 'DIFFERENT'}")
try:
    on = statistics.median(step_median(f"c-on{i}") for i in (1, 2))
    off = statistics.median(step_median(f"c-off{i}") for i in (1, 2))
    row("c", "on/off step time, ~1B", on / off <= 1.01, f"{on * 1e3:.1f} / {off * 1e3:.1f} ms = {on / off:.3f} (goal <= 1.01)")
except (OSError, ValueError, statistics.StatisticsError) as exc:
    row("c", "on/off step time, ~1B", False, f"no step times: {exc}")

w = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(("case", "run", "result"))]
print(f"{'case':<{w[0]}}  {'run':<{w[1]}}  {'result':<{w[2]}}  detail")
for r in rows:
    print(f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]}")
print("GPU CHECK PASSED" if ok else "GPU CHECK FAILED")
sys.exit(0 if ok else 1)
EOF
