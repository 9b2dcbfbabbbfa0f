"""Run summary: derived from the event log alone, so a launcher, a Slurm job or ``deadpool status``
can rebuild it after the fact. Phase boundaries per failure (seconds, DESIGN.md "Recovery"):

- detect:    fault injected (or first suspicion)  -> first suspicion by any survivor
- agree:     first suspicion                      -> last member holds the decision
- rebuild:   decision                             -> last rank joined the new process group
- restore:   process group built                  -> last rank restored its state at the cut step
- recompute: restored                             -> last rank completed its first step after the swap

``recovery_s`` (fault -> first completed step after the swap) is their sum.
"""
from __future__ import annotations

from collections import defaultdict



def build_summary(events: list[dict], config=None) -> dict:
    """Summarise a run from its events (list of dicts as written by events.EventLog)."""
    by = defaultdict(list)
    for e in events:
        by[e["event"]].append(e)
    steps = sorted(by["step"], key=lambda e: (e["step"], e["t"]))
    fin = by["finished"][-1] if by["finished"] else {}
    faults = sorted(by["fault_injected"], key=lambda e: e["t"])
    failures, preemptions = [], []
    prev_t = 0.0
    for d in sorted(by["decision"], key=lambda e: e["generation"]):
        g = d["generation"]
        # after a saved checkpoint (no spare, or preempted): the first step of the requeued attempt
        t_next_attempt = min((e["t"] for e in steps if e.get("generation", 0) > g and e["t"] > d["t_decided"]),
                             default=None)
        if d.get("reason") == "preempted":  # Slurm's SIGUSR2: saved at the cut, requeued, resumed
            asked = [e["t"] for e in by["preempt_requested"] if e.get("generation") == g - 1]
            saved = [e["t"] for e in by["checkpoint_saved"] if e.get("generation") == g]
            preemptions.append({"generation": g, "cut_step": d["cut_step"],
                                "t_signal": min(asked, default=None),
                                "save_s": (max(saved) - min(asked)) if asked and saved else None,
                                "resumed": t_next_attempt is not None,
                                "signal_to_resume_s": (t_next_attempt - min(asked))
                                if asked and t_next_attempt is not None else None})
            if not d["failed_nodes"]:
                prev_t = d["t_decided"]
                continue
            # a node was lost as well: it is also a failure (no swap; saved and requeued)
        # the fault behind this decision: the last one injected since the previous decision
        fault = next((f for f in reversed(faults) if prev_t < f["t"] < d["t_decided"]), None)
        prev_t = d["t_decided"]
        sus = [e["t"] for e in by["suspect"] if e.get("generation") == g - 1]
        rec = [e for e in by["recovered"] if e.get("generation") == g]
        res = [e["t"] for e in by["resumed"] if e.get("generation") == g]
        t_detect = min(sus) if sus else d["t_decided"]
        t0 = fault["t"] if fault else t_detect
        t_agree = max([e["t_agreed"] for e in rec], default=d["t_decided"])
        t_rebuild = max([e["t_rebuilt"] for e in rec], default=None)
        t_restore = max([e["t_restored"] for e in rec], default=None)
        t_resume = max(res, default=None)
        requeued = bool(d.get("exhausted"))
        if requeued:  # no spare: checkpoint, requeue, resume; "resumed" = first step of the new attempt
            t_resume = t_next_attempt
            rec = [e for e in by["resumed_from_checkpoint"] if e.get("generation") == g + 1]
            t_rebuild = t_restore = max([e["t"] for e in rec], default=t_agree)
        def span(a, b):
            return (b - a) if a is not None and b is not None else None

        phases = {"detect": span(t0, t_detect), "agree": span(t_detect, t_agree), "rebuild": span(t_agree, t_rebuild),
                  "restore": span(t_rebuild, t_restore), "recompute": span(t_restore, t_resume)}
        failures.append({
            "kind": fault["kind"] if fault else "detected",
            "target": fault["target"] if fault else ",".join(f"node{n}" for n in d["failed_nodes"]),
            "step": fault["step"] if fault else d["cut_step"],
            "generation": g,
            "failed_nodes": d["failed_nodes"],
            "promoted": d["promoted"],
            "spare_nodes_used": sorted({m // (config.ranks_per_node if config else 1) for m in d["promoted"].values()}),
            "cut_step": d["cut_step"],
            "recovery_s": (t_resume - t0) if t_resume is not None else None,
            "phases": phases,
            "recomputed_steps": d["recomputed_steps"],
            "requeued": requeued,
        })
    rates = sorted(e["tokens_per_s"] for e in steps if e.get("tokens_per_s"))
    times = sorted(e["step_s"] for e in steps if e.get("step_s"))
    return {
        "completed": bool(fin) and (config is None or fin.get("steps") == config.steps),
        # medians over rank 0's logged steps (recomputed ones included): the scaling study's numbers
        "median_step_s": times[len(times) // 2] if times else None,
        "median_tokens_per_s": rates[len(rates) // 2] if rates else None,
        "steps_completed": fin.get("steps", steps[-1]["step"] if steps else 0),
        "first_loss": steps[0].get("loss") if steps else None,
        "final_loss": steps[-1].get("loss") if steps else None,
        "world_size": fin.get("world_size", config.world_size if config else None),
        "spares_left": fin.get("spares_left"),
        "param_digest": fin.get("param_digest"),
        "swaps": sum(1 for f in failures if f["promoted"]),
        "requeues": len(by["requeued"]),
        "failures": failures,
        "preemptions": preemptions,
        "bytes_replicated_per_rank_per_step": fin.get("bytes_per_rank_per_step"),
        "errors": [e.get("error") for e in by["error"]],
    }

