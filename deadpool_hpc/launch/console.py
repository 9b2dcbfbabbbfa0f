"""The live console (rich): progress, node roles and recoveries as they happen, then a summary.

Reads nothing but events (events.EventLog records), so it shows the same for a local run and for a
Slurm job whose event log it tails.
"""
from __future__ import annotations

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ..cause import process_line
from ..summary import PHASES


class LiveView:
    """Feed it events with ``update(events)``; use as a context manager around the run."""

    def __init__(self, cfg, console: Console | None = None):
        self.cfg = cfg
        self.console = console or Console()
        self.last_step: dict = {}
        self.roles = {n: ("active" if n < cfg.layout.nodes else "spare") for n in range(cfg.layout.total_nodes)}
        self.lines: list[Text] = []
        self.t_fault: float | None = None
        self._detected = False
        self.requeues = 0
        self.step_times: dict[int, dict] = {}   # node -> {"own_s", "step_s"}: the straggler check's figures
        self.stragglers: set[int] = set()       # nodes being swapped out for slowness
        self.live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
        self._started = False

    def __enter__(self):
        return self  # the display starts with the first events: a run refused before it starts shows nothing

    def __exit__(self, *exc):
        if self._started:
            self.live.update(self._render())
            self.live.__exit__(*exc)

    def _note(self, text: str, style: str = "") -> None:
        self.lines.append(Text(text, style=style))
        self.lines = self.lines[-12:]

    def update(self, events: list[dict]) -> None:
        for e in events:
            kind = e["event"]
            if kind == "step":
                self.last_step = e
            elif kind == "fault_injected":
                self.t_fault = e["t"]
                self._detected = False
                where = "" if e["target"] == f"node{e['node']}" else f" on node{e['node']}"
                when = f"step {e['step']}" if e.get("phase") is None else f"recovery phase {e['phase']}"
                if e["kind"] == "nic_down":   # the node still runs: its data plane is down (a test's --nic-down)
                    self._note(f"{when}: data-plane interface down -> {e['target']} (gloo's interface "
                               f"{e.get('ifname')!r})", "bold red")
                    continue
                self.roles[e["node"]] = {"kill": "dead", "slow": "slow"}.get(e["kind"], "hung")
                self._note(f"{when}: {e['signal']} -> {e['target']}{where} (pids {e['pids']})", "bold red")
            elif kind == "node_step_times":
                self.step_times = {int(n): f for n, f in e["nodes"].items()}
            elif kind == "straggler_detected":
                if e["action"] == "swap":
                    self.stragglers.add(e["node"])
                self._note(f"  straggler: node{e['node']}'s own work {e['own_s'] * 1e3:.1f} ms/step, "
                           f"{e['ratio']:.2f} x the others' median for {e['slow_for_s']:.0f} s: "
                           + ("planned swap" if e["action"] == "swap" else f"reported only ({e['why']})"), "yellow")
            elif kind == "node_returning":
                self.roles[e["node"]] = "checking"
            elif kind == "node_returned":
                self.roles[e["node"]] = f"spare (back {e.get('returns', 1)}x)"
                self._note(f"  node{e['node']} is back in the spare pool ({e['seconds']:.2f} s after its failure)",
                           "green")
            elif kind == "node_quarantined":
                self.roles[e["node"]] = "out: quarantined"
                self._note(f"  node{e['node']} stays out: {e['reason'][:140]}", "yellow")
            elif kind == "hang_detected":
                inside = f" in `{e['hung_in']['function']}`" if e.get("hung_in") else ""
                self._note(f"  node{e.get('node')}: training thread stuck{inside} for {e['stuck_s']:.1f} s at "
                           f"{e['where']}: fenced by its watchdog", "yellow")
            elif kind == "process_exited":
                self._note(f"  {process_line(dict(e, what='exit'))[:200]}", "yellow")
            elif kind == "suspect" and not self._detected:
                self._detected = True
                if self.t_fault is not None:
                    since = f"+{e['t'] - self.t_fault:.2f} s"
                elif e.get("last_heard") is not None:
                    since = f"~{e['t'] - e['last_heard']:.2f} s after it was last heard (not injected: estimated)"
                else:
                    since = "not injected"
                self._note(f"  detected: node{e['node']} suspected by MPI rank {e.get('mpi_rank')} ({since})", "yellow")
            elif kind == "recovery_round_failed" and e.get("rank") == 0:
                self._note(f"  recovery round failed, next round: {e['error'][:120]}", "yellow")
            elif kind == "decision" and e.get("error"):
                self._note(f"  no recovery possible: {e['error']}: {e.get('message', '')[:160]}", "bold red")
            elif kind == "decision":
                self._detected = False
                for n in e["failed_nodes"]:
                    if self.roles.get(n) != "checking":   # (a node on its way back keeps its role)
                        self.roles[n] = "out: slow" if n in self.stragglers else "dead"
                    self.step_times.pop(n, None)
                for node in {m // self.cfg.layout.ranks_per_node for m in e["promoted"].values()}:
                    self.roles[node] = "active"
                base = self.t_fault or e["t_decided"]
                lost = f"lost node(s) {e['failed_nodes']}" if e["failed_nodes"] else "no node lost"
                plan = (f"promoted {e['promoted']}" if e["promoted"] else
                        "preempted: save a checkpoint" if e.get("reason") == "preempted" else
                        "crash loop: save a checkpoint and stop" if e.get("crash_loop") else
                        "no spare left: save a checkpoint" if e.get("exhausted") else
                        f"{e.get('reason')}: no promotion")
                self._note(f"  agreed: generation {e['generation']}, {lost}, {plan}, cut at step {e['cut_step']} "
                           f"(+{e['t_decided'] - base:.2f} s)", "cyan")
            elif kind == "recovered" and e.get("rank") == 0:
                base = self.t_fault or e["t_fail"]
                self._note(f"  rebuilt (+{e['t_rebuilt'] - base:.2f} s), restored at step {e['cut_step']} "
                           f"(+{e['t_restored'] - base:.2f} s)", "cyan")
            elif kind == "resumed" and e.get("rank") == 0:
                since = "the fault" if self.t_fault else "rank 0 noticed the failure (not injected: see the summary)"
                base = self.t_fault or e["t_fail"]
                self._note(f"  resumed: step {e['step']} completed (+{e['t'] - base:.2f} s after {since})",
                           "bold green")
                self.t_fault = None  # the next failure is timed from its own fault
            elif kind == "checkpoint_saved" and e.get("reason") == "crash loop":
                self._note(f"  crash loop: checkpoint saved at step {e['step']}; the run stops here (never "
                           f"requeued: it would resume into the same crash)", "bold yellow")
            elif kind == "checkpoint_saved":
                self._note(f"  {self.checkpoint_line(e)}", "bold yellow")
            elif kind == "failure_follows_work":
                self._note(f"  node{e.get('node')}: rank {e['rank']} ended by {e['end']} at step {e['step']} as on "
                           f"another node: the work's failure, not the node's (no quarantine)", "yellow")
            elif kind == "requeued":
                self.requeues += 1
                self.roles = {n: ("active" if n < self.cfg.layout.nodes else "spare") for n in self.roles}
                self._note(f"requeued (attempt {e['attempt']}): restarting from the checkpoint", "bold yellow")
            elif kind == "resumed_from_checkpoint" and e.get("rank") == 0:
                base = self.t_fault or e["t"]
                self._note(f"  resumed from the checkpoint at step {e['step']} (+{e['t'] - base:.2f} s)", "bold green")
            elif kind == "error":
                self._note(f"error on MPI rank {e.get('mpi_rank')}: {e['error']}", "bold red")
            elif kind == "preempt_requested":
                self._note(f"MPI rank {e.get('mpi_rank')} got {e.get('signal') or 'SIGUSR2/SIGTERM'} (Slurm's "
                           f"preemption or time-limit warning): every process saves the cut step and leaves",
                           "bold yellow")
            elif kind == "fault_skipped":
                self._note(f"step {e['step']}: {e['kind']} {e['target']} skipped: {e['reason']}", "yellow")
        if not self._started:
            self._started = True
            self.live.__enter__()
        self.live.update(self._render())

    def checkpoint_line(self, e: dict) -> str:
        """What a ``checkpoint_saved`` event means for this run: what the local launcher does next
        (launch/local.py requeues only with --requeue, at most ``max_requeues`` times)."""
        why = "preempted (SIGUSR2/SIGTERM)" if e.get("reason") == "preempted" else "no spare left"
        saved = f"{why}: checkpoint saved at step {e['step']}"
        if self.cfg.persistence.requeue and self.requeues < self.cfg.persistence.max_requeues:
            return f"{saved}; requeueing: the run restarts from it"
        if self.cfg.persistence.requeue:
            return (f"{saved}; the run stops here: it was requeued {self.requeues} times already, the most "
                    f"--requeue allows ({self.cfg.persistence.max_requeues})")
        return f"{saved}; the run stops here (without --requeue nothing restarts it)"

    def _render(self):
        s = self.last_step
        head = Text.assemble(
            ("deadpool ", "bold"),
            f"step {s.get('step', 0)}/{self.cfg.train.steps}  ",
            f"loss {s['loss']:.3f}  " if "loss" in s else "",
            f"{s.get('tokens_per_s', 0):,.0f} tok/s  ",
            f"generation {s.get('generation', 0)}",
        )
        nodes = Table(show_header=True, header_style="bold", box=None)
        nodes.add_column("node")
        nodes.add_column("role")
        nodes.add_column("step (own work)", justify="right")
        style = {"active": "green", "spare": "blue", "dead": "red", "hung": "red", "slow": "yellow",
                 "out: slow": "red"}
        for n, role in sorted(self.roles.items()):
            f = self.step_times.get(n)
            nodes.add_row(f"node{n}", Text(role, style=style.get(role, "")),
                          f"{f['step_s'] * 1e3:.0f} ms ({f['own_s'] * 1e3:.0f} ms)" if f and role != "spare" else "")
        return Group(head, nodes, *self.lines)


def print_summary(summary: dict, console: Console | None = None) -> None:
    console = console or Console()
    console.print()
    t = Table(title="run summary", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value")
    t.add_row("completed", str(summary["completed"]) + (f" (stopped by {summary['interrupted']})"
                                                         if summary.get("interrupted") else ""))
    t.add_row("steps", str(summary["steps_completed"]))
    t.add_row("failures / swaps / requeues", f"{len(summary['failures'])} / {summary['swaps']} / "
                                             f"{summary.get('requeues', 0)}")
    t.add_row("first -> final loss", f"{summary['first_loss']:.4f} -> {summary['final_loss']:.4f}"
              if summary["first_loss"] is not None and summary["final_loss"] is not None else "-")
    t.add_row("world size / spares left", f"{summary['world_size']} / {summary['spares_left']}")
    if summary.get("returns") or summary.get("quarantined"):
        back = summary.get("returns") or []
        t.add_row("back in the spare pool / kept out",
                  f"{len(back)} / {len(summary.get('quarantined') or [])}"
                  + (f" (nodes {sorted({x['node'] for x in back})}, median "
                     f"{sorted(x['seconds'] for x in back)[len(back) // 2]:.2f} s after the failure)" if back else ""))
    if summary.get("start_up_s") is not None:
        t.add_row("start-up (first agent -> first step)", f"{summary['start_up_s']:.1f} s")
    t.add_row("param digest (sha256)", str(summary["param_digest"])[:24] + "...")
    for x in summary.get("stragglers") or []:
        t.add_row(f"straggler node{x['node']}", f"{x['ratio']:.2f} x the others' own work per step for "
                  f"{x['slow_for_s']:.0f} s: " + ("swapped out" if x["action"] == "swap" else f"reported ({x['why']})"))
    if summary.get("bytes_replicated_per_rank_per_step"):
        t.add_row("replicated / rank / step", f"{summary['bytes_replicated_per_rank_per_step']:,} bytes")
    console.print(t)
    if summary["failures"]:
        f = Table(title="recoveries (seconds)", show_header=True, header_style="bold")
        f.add_column("")
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        for x in summary["failures"]:
            at = x["step"] if x.get("phase") is None else x["phase"]
            f.add_column(f"{x['kind']} {x['target']} @{at}", justify="right")
        rows = [("fault -> first step after recovery", [fmt(x["recovery_s"]) for x in summary["failures"]])]
        rows += [(f"  {p}", [fmt(x["phases"][p]) for x in summary["failures"]]) for p in PHASES]
        rows += [("fault time from", [x.get("t_fault_source", "-") for x in summary["failures"]]),
                 ("cause", [x.get("cause") or "-" for x in summary["failures"]]),
                 ("outcome", [x.get("outcome", "-") + (" (during start-up: fresh start)" if x.get("during_start_up")
                                                        else "") for x in summary["failures"]]),
                 ("cut step", [str(x["cut_step"]) for x in summary["failures"]]),
                 ("steps recomputed", [str(x["recomputed_steps"]) for x in summary["failures"]]),
                 ("replaced by", [("checkpoint + requeue" if x.get("recovery_s") is not None
                                   else "checkpoint, run stopped")
                                  if x.get("requeued") else
                                  ", ".join(f"node{n}" for n in x.get("spare_nodes_used", [])) or "-"
                                  for x in summary["failures"]])]
        for name, vals in rows:
            f.add_row(name, *vals)
        console.print(f)
        console.print(Text("why each failure happened", style="bold"))
        for i, x in enumerate(summary["failures"], 1):
            at = x["step"] if x.get("phase") is None else x["phase"]
            console.print(Text.assemble((f"  {i}. {x['kind']} {x['target']} @{at}: ", "bold"),
                                        x.get("why") or "-"), soft_wrap=True)
    console.print(f"param_digest {summary['param_digest']}", soft_wrap=True)
    for err in summary.get("errors") or []:
        console.print(Text.assemble(("error: ", "bold red"), str(err)))
