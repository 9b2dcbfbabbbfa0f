"""docs/architecture.md's glossary and walk against the code, and the package's docstrings against history.

Pure reads of files: no process starts. What fails here: a glossary row or a hand-off of the walk that names a module
no longer in the package (a move or a rename left the page behind), a walk whose stated count is not its numbered
list, and a docstring or comment that points at an issue number or "this stop" (which a reader cannot open: say what
the code does and why; the history is in git).
"""
from __future__ import annotations

import os
import re

import paths  # tests/paths.py: the checkout's folders, wherever this file lies
ROOT = paths.ROOT
PACKAGE = os.path.join(ROOT, "deadpool_hpc")
ARCHITECTURE = os.path.join(ROOT, "docs", "architecture.md")


def _section(doc: str, heading: str) -> str:
    """The text of ``## heading`` up to the next ``## `` heading."""
    start = doc.index(f"\n## {heading}\n")
    end = doc.find("\n## ", start + 1)
    return doc[start:] if end < 0 else doc[start:end]


def _doc() -> str:
    with open(ARCHITECTURE) as fh:
        return fh.read()


def _module_exists(path: str) -> bool:
    """``path`` as the page writes it: relative to the package (``control/plane.py``, ``placement.py``), else to the
    repository (``tests/runs.py``)."""
    return os.path.isfile(os.path.join(PACKAGE, path)) or os.path.isfile(os.path.join(ROOT, path))


def test_the_glossary_and_the_walk_name_only_modules_that_exist():
    doc = _doc()
    text = _section(doc, "Glossary") + _section(doc, "One failure and one step through the code")
    named = set(re.findall(r"`([A-Za-z_][\w/]*\.py)`", text))
    assert len(named) > 30, named   # the sections do name the code
    missing = sorted(p for p in named if not _module_exists(p))
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_the_glossary_lists_the_id_spaces_and_every_meaning_of_watch():
    glossary = _section(_doc(), "Glossary")
    for word in ("node", "local rank", "virtual process", "training rank", "logical node", "world size",
                 "process group", "communicator", "active node, spare", "replica, holder", "generation", "round",
                 "heartbeat", "suspicion", "fence", "step", "committed step", "snapshot", "slot", "persist round",
                 "checkpoint"):
        assert f"| {word}" in glossary, word
    for module in ("control/topology.py", "agent/ringlink.py", "dataplane/collectives.py", "launch/keeper.py",
                   "launch/slurm_startup.py", "agent/health.py"):   # the six "watch"es
        assert module in glossary.split('**"Watch" means')[1], module


def test_the_walk_states_the_counts_of_its_numbered_lists():
    walk = _section(_doc(), "One failure and one step through the code")
    failure, step = walk.split("**One step**")
    restored = failure.split("hand-offs to the restored state")[0]
    numbered = [int(n) for n in re.findall(r"^(\d+)\. \*\*", restored, re.M)]
    assert numbered == list(range(1, len(numbered) + 1)), numbered
    assert f"**{len(numbered)} hand-offs to the restored state" in failure
    first_update = re.search(r"\*\*(\d+) hand-offs to the first update", failure)
    per_step = [int(n) for n in re.findall(r"^(\d+)\. \*\*", step.split("hand-offs per step")[0], re.M)]
    assert per_step == list(range(1, len(per_step) + 1)), per_step
    assert f"**{len(per_step)} hand-offs per step" in step
    # to the first update: the restored state, the cut step's snapshot (one step's replica path), the all-reduce
    assert first_update is not None and int(first_update.group(1)) == len(numbered) + len(per_step) + 1


HISTORY = re.compile(r"\bissues? #?\d+|\bthis stop\b|closing note", re.I)


def test_no_docstring_or_comment_points_at_an_issue_or_this_stop():
    found = []
    for folder, _dirs, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith((".py", ".sbatch")):
                continue
            path = os.path.join(folder, name)
            with open(path) as fh:
                for i, line in enumerate(fh, 1):
                    if HISTORY.search(line):
                        found.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()[:100]}")
    assert not found, "say what the code does and why (the history is in git):\n" + "\n".join(found)
