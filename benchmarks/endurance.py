"""Goodput side by side: deadpool's hot swap, torchrun restarts from DCP checkpoints, torchft, at several MTBFs.

    .venv/bin/python benchmarks/endurance.py --mtbf 30,60,120 --minutes 2
    .venv/bin/python benchmarks/endurance.py --mtbf 30 --minutes 1 --systems deadpool,restart --deadpool-args --requeue
    .venv/bin/python benchmarks/endurance.py --mtbf 60 --minutes 5 --deadpool-args "--kinds kill-rank,kill-node"

One invocation, one machine, one model: the demo's (deadpool_hpc.train: micro GPT, Shakespeare, AdamW, DemoConfig
defaults), 3 training processes of 1 CPU thread over gloo in each system. Each piece runs as its own CLI, one after
the other, and this script reads back what it writes for machines:
- deadpool: benchmarks/chaos.py once per MTBF, 3 training nodes + 2 spares, kind kill-rank (the others' fault)
  (``--deadpool-args`` is appended to those, so a flag given there wins; --mtbf, --minutes, --seed and --out are this
  script's); its report.json in OUT/deadpool-I-mtbfS/.
- restart: benchmarks/restart_baseline.py --json, every MTBF in one call (one calibration, one reference run): plain
  DDP under ``torchrun --max-restarts``, a DCP checkpoint every C steps (Young/Daly), run directories in OUT/restart.
- torchft: benchmarks/torchft_baseline.py --json (Lighthouse + Manager, 3 replica groups of 1 process), run
  directories in OUT/torchft. Needs torchft-nightly==2026.10.26 in this interpreter's environment
  (``pip install -c constraints.txt torchft-nightly==2026.10.26``; torchft 0.2.0 cannot survive a fault): without
  it the rows say why, and the other systems run.
Each piece injects its own faults from outside at seeded exponential gaps of mean MTBF (seed --seed + I for the I-th
MTBF) for --minutes from its first step: each SIGKILLs one training process (deadpool: of a training node, which then
comes back to the spare pool; a fault that would need a spare when none is left is skipped, unless --requeue). On a shared machine the load moves between runs: compare a row's two goodputs.

Columns (each piece's own definitions; its docstring has the details):
faults: faults injected (deadpool: those skipped for want of a spare not counted; the note says how many).
steps: steps that count. deadpool: the job's steps if it completed, else 0; restart: N, the step every rank ended
  on; torchft: N less the first step that all 3 groups committed together.
step s: failure-free step time. deadpool: the wall time per step of a failure-free deadpool run of the same steps
  (step function + snapshot; chaos.py's own "goodput" is at the median step function time, without the snapshot);
  restart: T_ref(N) / N, plain DDP without checkpoints to step N; torchft: the mean committed step
  with all 3 groups in the faulty run itself (there is no failure-free run; steps stalled by a quorum change left out).
wall s: deadpool: first step to the last; restart: the first step's start to the last step's end (every restart's
  start-up in, the first launch's out); torchft: the end of the first 3-group step to the first group at N.
goodput: steps x step s / wall.
own step: the same at the faulty run's own step time (deadpool: its wall time per step outside the intervals with a
  fault or a new generation and the 3 after; restart: t', its mean step less checkpoints, a launch's first 3 steps
  left out; torchft: = goodput): a load change between the faulty and the failure-free run is not a fault's cost.
overhead: failure-free step time vs the plain loop, where the piece measures it. restart: 1 + d' / (C t'), the
  checkpoints' share within the faulty run (the note has T_ckpt(N) / T_ref(N), two failure-free runs with and
  without checkpoints, which a load change between them moves); deadpool: not measured by chaos.py
  (benchmarks/overhead.py measures replication's); torchft: not measured.
lost/fault s: deadpool: (wall - steps x its own step) / faults; restart: (wall - N t' - floor(N/C) d') / faults, d' its
  median checkpoint time (checkpoints are the overhead, not a fault's loss); torchft: (wall - steps x step s) / faults.
  All three at the faulty run's own step time.
equal: final parameters vs a failure-free run's. deadpool: a digest of every parameter, yes or no; restart: yes, or
  the largest |difference| (DDP rebuilds its buckets after a restart: restart_baseline.py --buckets fixed is equal);
  torchft: not checked.
note: deadpool: recovery (fault -> training again) median, requeues, faults skipped, steps recomputed, chaos.py's exit
  code (1: not equal, a fault not recovered, a process left or a failure no fault explains); restart: C, restart
  (fault -> first step of the new launch) median, steps redone per fault; torchft: stall (fault -> next committed
  step) and back (fault -> the restarted group's first committed step) medians, steps aborted per fault.

OUT (new or empty; default benchmarks/out/endurance-TIME): endurance.md (the table, the command line, the load
average at start and end), endurance.json (the rows, every number each piece wrote, each piece's command, exit code
and wall time), SYSTEM.log (each piece's console). Exit 0: every system gave numbers at every MTBF; 1: a row says why
not; 2: bad input.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.metadata as md
import importlib.util
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SYSTEMS = ("deadpool", "restart", "torchft")
# the same fault as the other two systems get (SIGKILL of one training process; the node comes back to the pool),
# 3 training processes as they have; the 30-minute chaos run of docs/endurance.md has every kind
DEADPOOL = ("--kinds", "kill-rank", "--nodes", "3", "--spares", "2")
OURS = ("--mtbf", "--minutes", "--seed", "--out")   # chaos.py flags this script sets per run
TORCHFT = "torchft-nightly==2026.10.26"


def refusal(a) -> str | None:
    """The first bad value and what is accepted, or None (sets a.mtbfs, a.minutes, a.systems, a.deadpool)."""
    a.mtbfs = []
    for text in a.mtbf_text.split(","):
        try:
            s = float(text)
        except ValueError:
            s = math.nan
        if not s > 0 or math.isinf(s):
            return (f"--mtbf {text.strip() or repr(a.mtbf_text)}: accepted: seconds > 0 (the mean time between "
                    f"faults), comma-separated, e.g. 30,60,120")
        a.mtbfs.append(s)
    try:
        a.minutes = float(a.minutes_text)
    except ValueError:
        a.minutes = math.nan
    if not a.minutes > 0 or math.isinf(a.minutes):
        return f"--minutes {a.minutes_text}: accepted: minutes > 0 (how long each run has faults)"
    a.systems = [s.strip() for s in a.systems_text.split(",") if s.strip()]
    unknown = [s for s in a.systems if s not in SYSTEMS]
    if unknown or not a.systems:
        return (f"--systems {','.join(unknown) or repr(a.systems_text)}: unknown system; accepted: "
                f"{', '.join(SYSTEMS)} (comma-separated)")
    try:
        a.deadpool = shlex.split(a.deadpool_args)
    except ValueError as exc:
        return f"--deadpool-args {a.deadpool_args!r}: {exc}; accepted: chaos.py's flags, quoted as in a shell"
    if mine := [t for t in a.deadpool if t.split("=")[0] in OURS]:
        return (f"--deadpool-args {mine[0]}: set by endurance.py for each run (its --mtbf, --minutes, --seed, --out); "
                f"accepted: chaos.py's other flags (--kinds, --nodes, --spares, --requeue, --hang-timeout, ...)")
    if os.path.isdir(a.out) and os.listdir(a.out):
        return f"--out {a.out}: holds files (an earlier run?); accepted: a new or empty directory"
    return None


def torchft_missing() -> str | None:
    """Why torchft_baseline.py cannot run with this interpreter, or None."""
    fix = f"install it: {sys.executable} -m pip install -c constraints.txt {TORCHFT} (from PyPI)"
    if importlib.util.find_spec("torchft") is None:
        return f"torchft is not installed in {sys.prefix}; {fix}"
    lighthouse = Path(sys.executable).parent / "torchft_lighthouse"
    if not lighthouse.exists():
        return f"torchft is installed but its lighthouse binary {lighthouse} is missing; {fix}"
    try:
        version = md.version("torchft-nightly")
    except md.PackageNotFoundError:
        try:
            version = f"torchft {md.version('torchft')}"
        except md.PackageNotFoundError:
            version = "an unknown torchft"
        return (f"{version} installed, not {TORCHFT}: torchft 0.2.0's DDP comm hook asserts when a peer dies and "
                f"every group restarts from step 0 (see benchmarks/torchft_baseline.py); {fix}")
    if version != TORCHFT.split("==")[1]:
        print(f"torchft: torchft-nightly {version}, not {TORCHFT} (the version the baseline was written for)")
    return None


def run_piece(name: str, cmd: list[str], log_path: Path, guard_s: float) -> dict:
    """Run one piece's CLI from the repository root, its output into LOG_PATH and, prefixed, onto the console (read
    back from the file: processes it leaves behind hold no pipe of ours). After GUARD_S seconds it gets SIGINT (its
    finally blocks end what it started), 60 s later SIGKILL."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    t0, tail, buf, sent = time.time(), collections.deque(maxlen=40), "", []
    print(f"[{name}] $ {shlex.join(cmd)}", flush=True)
    with open(log_path, "a") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        offset = log.tell()
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    with open(log_path) as reader:
        reader.seek(offset)
        try:
            while True:
                rc = p.poll()
                if rc is None and time.time() > t0 + guard_s + 60 * len(sent) and len(sent) < 2:
                    sent.append(signal.SIGKILL if sent else signal.SIGINT)   # once each
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, sent[-1])
                buf += reader.read()
                *lines, buf = buf.split("\n")
                for line in lines:
                    print(f"[{name}] {line}", flush=True)
                    tail.append(line)
                if rc is not None:
                    break
                time.sleep(0.5)
        finally:
            if p.poll() is None:        # interrupted here: the piece got the same SIGINT from the terminal
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    if buf:
        print(f"[{name}] {buf}", flush=True)
        tail.append(buf)
    return {"cmd": cmd, "rc": rc, "wall_s": round(time.time() - t0, 1), "tail": list(tail),
            "timed_out_after_s": guard_s if sent else None}


