"""Run summary: derived from the event log alone, so a launcher, a Slurm job or ``deadpool status``
can rebuild it after the fact. One failure per recovery decision that lost a node (or failed to be
made); phase boundaries per failure (seconds, DESIGN.md "Recovery"):

- detect:    the fault                -> first suspicion by any survivor
- agree:     first suspicion          -> last agent gave its training processes their roles (``t_agreed``: the
                                         decision, the restores its sources sent, the agents' rebuild barrier)
- rebuild:   roles given              -> last rank joined the new process group
- restore:   process group built      -> last rank restored its state at the cut step
- recompute: restored                 -> last rank completed its first step after the swap

``recovery_s`` (fault -> first completed step after the swap) is their sum; ``t_fault`` is the fault's wall time, so
each phase's span is ``t_fault`` plus the phases before it. The fault's time is the
``fault_injected`` event when our own injection caused it; the ``node_failed`` event of the lost node's agent
when that agent saw one of its training processes exit ("process exit seen by its agent", milliseconds after it);
otherwise (a whole node lost, its agent included) nobody saw it happen, and it is *estimated* as the last time any
survivor heard from the lost node (``t_fault_source``: "last heartbeat heard"). A decision whose round failed (a second
fault during the recovery) has no rebuild/restore of its own; its failure is recovered when a later round
resumes training, and ``rounds`` counts the decisions it took.
"""
from __future__ import annotations

from collections import defaultdict

from .cause import cause_line

PHASES = ("detect", "agree", "rebuild", "restore", "recompute")   # a failure's recovery phases, in order


