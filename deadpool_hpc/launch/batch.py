"""What the batch script runs on its allocation: ``python -m deadpool_hpc.launch.batch COMMAND``. Internal: the
templates (templates/train.sbatch) call these; people use the ``deadpool`` command (cli.py).

- ``write-config``       write RUN_DIR/config.json from ``deadpool run``-style options (a template run without CONFIG)
- ``copy-config``        copy a config file (the batch script's CONFIG) to RUN_DIR/config.json
- ``prepare``            (holding run.lock) clear RUN_DIR for a fresh run, or for a resumed one with ``--resume``
- ``watch``              on the batch host: touch RUN_DIR/batch.alive every second; drain the nodes the run declares
  dead
- ``launch``             before each srun: record the launch, its id and its nodes (slurm_startup.py)
- ``task``               one Slurm task: run the worker, then, if the batch script died with its node, finish the job
- ``relaunch``           after a start-up loss: one spare fewer; prints TOTAL SPARES EXCLUDED
- ``end``                after srun: requeue the job if it should go on, else write the summary
- ``requeue-if-needed``  (batch scripts rendered before ``end`` existed) requeue the job if it should go on
- ``cancel-companions``  (the batch script's exit trap) scancel every companion job of this job, by job id
- ``join``               on a companion job's node (templates/companion.sbatch): check the node, then run its
                         agent, which joins the running job as a spare (launch/companion.py, control/joining.py)

``write-config`` and ``copy-config`` run on the allocation (the batch host), so the node's GPUs are known there:
``--ranks-per-node 0`` (the template's and ``deadpool submit``'s default) becomes one per GPU of the node
(``SLURM_GPUS_ON_NODE``, else the CUDA devices; 1 without a GPU) in RUN_DIR/config.json, and more than that under
``--backend nccl`` is refused, before any process starts (``resolve_layout``).

Exit 2 on bad input (ConfigError, a missing file), with ``deadpool: error: ...`` on stderr.
"""
from __future__ import annotations

import argparse
import sys

from ..errors import ConfigError
from . import companion, slurm, slurm_job, slurm_startup
from .options import add_run_options, config_from_args


def resolve_layout(cfg, gpus: int | None = None):
    """``cfg`` with its training processes per node resolved for a node with ``gpus`` GPUs (default: this node's,
    dataplane/backend.py ``node_gpus``): 0 becomes one per GPU (1 without a GPU). Returns ``cfg`` (updated in place).
    Raises ConfigError naming the value and the GPU count for more processes than GPUs under ``--backend nccl``."""
    from ..dataplane.backend import BackendError, node_gpus, resolve_ranks_per_node

    gpus = node_gpus() if gpus is None else gpus
    try:
        n = resolve_ranks_per_node(cfg.layout.ranks_per_node, cfg.layout.backend, gpus)
    except BackendError as exc:
        raise ConfigError(str(exc)) from None
    if n != cfg.layout.ranks_per_node:
        cfg.update(ranks_per_node=n)
    return cfg


def copy_config_resolved(config: str, run_dir: str, gpus: int | None = None) -> str:
    """``copy-config``: copy CONFIG to RUN_DIR/config.json (slurm.copy_config), its ranks per node resolved for this
    node (``resolve_layout``; a resolved config is written anew). Returns the path; ConfigError as both."""
    from .. import rundir
    from ..config import RunConfig

    dest = slurm.copy_config(config, run_dir)
    with open(dest) as fh:
        cfg = RunConfig.from_json(fh.read())
    before = cfg.layout.ranks_per_node
    resolve_layout(cfg, gpus)
    if cfg.layout.ranks_per_node != before:
        cfg.validate()
        dest = rundir.write_config(run_dir, cfg)
    return dest