def why(run: dict, script: str) -> str:
    """A piece gave no numbers: its exit and the last line of its output that reads like an error."""
    if run["timed_out_after_s"]:
        head = f"{script} still running after {run['timed_out_after_s']:.0f} s: stopped"
    else:
        head = f"{script} exited {run['rc']}"
    lines = [t.strip() for t in run["tail"] if t.strip()]
    err = next((t for t in reversed(lines) if "Error" in t or "error:" in t or "Exception" in t), None)
    return f"{head}: {err or (lines[-1] if lines else 'no output')}"


def failed(system: str, mtbf: float, reason: str) -> dict:
    return {"system": system, "mtbf": mtbf, "ran": False, "note": reason}


def deadpool(a, log: Path, raw: dict) -> list[dict]:
    rows, refused = [], None
    for i, s in enumerate(a.mtbfs):
        if refused:
            rows.append(failed("deadpool", s, refused))
            continue
        out = Path(a.out) / f"deadpool-{i}-mtbf{s:g}"
        cmd = [sys.executable, str(HERE / "chaos.py"), *DEADPOOL, *a.deadpool, "--mtbf", f"{s:g}", "--minutes",
               f"{a.minutes:g}", "--seed", str(a.seed + i), "--out", str(out)]
        run = run_piece("deadpool", cmd, log, 60 * a.minutes * 3 + 900)
        raw.setdefault("runs", []).append(run)
        try:
            rep = json.loads((out / "report.json").read_text())
        except (OSError, ValueError):
            rows.append(failed("deadpool", s, why(run, "chaos.py")))
            refused = rows[-1]["note"] if run["rc"] == 2 else None   # bad --deadpool-args: the same for every MTBF
            continue
        t, ch = rep["table"], rep["chaos"]
        raw.setdefault("tables", {})[f"{s:g}"] = t
        count = {k: sum(v[k] for v in t["faults"].values()) for k in ("injected", "recovered", "skipped")}
        note = [f"recovery median {_f(t['recovery_s_median'], 2)} s, max {_f(t['recovery_s_max'], 2)} s",
                f"{count['recovered']}/{count['injected']} recovered", f"{t['requeues']} requeues",
                f"{count['skipped']} skipped (no spare left)" if count["skipped"] else None,
                f"{t['steps_recomputed']} steps recomputed" if t["steps_recomputed"] else None,
                None if t["completed"] else f"did not complete ({ch['steps_completed']} of {t['steps']} steps)",
                f"processes left: {t['processes_left']}" if t["processes_left"] else None,
                f"{len(t['failures_not_injected'])} failures no fault explains" if t["failures_not_injected"] else None,
                f"chaos.py exit {run['rc']}"]
        rows.append({"system": "deadpool", "mtbf": s, "ran": True, "faults": count["injected"],
                     "steps": ch["steps_completed"] if ch["completed"] else 0,
                     "step_s": t.get("failure_free_mean_step_s"), "wall_s": t["wall_s_first_step_to_end"],
                     "goodput": t.get("goodput_at_mean_step"), "goodput_own_step": t.get("goodput_at_own_mean_step"),
                     "overhead": None,
                     "lost_s_per_fault": t.get("lost_s_per_fault"), "equal": "yes" if t["digest_equal"] else "no",
                     "note": "; ".join(n for n in note if n), "out": str(out)})
    return rows