def build_summary(events: list[dict], config=None) -> dict:  # noqa: C901
    """Summarise a run from its events (list of dicts as written by events.EventLog)."""
    by = defaultdict(list)
    for e in events:
        by[e["event"]].append(e)
    steps = sorted(by["step"], key=lambda e: (e["step"], e["t"]))
    fin = by["finished"][-1] if by["finished"] else {}
    faults = sorted(by["fault_injected"], key=lambda e: e["t"])
    used: set[int] = set()
    failures, preemptions = [], []
    # two decisions for one generation: the first was never applied (its coordinator died before anyone held
    # it, and the next coordinator decided that generation again); the last one counts
    decisions = sorted({e["generation"]: e for e in sorted(by["decision"], key=lambda e: e["t_decided"])}.values(),
                       key=lambda e: e["generation"])
    P = config.layout.ranks_per_node if config else 1
    for d in decisions:
        g = d["generation"]
        if "reason" not in d and not d.get("error"):
            continue
        # after a saved checkpoint (no spare, or preempted): the first step of the requeued attempt
        t_next_attempt = min((e["t"] for e in steps if e.get("generation", 0) > g and e["t"] > d["t_decided"]),
                             default=None)
        if d.get("reason") == "preempted":  # Slurm's SIGUSR2: saved at the cut, requeued, resumed
            asked = [e["t"] for e in by["preempt_requested"] if e.get("generation") == g - 1]
            saved = [e["t"] for e in by["checkpoint_saved"] if e.get("generation") == g]
            skipped = any(e.get("generation") == g for e in by["checkpoint_skipped"])
            if skipped:  # before the attempt's first step: the next attempt resumes from the same checkpoint, so
                # its generations are this attempt's again (node.py: the checkpoint's generation + 1)
                t_next_attempt = min((e["t"] for e in steps if e["t"] > d["t_decided"]), default=None)
            preemptions.append({"generation": g, "cut_step": d["cut_step"], "skipped": skipped,
                                "t_signal": min(asked, default=None),
                                "save_s": (max(saved) - min(asked)) if asked and saved else None,
                                "resumed": t_next_attempt is not None,
                                "signal_to_resume_s": (t_next_attempt - min(asked))
                                if asked and t_next_attempt is not None else None})
        if not d.get("failed_nodes") and not d.get("error"):
            continue  # a preemption alone, or a rebuild with nobody lost
        failures += _failures(d, by, steps, faults, used, t_next_attempt, P)
    # the swaps into the crash before the loop was found: say so, not just "not recovered"
    for e in by["crash_loop"][-1:]:
        for f in failures:
            if f["outcome"].startswith("not recovered") and set(f["failed_nodes"]) <= set(e.get("nodes") or []):
                f["outcome"] = (f"swapped, then the same crash on the spare (rank {e.get('rank')} ended by "
                                f"{e.get('end')} at step {e.get('step')}: crash loop)")
    hellos = [e["t"] for e in by["hello"] if e.get("role") == "agent"]
    first_step = min((e["t"] for e in by["step"]), default=None)
    rates = sorted(e["tokens_per_s"] for e in steps if e.get("tokens_per_s"))
    times = sorted(e["step_s"] for e in steps if e.get("step_s"))
    return {
        "completed": bool(fin) and (config is None or fin.get("steps") == config.train.steps),
        # medians over rank 0's logged steps (recomputed ones included): the scaling study's numbers
        "median_step_s": times[len(times) // 2] if times else None,
        "median_tokens_per_s": rates[len(rates) // 2] if rates else None,
        "steps_completed": fin.get("steps", steps[-1]["step"] if steps else 0),
        # seconds from the first node agent's hello to the first training step logged (a start-up's recoveries
        # included); None when no step was logged
        "start_up_s": (first_step - min(hellos)) if hellos and first_step is not None else None,
        "first_loss": steps[0].get("loss") if steps else None,
        "final_loss": steps[-1].get("loss") if steps else None,
        "world_size": fin.get("world_size", config.layout.world_size if config else None),
        # the final generation's spares as its training processes were told, and the nodes readmitted to it since
        # (agent/comeback.py: a readmission changes no generation and tells no training process)
        "spares_left": None if fin.get("spares_left") is None else fin["spares_left"] + sum(
            1 for e in by["node_readmitted"] if e.get("generation") == fin.get("generation")),
        # nodes back in the spare pool after their training processes failed, and nodes kept out (agent/comeback.py)
        "returns": [{k: e.get(k) for k in ("node", "generation", "seconds", "health_s")} for e in by["node_returned"]],
        "quarantined": [{k: e.get(k) for k in ("node", "reason")} for e in by["node_quarantined"]],
        "param_digest": fin.get("param_digest"),
        "swaps": sum(1 for f in failures if f["promoted"] and f["recovery_s"] is not None),
        "planned_swaps": sum(1 for f in failures
                             if f["outcome"].startswith("planned swap") and f["recovery_s"] is not None),
        "swaps_refused": [{k: e.get(k) for k in ("node", "detector", "reason", "why")} for e in by["swap_refused"]],
        # the straggler check (agent/stragglers.py): each node found slow, and what was done (swap or report)
        "stragglers": [{k: e.get(k) for k in ("node", "generation", "ratio", "own_s", "median_s", "slow_for_s",
                                              "action", "why", "site")} for e in by["straggler_detected"]],
        "requeues": len(by["requeued"]),
        # Slurm: nodes lost before the agents' MPI world existed; the step was started again without them
        # (launch/slurm_startup.py)
        "relaunches": [{"launch": e.get("launch"), "lost_hosts": e.get("lost_hosts"),
                        "spares_left": e.get("spares_left"),
                        "why": e.get("why"),
                        "found_after_s": next((x.get("startup_s") for x in by["startup_node_lost"]
                                               if x.get("launch") == e.get("launch")), None)}
                       for e in by["relaunched"]],
        "failures": failures,
        "preemptions": preemptions,
        "bytes_replicated_per_rank_per_step": fin.get("bytes_per_rank_per_step"),
        # rank 0's snapshots, by how they were copied: inline after the update, or by the background copier
        "snapshots": fin.get("snapshots"),
        "errors": list(dict.fromkeys(e.get("error") for e in by["error"])),   # each once (every rank may say it)
        # background persistence (agent/persister.py) and a run directory that fails writes (events.py: counted lines)
        "persist": {"committed": [e.get("step") for e in by["checkpoint_persisted"]],
                    "failed": len(by["persist_failed"]),
                    "reasons": list(dict.fromkeys(e.get("reason") for e in by["persist_failed"]))[:8]},
        "checkpoint_failed": [{k: e.get(k) for k in ("step", "reason", "error", "node")}
                              for e in by["checkpoint_failed"]],
        # a crash that followed the work (control/crashloop.py) and stopped the run: the rank, its end, the steps, the
        # nodes it ran into (not their fault), the checkpoint saved (None: none needed), the line in ``errors``
        "crash_loop": next(({k: e.get(k) for k in ("rank", "end", "step", "steps", "nodes", "repeats", "limit",
                                                    "checkpoint_step", "error")}
                            for e in by["crash_loop"][-1:]), None),
        "event_log": event_log_health(by["event_log_failed"]),
    }


def event_log_health(reports: list[dict]) -> dict:
    """What the processes' ``event_log_failed`` reports say (events.py): lines not written (``failed``), dropped
    (a full queue, or nothing to spill to), the processes concerned, the distinct errors. Each process's reports
    carry running counts: its largest counts."""
    per: dict = {}
    for e in reports:
        key = (e.get("pid"), e.get("path"))
        old = per.get(key, {})
        per[key] = {k: max(old.get(k, 0), e.get(k) or 0) for k in ("failed", "dropped")}
    return {"failed": sum(v["failed"] for v in per.values()), "dropped": sum(v["dropped"] for v in per.values()),
            "processes": len({pid for pid, _ in per}),
            "errors": list(dict.fromkeys(e.get("error") for e in reports if e.get("error")))[:8]}


def _failures(d: dict, by, steps, faults, used: set, t_next_attempt, P: int) -> list[dict]:
    """The failures one decision recovers: one per injected fault behind it (the earliest not yet matched
    fault on each lost node, before the decision), and one for the lost nodes no injection explains."""
    lost = set(d.get("failed_nodes") or [])
    out, unexplained = [], set(lost)
    for i, f in enumerate(faults):
        if i not in used and f["t"] < d["t_decided"] and f.get("node") in unexplained:
            used.add(i)
            unexplained.discard(f["node"])
            out.append(_failure(d, by, f, {f["node"]}, t_next_attempt, P))
    if unexplained or not out:
        out.append(_failure(d, by, None, unexplained, t_next_attempt, P))
    return out


def _failure(d: dict, by, fault, lost: set, t_next_attempt, P: int) -> dict:
    g = d["generation"]
    sus = [e for e in by["suspect"] if e.get("generation") == g - 1 and (e.get("node") in lost or not lost)]
    t_detect = min((e["t"] for e in sus), default=d["t_decided"])
    heard = [e["last_heard"] for e in sus if e.get("last_heard") is not None]
    hung = [e for e in by["hang_detected"] if e.get("node") in lost and e.get("generation") == g - 1]
    exits = [e for e in by["node_failed"] if e.get("node") in lost and e.get("generation") == g - 1
             and e.get("cause") == "exit"]
    # a planned swap (agent/health.py): the node left at a step boundary on a detector's request
    planned = [e for e in by["swap_requested"] if e.get("node") in lost and e["t"] < d["t_decided"]]
    planned = planned if any(e.get("cause") == "planned" for e in by["node_failed"] if e.get("node") in lost
                             and e.get("generation") == g - 1) else []
    if fault is not None and not (fault["kind"] == "slow" and planned):
        t0, source = fault["t"], "fault_injected"
    elif planned:  # from the moment the detector saw the reason (a drain, an operator's request)
        t0, source = max(e["t_seen"] for e in planned), f"planned swap requested ({planned[-1].get('detector')})"
    elif exits:  # its agent saw a training process exit (pidfd): the fault is that moment, give or take ms
        t0, source = min(e["t"] for e in exits), "process exit seen by its agent"
    elif hung:  # a watchdog fenced it: the fault is when its training thread last made progress
        t0, source = min(e["t"] - e["stuck_s"] for e in hung), "last progress of its training thread (watchdog)"
    elif heard:
        # a heartbeat still in flight can be read by one survivor after another has already suspected: the fault
        # happened no later than the first suspicion
        t0, source = min(max(heard), t_detect), "last heartbeat heard (estimated)"
    else:
        t0, source = t_detect, "first suspicion (no earlier trace)"
    causes = sorted({e.get("cause") for e in by["node_failed"] if e.get("node") in lost and e.get("generation") == g - 1
                     and e.get("cause")})
    rec = [e for e in by["recovered"] if e.get("generation") == g]
    # recovered when training resumed: this decision's round, or a later one if this round failed
    later = [e for e in by["resumed"] if e.get("generation", -1) >= g and e["t"] > d["t_decided"]]
    t_resume = min((e["t"] for e in later), default=None)
    t_agree = max([e["t_agreed"] for e in rec], default=d["t_decided"])
    t_rebuild = max([e["t_rebuilt"] for e in rec], default=None)
    t_restore = max([e["t_restored"] for e in rec], default=None)
    loop = d.get("crash_loop")
    requeued = bool(d.get("exhausted")) and not loop
    if requeued:  # no spare: checkpoint, requeue, resume; "resumed" = first step of the new attempt
        t_resume = t_next_attempt
        res = [e for e in by["resumed_from_checkpoint"] if e.get("generation") == g + 1]
        t_rebuild = t_restore = max([e["t"] for e in res], default=t_agree)
    rounds = 1 + len({e["generation"] for e in by["decision"]
                      if e["generation"] > g and (t_resume is None or e["t_decided"] < t_resume)})

    def span(a, b):
        return (b - a) if a is not None and b is not None else None

    spares = {v for k, v in (d.get("replaced") or {}).items() if int(k) in lost}
    promoted = {r: m for r, m in (d.get("promoted") or {}).items() if m // P in spares}
    if d.get("error"):
        outcome = f"unrecoverable: {d['error']}: {d.get('message', '')}"
        if hung and len(hung) >= len(lost):
            outcome += (f" (every lost node was fenced by its watchdog: a step took longer than --hang-timeout "
                        f"{hung[0].get('timeout_s')} s; raise it above your longest step)")
    elif loop:
        outcome = (f"crash loop: rank {loop['rank']} ended by {loop['end']} at step {loop['steps'][0]} on "
                   f"{', '.join(f'node{n}' for n in loop['nodes'])} (the work, not the node): checkpoint saved, run "
                   "stopped")
    elif requeued:
        outcome = "checkpoint saved" + (" + requeue" if t_next_attempt is not None else "")
    elif promoted and t_resume is None:
        outcome = "not recovered (the run ended before training resumed)"
    elif promoted:
        outcome = ("planned swap" if planned else "hot swap") + ("" if rec else " (its round failed; a later round "
                                                                          "recovered it)")
    else:
        outcome = "spare lost" if lost else d.get("reason", "")
    out = {
        "kind": fault["kind"] if fault else ("planned swap" if planned else "not injected"),
        "target": fault["target"] if fault else ",".join(f"node{n}" for n in sorted(lost)),
        "reason": planned[-1].get("reason") if planned and (not fault or fault["kind"] == "slow") else None,
        "step": fault.get("step") if fault else d.get("cut_step"),
        "phase": fault.get("phase") if fault else None,
        # what its agent saw (exit, hang, startup_failed, startup_timeout, health_check, preflight_slow,
        # preflight_link, planned), when its agent saw it
        "cause": ",".join(causes) or None,
        # lost before every rank's first snapshot was committed: the ranks without one started again from their
        # initial state (agreement.decide's fresh start)
        "during_start_up": bool(d.get("fresh")),
        "fresh_ranks": list(d.get("fresh") or []),
        "generation": g,
        "failed_nodes": sorted(lost),
        "promoted": promoted,
        "spare_nodes_used": sorted(spares),
        "cut_step": d.get("cut_step"),
        "t_fault": t0,          # wall time of the fault (seconds since the epoch), from ``t_fault_source``
        "t_fault_source": source,
        "recovery_s": span(t0, t_resume),
        "phases": {"detect": span(t0, t_detect), "agree": span(t_detect, t_agree), "rebuild": span(t_agree, t_rebuild),
                   "restore": span(t_rebuild, t_restore), "recompute": span(t_restore, t_resume)},
        "recomputed_steps": d.get("recomputed_steps"),
        "requeued": requeued,
        "rounds": rounds,
        "outcome": outcome,
        # why: what the lost nodes' agents saw of their training processes (an exit's status and stderr tail, a
        # hang's stacks), the agents' own reasons for the other causes, and Slurm's view of the lost hosts
        "processes": _processes(by, lost, g),
        "reasons": list(dict.fromkeys(e.get("reason") for e in by["node_failed"] if e.get("node") in lost
                                      and e.get("generation") == g - 1 and e.get("reason")))[:4],
        "slurm": _slurm_states(by, lost, g),
    }
    out["why"] = cause_line(out)
    return out


def _processes(by, lost: set, g: int) -> list[dict]:
    """Per lost node, the training process whose exit or hang its agent reported first (``process_exited``,
    ``hang_detected`` of generation ``g - 1``): what happened, its rank and step, and the evidence."""
    seen = sorted([e for e in by["process_exited"] + by["hang_detected"]
                   if e.get("node") in lost and e.get("generation") == g - 1], key=lambda e: e["t"])
    out, nodes = [], set()
    for e in seen:
        if e.get("node") in nodes:
            continue
        nodes.add(e.get("node"))
        p = {k: e.get(k) for k in ("node", "local", "rank", "step", "pid")}
        if e["event"] == "hang_detected":
            p.update(what="hang", stuck_s=e.get("stuck_s"), timeout_s=e.get("timeout_s"), hung_in=e.get("hung_in"),
                     stack_source=e.get("stack_source"), stack_s=e.get("stack_s"), stack=e.get("stack"),
                     stack_error="; ".join(e.get("stack_errors") or []) or None)
        else:
            p.update(what="exit", rc=e.get("rc"), signal=e.get("signal"), during_start_up=e.get("during_start_up"),
                     stderr_tail=e.get("stderr_tail"))
        out.append(p)
    return out


def _slurm_states(by, lost: set, g: int) -> list[dict]:
    """Slurm's State and Reason of each lost node's host (``node_state`` events of launch/slurm_job.py's watcher):
    the last one recorded for the decision of generation ``g``."""
    last: dict = {}
    for e in sorted(by["node_state"], key=lambda e: e["t"]):
        if e.get("lost_node") in lost and e.get("generation") == g:
            last[e["lost_node"]] = {k: e.get(k) for k in ("lost_node", "host", "state", "reason", "after_s", "settled")}
    return [last[n] for n in sorted(last)]
