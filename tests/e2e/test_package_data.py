"""The batch templates are package data (deadpool_hpc/launch/templates/): a wheel built from this checkout carries
them, and once that wheel is installed in a fresh virtualenv, deadpool_hpc.launch.slurm finds and renders them from
site-packages with no checkout anywhere. A checkout's sbatch/ holds only links to the same files, so they cannot drift.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from deadpool_hpc.launch import slurm

pytestmark = pytest.mark.e2e   # builds a wheel, installs it into a venv, runs bash: processes (tests/fasttier.py)

import paths  # tests/paths.py: the checkout's folders, wherever this file lies
ROOT = paths.ROOT
PACKAGE_TEMPLATES = os.path.join(ROOT, "deadpool_hpc", "launch", "templates")


def test_template_path_is_the_package_copy_and_sbatch_dir_only_links_to_it(monkeypatch):
    monkeypatch.delenv(slurm.TEMPLATE_ENV, raising=False)
    for name in slurm.TEMPLATES:
        path = slurm.template_path(name)
        assert path == os.path.join(PACKAGE_TEMPLATES, name) and os.path.isfile(path)
        link = os.path.join(ROOT, "sbatch", name)
        assert os.path.islink(link) and os.path.samefile(link, path), link
    assert sorted(os.listdir(os.path.join(ROOT, "sbatch"))) == sorted(slurm.TEMPLATES)  # no second copy there
    assert sorted(n for n in os.listdir(PACKAGE_TEMPLATES)) == sorted(slurm.TEMPLATES)
    with pytest.raises(FileNotFoundError, match=r"'nope\.sbatch' not found .*accepted: train\.sbatch, scaling\.sbatch"):
        slurm.template_path("nope.sbatch")
    monkeypatch.setenv(slurm.TEMPLATE_ENV, "/site/own/train.sbatch")  # the override still wins for train.sbatch
    assert slurm.template_path() == "/site/own/train.sbatch"
    assert slurm.template_path("scaling.sbatch") == os.path.join(PACKAGE_TEMPLATES, "scaling.sbatch")


def test_template_home_is_the_directory_above_the_package_or_above_sbatch():
    assert slurm.template_home(os.path.join(PACKAGE_TEMPLATES, "train.sbatch")) == ROOT
    assert slurm.template_home(os.path.join(ROOT, "sbatch", "train.sbatch")) == ROOT  # the link, not its target
    assert slurm.template_home("/opt/site/sbatch/train.sbatch") == "/opt/site"        # a copy kept elsewhere
    lib = "/v/lib/python3.11/site-packages"
    assert slurm.template_home(f"{lib}/deadpool_hpc/launch/templates/train.sbatch") == lib  # an installed wheel


_INSTALLED = r"""
import json, os, sys, sysconfig
from deadpool_hpc.config import RunConfig
from deadpool_hpc.launch import slurm
train = slurm.template_path()
text = slurm.render(RunConfig(nodes=2, spares=1, steps=5, run_dir=os.path.abspath("run")))
print(json.dumps({"train": train, "scaling": slurm.template_path("scaling.sbatch"), "text": text,
                  "purelib": sysconfig.get_paths()["purelib"], "python": sys.executable,
                  "body": open(train).read()}))
"""


def test_a_wheel_carries_the_templates_and_an_install_of_it_renders_them(tmp_path):
    """Build the wheel (pip wheel --no-deps --no-build-isolation, from a copy of the package so that no build/ of
    this checkout leaks in), check its members, install it with --no-deps into a bare venv, and from a directory
    outside any checkout (python -I: no PYTHONPATH, no current directory on sys.path) find and render the template.
    About 3 s on a quiet machine."""
    src = tmp_path / "src"
    shutil.copytree(os.path.join(ROOT, "deadpool_hpc"), src / "deadpool_hpc",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    # the tests' PYTHONPATH holds this checkout (tests/conftest.py): pip and the installed package must not see it
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", slurm.TEMPLATE_ENV, "DEADPOOL_HOME")}
    wheels = tmp_path / "whl"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(wheels), "."], cwd=src, env=env, check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = wheels.glob("deadpool_hpc-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        for name in slurm.TEMPLATES:
            member = f"deadpool_hpc/launch/templates/{name}"
            assert zf.read(member) == open(os.path.join(PACKAGE_TEMPLATES, name), "rb").read(), member

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env=env, check=True, timeout=120)
    py = str(venv / "bin" / "python")
    subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], env=env, check=True, capture_output=True, text=True, timeout=300)
    away = tmp_path / "elsewhere"
    away.mkdir()
    r = subprocess.run([py, "-I", "-c", _INSTALLED], cwd=away, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    site = os.path.realpath(got["purelib"])
    assert os.path.realpath(got["train"]) == os.path.join(site, "deadpool_hpc", "launch", "templates", "train.sbatch")
    assert os.path.realpath(got["scaling"]) == os.path.join(site, "deadpool_hpc", "launch", "templates",
                                                            "scaling.sbatch")
    assert got["body"] == open(os.path.join(PACKAGE_TEMPLATES, "train.sbatch")).read()
    text = got["text"]  # what `deadpool submit` would hand to sbatch from this install
    assert "#SBATCH --nodes=3" in text.splitlines()
    assert f"PYTHON=${{PYTHON:-{got['python']}}}" in text          # the installed interpreter, pinned
    home = slurm.template_home(got["train"])
    assert f"DEADPOOL_HOME=${{DEADPOOL_HOME:-{home}}}" in text and os.path.realpath(home) == site
    assert ROOT not in text                                         # nothing points back at this checkout


def test_the_templates_find_their_home_as_render_pins_it(tmp_path):
    """Each template's own ``home_of`` (its DEADPOOL_HOME when submitted directly, from the job's Command) agrees with
    slurm.template_home (what ``deadpool submit`` pins), for the package's copy, the checkout's link and a copy."""
    (tmp_path / "site" / "sbatch").mkdir(parents=True)
    paths = [os.path.join(PACKAGE_TEMPLATES, "train.sbatch"), os.path.join(ROOT, "sbatch", "train.sbatch"),
             str(tmp_path / "site" / "sbatch" / "train.sbatch")]
    for name in (n for n in slurm.TEMPLATES if n != "companion.sbatch"):   # the job submits that one, PYTHON set
        text = open(os.path.join(PACKAGE_TEMPLATES, name)).read()
        start = text.index("home_of() {")
        func = text[start:text.index("\n}\n", start) + 3]
        for path in paths:
            r = subprocess.run(["bash", "-c", func + 'home_of "$1"', "bash", path], capture_output=True, text=True,
                               timeout=10)
            assert r.returncode == 0 and r.stdout.strip() == slurm.template_home(path), (name, path, r.stdout, r.stderr)
    assert {slurm.template_home(p) for p in paths} == {ROOT, str(tmp_path / "site")}