def restart(a, log: Path, raw: dict) -> list[dict]:
    path = Path(a.out) / "restart.json"
    k = len(a.mtbfs)
    cmd = [sys.executable, str(HERE / "restart_baseline.py"), "--mtbf", ",".join(f"{s:g}" for s in a.mtbfs),
           "--minutes", f"{a.minutes:g}", "--seed", str(a.seed), "--keep", str(Path(a.out) / "restart"),
           "--json", str(path)]
    run = run_piece("restart", cmd, log, 60 * a.minutes * (2 * k + 2) + 300 * k + 600)
    raw["runs"] = [run]
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return [failed("restart", s, why(run, "restart_baseline.py")) for s in a.mtbfs]
    raw["json"] = got
    rows = []
    for r in got["rows"]:
        diff = r["max_abs_diff"]
        rows.append({"system": "restart", "mtbf": r["mtbf"], "ran": True, "faults": r["faults"], "steps": r["steps"],
                     "step_s": r["ref_time_to_n"] / r["steps"], "wall_s": r["wall"], "goodput": r["goodput_ref"],
                     "goodput_own_step": r["goodput"], "overhead": r["ckpt_ovh"],
                     "lost_s_per_fault": r["lost_per_fault"],
                     "equal": "yes" if diff == 0 else f"no (max diff {diff:.0e})",
                     "note": f"C {r['every']} steps; restart median {_f(r['restart'], 1)} s; redone "
                             f"{_f(r['redone_per_fault'], 1)} steps/fault; {r['launches']} launches; overhead of "
                             f"two failure-free runs {_f(r['ckpt_ovh_ref'], 3)}"})
    return rows


