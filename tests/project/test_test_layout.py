"""The map of the tests (tests/README.md, "Where a test lies"): a module's tests are found from its path, the
end-to-end runs lie apart, and nothing lies loose in tests/ but the shared helpers.

- ``tests/unit/<room>/test_<module>[_<aspect>].py`` tests ``deadpool_hpc/<room>/<module>.py`` (or the package
  ``deadpool_hpc/<room>/<module>/``); a module at the package's top: ``tests/unit/test_<module>.py``. A test there
  may start processes (the module's own, real ones: the e2e marker on it).
- ``tests/e2e/test_<feature>.py``: every test carries the e2e marker (``pytestmark = pytest.mark.e2e``, or one
  per test, every case of a parametrized one): an in-process test goes to the unit file of the module it tests.
- ``tests/project/``: the checkout as a whole and the code beside the package; ``tests/slurm/``: the Slurm jobs.
- every folder under unit/, e2e/ and project/ is a package (an ``__init__.py``): two rooms may have modules of one
  name (agent/recovery.py, worker/recovery.py), and test modules are imported by their dotted name.

Pure reads of the files (ast): nothing is imported, no process starts.
"""
from __future__ import annotations

import ast
import os

import pytest

import paths  # tests/paths.py

TESTS = paths.TESTS
PKG = os.path.join(paths.ROOT, "deadpool_hpc")
PLACES = ("unit", "e2e", "project")
FOLDERS = PLACES + ("slurm", "plugin_fixture", "__pycache__")
# the shared helpers, imported by their bare name from every test (tests/ is on sys.path: conftest.py lies there)
# and by the runs' processes (trainfns*: ``--train-fn trainfns:paced``, with tests/ on PYTHONPATH)
SHARED = {"conftest.py", "fasttier.py", "paths.py", "runs.py", "snapnode.py", "snapshots.py", "testkit.py",
          "trainfns.py", "trainfns_data.py", "trainfns_startup.py", "README.md"}


def _test_files(place: str) -> list[str]:
    """The test_*.py files under tests/<place>/, relative to tests/."""
    out = []
    for d, dirs, files in os.walk(os.path.join(TESTS, place)):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        out += [os.path.relpath(os.path.join(d, f), TESTS) for f in files
                if f.startswith("test_") and f.endswith(".py")]
    return sorted(out)


def package_modules(pkg: str = PKG) -> set[str]:
    """The package's modules as paths relative to it without .py ("agent/recovery", "config"), a package below a
    room included ("worker/state"; a room itself is a folder of the map, not a module)."""
    out = set()
    for d, dirs, files in os.walk(pkg):
        dirs[:] = [x for x in dirs if not x.startswith(("_", "."))]
        rel = os.path.relpath(d, pkg)
        out.update(os.path.normpath(os.path.join(rel, f[:-3])) for f in files
                   if f.endswith(".py") and not f.startswith("_"))
        if os.sep in rel and os.path.exists(os.path.join(d, "__init__.py")):
            out.add(rel)
    return out


def mirrored(unit_file: str, modules: set[str]) -> str | None:
    """The module ``unit/<room>/test_<module>[_<aspect>].py`` tests (the longest prefix of the name, cut at an
    underscore, that is a module of that room), or None."""
    room = os.path.dirname(os.path.relpath(unit_file, "unit"))
    parts = os.path.basename(unit_file)[len("test_"):-len(".py")].split("_")
    for n in range(len(parts), 0, -1):
        mod = os.path.normpath(os.path.join(room, "_".join(parts[:n])))
        if mod in modules:
            return mod
    return None


def _marks_e2e(decorators: list[ast.expr]) -> bool:
    return any(ast.unparse(d).endswith("mark.e2e") for d in decorators)


