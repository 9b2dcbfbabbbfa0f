#!/usr/bin/env bash
# The device check: runs the product itself (`deadpool run`, the CLI a user runs) on whatever GPUs this machine has
# and prints one table. Run from anywhere on a machine with CUDA:
#     bash benchmarks/gpu_check.sh            # PYTHON=... to use another interpreter (default: .venv/bin/python)
# Without CUDA it says so and exits 0, having run nothing (tests/e2e/test_gpu_check.py checks that here).
#
# Cases (docs/gpu.md):
#   a  one GPU, --backend nccl, 2 nodes + 1 spare (three processes on the GPU; each emulated node is a host of its
#      own to NCCL, NCCL_HOSTID, since NCCL refuses two ranks of a communicator on one GPU of one host): the
#      failure-free run, then a kill and a hang of node1; each must hot-swap and end with the failure-free digest
#      (2 active nodes, not 1: a rank's replica lives on another active node, so hot swap needs 2)
#   b  one GPU, --backend gloo, three training processes whose state is CUDA tensors (benchmarks/gpu_check_train.py):
#      a kill, digest equal to the failure-free run (the device snapshot and restore with several ranks)
#   c  step time with replication on and off interleaved in ONE run (benchmarks/gpu_check_interleave.py: blocks of
#      5 steps alternate, RunConfig.interleave_replication, the internal section's benchmark knob), a ~1 B-parameter
#      FSDP2 model (bf16 compute parameters, fp32 parameters and Adam state in the shards; examples/fsdp2_gpt.py); the
#      ratio of the phases' median step times, on / off, goal <= 1.01
#   d  two GPUs or more: --backend nccl across them (2 nodes x 2 ranks + 1 spare), a kill and a hang
# Budget: 8 minutes on one GPU: 5 runs of 20-40 s and case c's run of 60-120 s; each has its own `timeout` (510 s if
# every one ran to it). Exit 0 when every row passed, 1 otherwise.
# GPU_CHECK_TINY=1: case c alone, with a tiny model on the CPU (gloo), CUDA or not: the plumbing of the interleaved
# run and of the table, not the figure (its row says "ran", never judged against the goal).
# WRITTEN, NOT RUN ON A DEVICE: no GPU was available where it was written (GPU_CHECK_TINY=1 ran on the CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
TINY=${GPU_CHECK_TINY:-0}
if [ "$TINY" != 1 ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 1)' \
        2>/dev/null; then
    echo "gpu_check: skipped: no CUDA device here (torch.cuda.is_available() is false); nothing was run"
    exit 0
fi
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
OUT=${GPU_CHECK_DIR:-$(mktemp -d /tmp/gpu-check.XXXXXX)}
mkdir -p "$OUT"
echo "gpu_check: $GPUS GPU(s); runs under $OUT"
if [ "$GPUS" -gt 0 ]; then
    "$PY" -c 'import torch; print("gpu_check: torch", torch.__version__, "CUDA", torch.version.cuda, "NCCL",
              ".".join(map(str, torch.cuda.nccl.version())), "on", torch.cuda.get_device_name(0))'
fi

# run NAME SECONDS ARGS...: one `deadpool run`, its summary in $OUT/NAME.json, its exit status in $OUT/NAME.rc
run() {
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$PY" -m deadpool_hpc.launch.cli run --run-dir "$OUT/$name" --summary "$OUT/$name.json" "$@" \
        > "$OUT/$name.log" 2>&1
    echo $? > "$OUT/$name.rc"
}

SMALL=(--steps 60 --hang-timeout 20 --collective-timeout 30)
if [ "$TINY" != 1 ]; then
    # a: NCCL on one GPU
    run a-free 60 --backend nccl --nodes 2 --spares 1 "${SMALL[@]}"
    run a-kill 60 --backend nccl --nodes 2 --spares 1 "${SMALL[@]}" --kill node1@30
    run a-hang 90 --backend nccl --nodes 2 --spares 1 "${SMALL[@]}" --hang node1@30
    # b: gloo over CUDA tensors, three training processes
    GT=(--train-fn benchmarks.gpu_check_train:train)
    run b-free 60 --backend gloo --nodes 3 --spares 1 "${GT[@]}" "${SMALL[@]}"
    run b-kill 60 --backend gloo --nodes 3 --spares 1 "${GT[@]}" "${SMALL[@]}" --kill node1@30
    # d: NCCL across GPUs
    if [ "$GPUS" -ge 2 ]; then
        run d-free 90 --backend nccl --nodes 2 --ranks-per-node 2 --spares 1 "${SMALL[@]}"
        run d-kill 90 --backend nccl --nodes 2 --ranks-per-node 2 --spares 1 "${SMALL[@]}" --kill node1@30
        run d-hang 120 --backend nccl --nodes 2 --ranks-per-node 2 --spares 1 "${SMALL[@]}" --hang node1@30
    fi
fi
# c: replication on / off interleaved in one run, ~1 B parameters (12 * 20 layers * 2048^2 = 1.0e9); --tiny on the CPU
C_ARGS=(--block 5 --warmup 10 --run-dir "$OUT/c" --out "$OUT/c.json" --timeout 170)
[ "$TINY" = 1 ] && C_ARGS+=(--tiny)
timeout 180 "$PY" -m benchmarks.gpu_check_interleave "${C_ARGS[@]}" > "$OUT/c.log" 2>&1
echo $? > "$OUT/c.rc"

"$PY" - "$OUT" "$GPUS" "$TINY" <<'EOF'
import json, os, sys

out, gpus, tiny = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"


def load(name):
    try:
        with open(os.path.join(out, name + ".json")) as fh:
            s = json.load(fh)
    except (OSError, ValueError):
        s = None
    with open(os.path.join(out, name + ".rc")) as fh:
        return s, int(fh.read().strip() or 1)


rows, ok = [], True


def row(case, what, passed, detail):
    global ok
    ok &= bool(passed)
    rows.append((case, what, "PASS" if passed else "FAIL", detail))


for case, faults in (("a", ("kill", "hang")), ("b", ("kill",)), ("d", ("kill", "hang"))):
    if tiny:
        continue
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
what = "on/off interleaved, " + ("tiny, CPU" if tiny else "~1B")
try:
    with open(os.path.join(out, "c.json")) as fh:
        c = json.load(fh)
    detail = (f"{c['on_s'] * 1e3:.1f} / {c['off_s'] * 1e3:.1f} ms = {c['ratio']:.3f} (medians of {c['on_steps']} on / "
              f"{c['off_steps']} off steps, blocks of {c['block']}; goal <= 1.01)")
    if tiny:   # the plumbing: the run completed and both phases have step times; the figure needs the GPU
        ok &= bool(c["completed"])
        rows.append(("c", what, "ran" if c["completed"] else "FAIL", detail))
    else:
        row("c", what, c["completed"] and c["ratio"] <= 1.01, detail)
except (OSError, ValueError, KeyError) as exc:
    row("c", what, False, f"no step times ({exc}); see {os.path.join(out, 'c.log')}")

w = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(("case", "run", "result"))]
print(f"{'case':<{w[0]}}  {'run':<{w[1]}}  {'result':<{w[2]}}  detail")
for r in rows:
    print(f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]}")
if tiny:
    print("GPU CHECK (GPU_CHECK_TINY: case c's plumbing on the CPU, nothing judged against a goal) " + ("RAN" if ok else "FAILED"))
else:
    print("GPU CHECK PASSED" if ok else "GPU CHECK FAILED")
sys.exit(0 if ok else 1)
EOF