def torchft(a, log: Path, raw: dict) -> list[dict]:
    if reason := torchft_missing():
        print(f"torchft: could not run: {reason}", flush=True)
        raw["missing"] = reason
        return [failed("torchft", s, f"could not run: {reason}") for s in a.mtbfs]
    path = Path(a.out) / "torchft.json"
    cmd = [sys.executable, str(HERE / "torchft_baseline.py"), "--mtbf", ",".join(f"{s:g}" for s in a.mtbfs),
           "--minutes", f"{a.minutes:g}", "--seed", str(a.seed), "--keep", str(Path(a.out) / "torchft"),
           "--json", str(path)]
    run = run_piece("torchft", cmd, log, (60 * a.minutes + 420) * len(a.mtbfs) + 300)
    raw["runs"] = [run]
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return [failed("torchft", s, why(run, "torchft_baseline.py")) for s in a.mtbfs]
    raw["json"] = got
    return [{"system": "torchft", "mtbf": r["mtbf"], "ran": True, "faults": r["faults"], "steps": r["steps"],
             "step_s": r["t"], "wall_s": r["wall"], "goodput": r["goodput"], "goodput_own_step": r["goodput"],
             "overhead": None, "lost_s_per_fault": r["lost_per_fault"], "equal": None,
             "note": f"stall median {_f(r['stall'], 1)} s; back median {_f(r['back'], 1)} s; aborted "
                     f"{_f(r['aborted_per_fault'], 1)} steps/fault; goodput in samples {_f(r['goodput_samples'], 3)}"}
            for r in got["rows"]]


COLUMNS = ("system", "MTBF s", "faults", "steps", "step s", "wall s", "goodput", "own step", "overhead",
           "lost/fault s", "equal", "note")