def unmarked_tests(path: str) -> list[str]:
    """The test functions of a file that do not carry the e2e marker on every case: no module ``pytestmark``
    holding it, no ``@pytest.mark.e2e`` on them (or their class)."""
    with open(path) as fh:
        tree = ast.parse(fh.read(), path)

    def pytestmark(body) -> bool:
        return any(isinstance(n, ast.Assign) and "mark.e2e" in ast.unparse(n.value)
                   and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets) for n in body)

    if pytestmark(tree.body):
        return []
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            if not _marks_e2e(node.decorator_list):
                out.append(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            if _marks_e2e(node.decorator_list) or pytestmark(node.body):
                continue
            out += [f"{node.name}.{m.name}" for m in node.body
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name.startswith("test")
                    and not _marks_e2e(m.decorator_list)]
    return out


def test_mirrored_reads_the_longest_module_name_and_its_room(tmp_path):
    """The checker itself: on a small package."""
    pkg = tmp_path / "pk"
    (pkg / "agent").mkdir(parents=True)
    (pkg / "worker" / "state").mkdir(parents=True)
    for f in ("__init__.py", "config.py", "agent/__init__.py", "agent/slurm.py", "agent/slurm_job.py",
              "worker/__init__.py", "worker/state/__init__.py"):
        (pkg / f).write_text("")
    mods = package_modules(str(pkg))
    assert mods == {"config", "agent/slurm", "agent/slurm_job", "worker/state"}, mods
    assert mirrored("unit/test_config.py", mods) == "config"
    assert mirrored("unit/agent/test_slurm_job_requeue.py", mods) == "agent/slurm_job"
    assert mirrored("unit/agent/test_slurm_launch.py", mods) == "agent/slurm"
    assert mirrored("unit/worker/test_state.py", mods) == "worker/state"
    assert mirrored("unit/test_slurm.py", mods) is None          # a module of another room
    assert mirrored("unit/agent/test_config.py", mods) is None
    assert mirrored("unit/agent/test_jobs.py", mods) is None


def test_unmarked_tests_sees_every_way_of_marking(tmp_path):
    """The checker itself: module, class and function marks; a marked parameter alone is not the function."""
    f = tmp_path / "test_x.py"
    f.write_text("import pytest\n"
                 "@pytest.mark.e2e\ndef test_a(): pass\n"
                 "def test_b(): pass\n"
                 "@pytest.mark.parametrize('x', [pytest.param(1, marks=pytest.mark.e2e), 2])\ndef test_c(x): pass\n"
                 "@pytest.mark.e2e\nclass TestD:\n    def test_d(self): pass\n"
                 "class TestE:\n    def test_e(self): pass\n    @pytest.mark.e2e\n    def test_f(self): pass\n")
    assert unmarked_tests(str(f)) == ["test_b", "test_c", "TestE.test_e"]
    f.write_text("import pytest\npytestmark = [pytest.mark.e2e]\ndef test_b(): pass\n")
    assert unmarked_tests(str(f)) == []


def test_every_unit_test_file_is_named_after_a_module_of_its_room():
    modules = package_modules()
    bad = [f for f in _test_files("unit") if mirrored(f, modules) is None]
    assert not bad, (f"tests under tests/unit/ that name no module of deadpool_hpc in their folder: {bad}; accepted: "
                     f"tests/unit/<room>/test_<module>[_<aspect>].py for deadpool_hpc/<room>/<module>.py (a module "
                     f"that moved: git mv its tests to its new room; `python /work/move-tests.py .` does it)")


def test_every_test_of_an_end_to_end_file_carries_the_e2e_marker():
    files = _test_files("e2e")
    assert files, "no tests/e2e/"
    wrong = {f: names for f in files if (names := unmarked_tests(os.path.join(TESTS, f)))}
    assert not wrong, (f"tests under tests/e2e/ without the e2e marker: {wrong}; mark them (@pytest.mark.e2e, or "
                       f"pytestmark = pytest.mark.e2e in the module) if they launch a run, else move them to the unit "
                       f"file of the module they test (tests/unit/<room>/test_<module>.py), the helpers only they use "
                       f"with them, the ones shared with other files to a module in tests/ (SHARED)")


def test_nothing_lies_loose_in_tests_but_the_shared_helpers():
    loose = sorted(f for f in os.listdir(TESTS) if os.path.isfile(os.path.join(TESTS, f))
                   and f.endswith(".py") and f not in SHARED)
    assert not loose, (f"files loose in tests/: {loose}; a test goes to tests/unit/<room>/test_<module>.py, "
                       f"tests/e2e/ (a run) or tests/project/ (`python /work/move-tests.py .` places one named "
                       f"after a module); a helper shared by tests is listed in SHARED here")
    folders = sorted(f for f in os.listdir(TESTS) if os.path.isdir(os.path.join(TESTS, f)) and f not in FOLDERS)
    assert not folders, f"folders in tests/ that are not part of the map: {folders}; accepted: {list(FOLDERS)}"


def test_every_folder_of_the_map_is_a_package():
    """Test modules under unit/, e2e/ and project/ are imported by their dotted name (unit.agent.test_recovery and
    unit.worker.test_recovery may both exist), so every folder there needs its __init__.py."""
    missing = []
    for place in PLACES:
        for d, dirs, _files in os.walk(os.path.join(TESTS, place)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            if not os.path.exists(os.path.join(d, "__init__.py")):
                missing.append(os.path.relpath(d, TESTS))
    assert not missing, f"folders without __init__.py: {missing}"


@pytest.mark.parametrize("place", PLACES)
def test_each_place_holds_tests(place):
    assert _test_files(place), f"tests/{place}/ holds no test file"
