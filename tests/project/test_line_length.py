"""No line of the package's Python sources is longer than 120 columns (the project's width; wrap by hand). Pure
logic: the files are read, nothing is imported. The shell templates under launch/templates/ are not counted."""
from __future__ import annotations

import os

import paths  # tests/paths.py: the checkout's folders, wherever this file lies

LIMIT = 120


def test_no_line_of_the_package_exceeds_120_columns():
    root = os.path.join(paths.ROOT, "deadpool_hpc")
    long = []
    for d, _dirs, files in os.walk(root):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                with open(path, encoding="utf-8") as fh:
                    long += [f"{os.path.relpath(path, paths.ROOT)}:{n}: {len(line.rstrip(chr(10)))} columns"
                             for n, line in enumerate(fh, 1) if len(line.rstrip("\n")) > LIMIT]
    assert not long, f"{len(long)} line(s) over {LIMIT} columns:\n" + "\n".join(long)