def cells(r: dict) -> list[str]:
    if not r["ran"]:
        return [r["system"], f"{r['mtbf']:g}"] + ["-"] * 9 + [r["note"]]
    return [r["system"], f"{r['mtbf']:g}", str(r["faults"]), str(r["steps"]), _f(r["step_s"], 3), _f(r["wall_s"], 1),
            _f(r["goodput"], 3), _f(r["goodput_own_step"], 3), _f(r["overhead"], 3), _f(r["lost_s_per_fault"], 2),
            r["equal"] or "-", r["note"]]


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---:" if c not in ("system", "equal", "note")
                                                                 else "---" for c in COLUMNS) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write(a, doc: dict, rows: list[dict]) -> None:
    """OUT/endurance.json and OUT/endurance.md as they stand (after each system, so a stopped run leaves some)."""
    doc["rows"] = rows
    with open(os.path.join(a.out, "endurance.json.tmp"), "w") as fh:
        json.dump(doc, fh, indent=1, default=str)
    os.replace(os.path.join(a.out, "endurance.json.tmp"), os.path.join(a.out, "endurance.json"))
    load = lambda v: "-" if v is None else " / ".join(f"{x:.2f}" for x in v)   # noqa: E731
    columns = "\n".join(line if line.startswith(("Columns", " ")) else f"- {line}"   # a markdown list
                        for line in __doc__[__doc__.index("Columns ("):__doc__.index("\n\nOUT (")].splitlines())
    pieces = "; ".join(f"{s}: {sum(r['wall_s'] for r in doc['pieces'][s].get('runs', [])) / 60:.1f} min, exit "
                       f"{','.join(str(r['rc']) for r in doc['pieces'][s].get('runs', [])) or '-'}"
                       for s in doc["pieces"])
    md_text = (f"# Endurance: goodput at MTBF {', '.join(f'{s:g}' for s in a.mtbfs)} s, {a.minutes:g} min of faults "
               f"each\n\n{markdown(rows)}\n"
               f"- command: `{doc['command']}` (in {doc['cwd']}), started {doc['started']}\n"
               f"- machine: {os.cpu_count()} CPUs; load average (1 / 5 / 15 min) at start {load(doc['load_start'])}, "
               f"at end {load(doc['load_end'])}\n"
               f"- versions: {', '.join(f'{k} {v}' for k, v in doc['versions'].items())}\n"
               f"- each piece's wall clock and exit code: {pieces or '-'}\n\n{columns}\n")
    with open(os.path.join(a.out, "endurance.md"), "w") as fh:
        fh.write(md_text)


def _f(v, digits: int) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mtbf", dest="mtbf_text", default="30,60,120", metavar="S,...",
                    help="mean seconds between faults, comma-separated (default 30,60,120)")
    ap.add_argument("--minutes", dest="minutes_text", default="2", metavar="M",
                    help="minutes of faults in each run (default 2)")
    ap.add_argument("--systems", dest="systems_text", default=",".join(SYSTEMS), metavar="NAME,...",
                    help=f"any of {', '.join(SYSTEMS)} (default: all, in that order)")
    ap.add_argument("--seed", type=int, default=0, help="the I-th MTBF's runs use seed + I (default 0)")
    ap.add_argument("--deadpool-args", default="", metavar="'ARGS'",
                    help=f"more chaos.py flags, after its defaults here ({' '.join(DEADPOOL)}), e.g. '--requeue'")
    ap.add_argument("--out", default=str(HERE / "out" / time.strftime("endurance-%Y%m%d-%H%M%S")),
                    help="new or empty directory")
    argv = sys.argv[1:]
    for i, t in enumerate(argv[:-1]):   # --deadpool-args --requeue: argparse would take --requeue for a flag of ours
        if t == "--deadpool-args":
            argv[i:i + 2] = [f"--deadpool-args={argv[i + 1]}"]
            break
    a = ap.parse_args(argv)
    if (msg := refusal(a)) is not None:
        ap.error(msg)
    os.makedirs(a.out, exist_ok=True)
    versions = {}
    for dist in ("torch", "torchft-nightly", "torchft"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    doc = {"command": shlex.join([sys.executable, *sys.argv]), "cwd": os.getcwd(),
           "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "load_start": os.getloadavg(), "load_end": None,
           "cpus": os.cpu_count(), "versions": versions, "mtbf": a.mtbfs, "minutes": a.minutes, "seed": a.seed,
           "systems": a.systems, "deadpool_args": [*DEADPOOL, *a.deadpool], "pieces": {}}
    t0, rows = time.time(), []
    print(f"endurance: {', '.join(a.systems)} at MTBF {', '.join(f'{s:g}' for s in a.mtbfs)} s, {a.minutes:g} min of "
          f"faults each, seed {a.seed}, out {a.out}; load average {os.getloadavg()[0]:.2f}", flush=True)
    for system in a.systems:
        doc["pieces"][system] = {}
        rows += {"deadpool": deadpool, "restart": restart, "torchft": torchft}[system](
            a, Path(a.out) / f"{system}.log", doc["pieces"][system])
        write(a, doc, rows)
    doc["load_end"], doc["wall_s"] = os.getloadavg(), round(time.time() - t0, 1)
    write(a, doc, rows)
    print(f"\n{markdown(rows)}\nload average at start {doc['load_start'][0]:.2f}, at end {doc['load_end'][0]:.2f}; "
          f"{doc['wall_s'] / 60:.1f} min; {a.out}/endurance.md, endurance.json", flush=True)
    return 0 if all(r["ran"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
