"""The package's import graph has no cycle, between files nor between rooms: dependencies point one way (launch ->
agent, worker -> planes -> shared rooms -> small shared types). A room is a first-level folder of the package
(``agent/``, ``ipc/``, ...) or a module at its top (``config.py``); a piece that two rooms share lives in a room
below both, not in one of them. Every import counts, the ones inside functions too (a lazy import hides a cycle, it
does not remove it). Pure logic: the sources are parsed (ast), nothing is imported."""
from __future__ import annotations

import ast
import os

import pytest

import paths  # tests/paths.py: the checkout's folders, wherever this file lies
ROOT = os.path.join(paths.ROOT, "deadpool_hpc")
PKG = "deadpool_hpc"


def _modules(root: str = ROOT, pkg: str = PKG) -> dict[str, str]:
    """Module name -> file, for every .py file of the package (a package is named by its __init__.py)."""
    mods = {}
    for d, _dirs, files in os.walk(root):
        rel = os.path.relpath(d, os.path.dirname(root)).replace(os.sep, ".")
        for f in files:
            if f.endswith(".py"):
                mods[rel if f == "__init__.py" else f"{rel}.{f[:-3]}"] = os.path.join(d, f)
    assert f"{pkg}.launch.cli" in mods or pkg != PKG, sorted(mods)
    return mods


def _resolve(name: str, mods: dict[str, str]) -> str | None:
    """The innermost module of the package that ``name`` (a module, or a module plus an attribute) names."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(mods: dict[str, str], pkg: str = PKG) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at the top, in a function, or under TYPE_CHECKING alike).
    The implicit import of a module's parent packages is not an edge (it cannot make a cycle by itself)."""
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        here = mod if is_pkg else mod.rpartition(".")[0]
        with open(path) as fh:
            tree = ast.parse(fh.read(), path)
        deps: set[str] = set()
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" for a in node.names]  # a submodule, or a name in base
            for t in targets:
                if t == pkg or t.startswith(pkg + "."):
                    dep = _resolve(t, mods)
                    if dep and dep != mod:
                        deps.add(dep)
        graph[mod] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle (its modules, the first repeated at the end), or None. Depth-first search, three colours."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def room(mod: str) -> str:
    """The room of a module: every module under ``pkg/agent/`` is ``pkg.agent``, ``pkg/config.py`` is ``pkg.config``,
    the package's ``__init__`` is ``pkg``."""
    return ".".join(mod.split(".")[:2])


