"""A node agent's metrics (``--metrics-port``, ``--metrics-textfile``; deadpool_hpc/metrics.py says what each means).

Owns: gathering what this agent knows into plain numbers, on the agent's own loop (``tick``, at most once a second:
the exporter's threads never touch the agent's state), and which views this agent serves: its node's always, the
job's while it is the coordinator (the lowest live agent, as for the straggler check and the swap lease). A new
coordinator opens the job's endpoint when the old one is gone (its port is tried again every second until it is
free: on one machine the dead coordinator's socket closed with it).

Does not own: the metric names and the job view's derivation from the event log (deadpool_hpc/metrics.py).
"""
from __future__ import annotations

import os
import time

from .. import metrics
from .state import NodeState

GATHER_S = 1.0   # seconds between two snapshots of the agent's state


class NodeMetrics:
    """Built by the node agent when ``cfg.metrics_port`` or ``cfg.metrics_textfile`` is set (else nothing is
    created). ``tick()`` from its loop; ``close()`` at its end (the textfiles written once more)."""

    def __init__(self, agent):
        self.a = agent
        cfg = agent.cfg
        self.job = metrics.job_name(cfg.output.run_dir)
        me = agent.cp.me
        self._node: dict = {"state": str(agent.state), "generation": agent.cp.generation, "bytes_total": 0,
                            "bytes_per_s": 0.0}
        self._live: dict = {}
        self._last = (time.monotonic(), 0)
        self._next = 0.0
        self._failed = self._job_port_failed = self._closing = False
        where = cfg.output.metrics_textfile
        self.node = metrics.Exporter(lambda: metrics.node_samples(self._node),
                                     {"deadpool_job": self.job, "node": str(me)},
                                     port=cfg.output.metrics_port + 1 + me if cfg.output.metrics_port else None,
                                     textfile=os.path.join(where, f"deadpool_{self.job}_node{me}.prom") if where
                                     else None)
        self.view = metrics.JobView(cfg)
        self.jobx = None   # the job's exporter, while this agent coordinates
        self._open_node()

    def _open_node(self) -> None:
        try:
            self.node.start_http()
        except OSError as exc:
            self.a.log.emit("metrics_failed", what=f"node endpoint on port {self.node.port}", error=str(exc))

    def _coordinator(self) -> bool:
        alive = self.a.peers.alive()
        return bool(alive) and min(alive) == self.a.cp.me and not self.a.peers.fenced

    def tick(self) -> None:
        """(the agent's loop) At most once every GATHER_S seconds: a snapshot of the agent's state for both views,
        and the job's endpoint opened or closed as this agent becomes or stops being the coordinator. Never raises:
        a metrics failure is logged once (``metrics_failed``) and training goes on."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + GATHER_S
        try:
            self._gather(now)
        except Exception as exc:  # noqa: BLE001 - the metrics must never end a node agent
            if not self._failed:
                self._failed = True
                self.a.log.emit("metrics_failed", what="gathering the node's state", error=f"{type(exc).__name__}: "
                                                                                           f"{exc}")

    def _gather(self, now: float) -> None:
        a, cp = self.a, self.a.cp
        total = sum(rep.bytes_sent for rep in list(a.reps.values()))
        t0, b0 = self._last
        self._last = (now, total)
        ranks = {lo: cp.train_rank(lo) for lo in range(a.P)}
        fig = a.stragglers.last_figure
        self._node = {"state": str(a.state), "generation": cp.generation, "bytes_total": total,
                      "bytes_per_s": max(0, total - b0) / (now - t0) if now > t0 else 0.0,
                      "committed": {r: a.reps[lo].committed_step for lo, r in ranks.items()
                                    if r is not None and lo in a.reps and a.state == NodeState.TRAINING},
                      "written": {r: a.written[lo] for lo, r in ranks.items() if r is not None and lo in a.written},
                      "step_s": fig[1] if fig else None}
        judge = a.stragglers.judge
        self._live = {"running": not self._closing, "generation": cp.generation, "spares_left": len(cp.spare_nodes),
                      "own_work": ({n: f[0] for n, f in judge.table(now).items()} or None) if judge else None}
        if self._coordinator():
            if self.jobx is None:
                self.jobx = metrics.Exporter(lambda: self.view.refresh(self._live), {"deadpool_job": self.job},
                                             port=a.cfg.output.metrics_port or None,
                                             textfile=os.path.join(a.cfg.output.metrics_textfile,
                                                                   f"deadpool_{self.job}_job.prom")
                                             if a.cfg.output.metrics_textfile else None)
            try:
                self.jobx.start_http()
            except OSError as exc:   # the old coordinator's socket is not closed yet: again at the next tick
                if not self._job_port_failed:
                    self._job_port_failed = True
                    a.log.emit("metrics_failed", what=f"job endpoint on port {self.jobx.port} (tried again every "
                                                      f"{GATHER_S:g} s)", error=str(exc))
        elif self.jobx is not None:   # (a fenced agent) another one coordinates now
            self.jobx.close(final=False)
            self.jobx = None

    def close(self) -> None:
        """The agent leaves: a last snapshot, the textfiles once more, the endpoints closed."""
        self._next = 0.0
        self._closing = True
        try:
            self.tick()
        except Exception:  # noqa: BLE001 - the agent is leaving; its metrics are the least of it
            pass
        if self.jobx is not None:
            self.jobx.close()
        self.node.close()