def main(argv=None) -> int:
    from ..logs import setup as setup_logging

    p = argparse.ArgumentParser(prog="python -m deadpool_hpc.launch.batch", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    wc = sub.add_parser("write-config", help="write RUN_DIR/config.json")
    add_run_options(wc)
    cc = sub.add_parser("copy-config", help="copy CONFIG to RUN_DIR/config.json (atomically)")
    cc.add_argument("config")
    cc.add_argument("run_dir")
    pr = sub.add_parser("prepare", help="(holding run.lock) clear RUN_DIR for a fresh or resumed run")
    pr.add_argument("run_dir")
    pr.add_argument("--resume", action="store_true", help="resume from RUN_DIR/checkpoint if there is one")
    wt = sub.add_parser("watch", help="(on the batch host) heartbeat file + drain dead nodes")
    wt.add_argument("run_dir")
    wt.add_argument("--drain", default="1")
    la = sub.add_parser("launch", help="(before each srun) record the launch: its id and nodes")
    la.add_argument("run_dir")
    la.add_argument("launch_id")
    la.add_argument("--total", type=int, required=True, help="nodes of the step")
    la.add_argument("--exclude", default="", help="hosts left out (comma-separated)")
    tk = sub.add_parser("task", help="(inside srun) run one worker, finish the job if the batch host died")
    tk.add_argument("run_dir")
    tk.add_argument("--no-finisher", action="store_true")
    rl = sub.add_parser("relaunch", help="(after a start-up loss) one spare fewer; prints TOTAL SPARES EXCLUDED")
    rl.add_argument("run_dir")
    rl.add_argument("launch_id")
    en = sub.add_parser("end", help="(after srun) requeue the job if it should go on, else write the summary")
    en.add_argument("run_dir")
    en.add_argument("--out", help="also write the summary here")
    en.add_argument("--since", type=float, help="when this attempt started (wall time, s)")
    en.add_argument("--srun-rc", type=int)
    rq = sub.add_parser("requeue-if-needed", help="(scripts rendered before `end`) requeue the job if it should go on")
    rq.add_argument("run_dir")
    cx = sub.add_parser("cancel-companions", help="(exit trap) scancel the companion jobs of this job, by job id")
    cx.add_argument("run_dir")
    cx.add_argument("--main-job", required=True)
    jn = sub.add_parser("join", help="(a companion job's node) check the node, then join the running job as a spare")
    jn.add_argument("run_dir")
    jn.add_argument("--main-job", required=True)
    a = p.parse_args(argv)
    setup_logging(f"slurm-{a.cmd}")
    try:
        if a.cmd == "write-config":
            print(slurm.write_config(resolve_layout(config_from_args(a))))
        elif a.cmd == "copy-config":
            print(copy_config_resolved(a.config, a.run_dir))
        elif a.cmd == "prepare":
            slurm.prepare(a.run_dir, resume=a.resume)
        elif a.cmd == "watch":
            slurm_job.keep_batch_host(a.run_dir, do_drain=a.drain not in ("0", "no", "false", ""))
        elif a.cmd == "launch":
            slurm_startup.write_launch(a.run_dir, a.launch_id, slurm_startup.step_nodes(a.total, a.exclude))
        elif a.cmd == "task":
            return slurm_job.task_main(a.run_dir, finisher=not a.no_finisher)
        elif a.cmd == "relaunch":
            try:
                total, spares, excluded = slurm_startup.relaunch(a.run_dir, a.launch_id)
            except LookupError:
                return 1   # nothing to relaunch
            print(total, spares, ",".join(excluded))
        elif a.cmd == "end":
            return slurm.end_attempt(a.run_dir, a.out, a.since, a.srun_rc)
        elif a.cmd == "requeue-if-needed":
            return 0 if slurm_job.requeue_if_needed(a.run_dir) else 1
        elif a.cmd == "cancel-companions":
            ids = companion.cancel_all(a.run_dir, a.main_job)
            print(f"[deadpool] companion jobs of {a.main_job} cancelled: {' '.join(ids) or 'none'}")
        elif a.cmd == "join":
            return companion.join(a.run_dir, a.main_job)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"deadpool: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