def rooms(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph contracted to the package's rooms: room -> the other rooms it imports."""
    out: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        here = room(mod)
        out.setdefault(here, set()).update(room(d) for d in deps if room(d) != here)
    return out


def test_find_cycle_sees_a_lazy_cycle(tmp_path):
    """The checker itself: a cycle made only of imports inside functions is found, a one-way graph passes."""
    pkg = tmp_path / "pk"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import x\n")
    (pkg / "c.py").write_text("def g():\n    from . import a\n")
    mods = _modules(str(pkg), "pk")
    g = import_graph(mods, "pk")
    assert g["pk.a"] == {"pk.sub.b"} and g["pk.sub.b"] == {"pk.c"} and g["pk.c"] == {"pk.a"}
    assert find_cycle(g) == ["pk.a", "pk.sub.b", "pk.c", "pk.a"]
    (pkg / "c.py").write_text("import os\n")
    assert find_cycle(import_graph(_modules(str(pkg), "pk"), "pk")) is None


@pytest.mark.parametrize("scope", ["deadpool_hpc.launch", "deadpool_hpc"])
def test_no_import_cycle(scope):
    mods = _modules()
    graph = import_graph(mods)
    sub = {m: {d for d in deps if d == scope or d.startswith(scope + ".")} for m, deps in graph.items()
           if m == scope or m.startswith(scope + ".")}
    cycle = find_cycle(sub)
    assert cycle is None, f"import cycle among {scope} modules: {' -> '.join(cycle)}"


def test_rooms_see_a_circle_that_no_file_cycle_shows(tmp_path):
    """The checker itself: two folders that import each other through different files are a circle of rooms."""
    pkg = tmp_path / "pk"
    for sub in ("a", "b"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from ..b import y\n")
    (pkg / "b" / "y.py").write_text("")
    (pkg / "b" / "z.py").write_text("def f():\n    from ..a import w\n")
    (pkg / "a" / "w.py").write_text("")
    g = import_graph(_modules(str(pkg), "pk"), "pk")
    assert find_cycle(g) is None
    assert rooms(g) == {"pk": set(), "pk.a": {"pk.b"}, "pk.b": {"pk.a"}}
    assert find_cycle(rooms(g)) == ["pk.a", "pk.b", "pk.a"]


def test_no_circle_of_rooms():
    """Issue 29: agent/ and worker/ imported each other (frames, shared memory, lifeline, faults), and control/ and
    agent/ (the scale study's probe); the shared pieces now live in rooms below both (ipc/, process/, ...)."""
    graph = import_graph(_modules())
    cycle = find_cycle(rooms(graph))
    if cycle:
        why = [f"{a} -> {b}: " + ", ".join(sorted(f"{m} imports {d}" for m, deps in graph.items() if room(m) == a
                                                  for d in deps if room(d) == b))
               for a, b in zip(cycle, cycle[1:])]
        pytest.fail("the package's rooms import each other in a circle (a shared piece belongs in a room below "
                    "both):\n" + "\n".join(why))


def test_metrics_sit_between_the_event_log_and_the_agent():
    """deadpool_hpc/metrics.py (the metric names, the job's view, the exporter) reads the event log and the summary
    and nothing of a plane; only the node agent's wiring (agent/metrics.py) and the launchers use it."""
    graph = import_graph(_modules())
    deps = {room(d) for d in graph[f"{PKG}.metrics"]}
    assert deps <= {f"{PKG}.events", f"{PKG}.summary", f"{PKG}.rundir", f"{PKG}.process"}, deps
    users = {room(m) for m, ds in graph.items() if f"{PKG}.metrics" in ds}
    assert users <= {f"{PKG}.agent", f"{PKG}.launch"}, users
    assert f"{PKG}.agent.metrics" in {m for m, ds in graph.items() if f"{PKG}.metrics" in ds}


# the report room (deadpool_hpc/report/: deadpool plot) reads run directories after the fact: the command imports it,
# nothing that runs in a job does, and it imports nothing that does (issue 46)
REPORT = f"{PKG}.report"
REPORT_USERS = {f"{PKG}.launch.cli"}
RUNTIME_ROOMS = {f"{PKG}.{r}" for r in ("agent", "worker", "control", "dataplane", "replica", "ipc", "process",
                                         "launch", "train")}


def _external_imports(path: str) -> set[str]:
    """The top-level names of the modules a file imports that are not relative (``import matplotlib.pyplot``:
    matplotlib)."""
    with open(path) as fh:
        tree = ast.parse(fh.read(), path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_the_report_room_is_read_only_and_nothing_in_a_job_imports_it():
    mods = _modules()
    graph = import_graph(mods)
    assert any(room(m) == REPORT for m in mods), sorted(mods)
    users = {m for m, deps in graph.items() if room(m) != REPORT and any(room(d) == REPORT for d in deps)}
    assert users <= REPORT_USERS, f"only {sorted(REPORT_USERS)} may import {REPORT}; also: {sorted(users - REPORT_USERS)}"
    below = {room(d) for m, deps in graph.items() if room(m) == REPORT for d in deps} - {REPORT}
    assert not below & RUNTIME_ROOMS, f"{REPORT} imports the runtime: {sorted(below & RUNTIME_ROOMS)}"
    # matplotlib (the plot extra) is imported by the drawing module alone: every other module works without it
    drawing = {m for m, path in mods.items() if "matplotlib" in _external_imports(path)}
    assert drawing == {f"{REPORT}.plot"}, sorted(drawing)


# the heartbeat detector (control/detector.py) is separable from the control thread's MPI pump (control/peers.py):
# it and the rules it applies (control/suspicion.py) import no transport, no thread, no array library (issue 44)
DETECTOR = f"{PKG}.control.detector"
DETECTOR_DEPS = {f"{PKG}.control.suspicion"}
PURE_STDLIB = {"__future__", "collections", "dataclasses", "math", "random", "time", "typing"}


def test_the_heartbeat_detector_needs_no_mpi_socket_or_thread():
    mods = _modules()
    graph = import_graph(mods)
    assert graph[DETECTOR] == DETECTOR_DEPS, graph[DETECTOR]
    assert not graph[f"{PKG}.control.suspicion"], graph[f"{PKG}.control.suspicion"]
    for mod in (DETECTOR, *DETECTOR_DEPS):
        ext = _external_imports(mods[mod])
        assert ext <= PURE_STDLIB, f"{mod} imports {sorted(ext - PURE_STDLIB)}: the detector must run on a clock alone"
    # the control thread uses it; nothing below the control plane does
    users = {m for m, deps in graph.items() if DETECTOR in deps}
    assert users == {f"{PKG}.control.peers"}, users


# the control plane is split by role (control/plane.py keeps the ControlPlane object and its inbox's dispatch): the
# start-up's collectives, the agreement round and the barriers are modules below it, handed the plane; none of them
# imports it back, and the start-up knows nothing of the control thread or the round
PLANE = f"{PKG}.control.plane"
PLANE_PARTS = {f"{PKG}.control.{m}" for m in ("bootstrap", "round", "barrier")}


def test_the_control_planes_parts_sit_below_it():
    graph = import_graph(_modules())
    assert PLANE_PARTS <= graph[PLANE], sorted(PLANE_PARTS - graph[PLANE])
    for part in PLANE_PARTS:
        assert PLANE not in graph[part], f"{part} imports {PLANE}: the parts are handed the plane, never import it"
    assert not graph[f"{PKG}.control.bootstrap"] & {f"{PKG}.control.{m}" for m in ("peers", "round", "barrier")}
    assert not graph[f"{PKG}.control.barrier"] & {f"{PKG}.control.peers", f"{PKG}.control.round"}


# fault injection (deadpool_hpc/faultinject/: the test fault grammar, the pre-start survival check, the signals) is a
# room of its own, below the configuration and the processes that fire faults, and out of the package's public names
FAULTINJECT = f"{PKG}.faultinject"
FAULTINJECT_DEPS = {f"{PKG}.errors", f"{PKG}.placement", f"{PKG}.ipc"}   # ipc: its messages' schema
FAULTINJECT_USERS = {f"{PKG}.config", f"{PKG}.launch", f"{PKG}.agent", f"{PKG}.worker"}


def test_fault_injection_is_a_room_below_the_config_and_out_of_the_public_names():
    mods = _modules()
    graph = import_graph(mods)
    assert {f"{FAULTINJECT}.spec", f"{FAULTINJECT}.plan", f"{FAULTINJECT}.inject"} <= set(mods), sorted(mods)
    assert f"{PKG}.faults" not in mods and f"{PKG}.faultplan" not in mods
    below = {room(d) for m, deps in graph.items() if room(m) == FAULTINJECT for d in deps} - {FAULTINJECT}
    assert below <= FAULTINJECT_DEPS, f"{FAULTINJECT} imports {sorted(below - FAULTINJECT_DEPS)}"
    users = {room(m) for m, deps in graph.items() if room(m) != FAULTINJECT and any(room(d) == FAULTINJECT
                                                                                   for d in deps)}
    assert users <= FAULTINJECT_USERS, f"{FAULTINJECT} is imported by {sorted(users - FAULTINJECT_USERS)}"
    assert not any(room(d) == FAULTINJECT for d in graph[PKG]), "the package's public names import fault injection"
    with open(mods[PKG]) as fh:
        public = fh.read()
    for name in ("Fault", "parse_fault"):
        assert f"import {name} " not in public and f"as {name}\n" not in public, name
