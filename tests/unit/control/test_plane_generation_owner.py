"""The generation has one owner (issue 44): ``ControlPlane`` stores it, ``enter_generation`` is the one writer, and
the control thread (``Peers.generation``) reads the plane's value instead of keeping a copy. Pure: the sources are
parsed (ast) and the writer's check is run on a bare object; nothing starts MPI."""
import ast
import os
import types

import pytest

from deadpool_hpc.control.peers import Peers
from deadpool_hpc.control.plane import ControlPlane

import paths  # tests/paths.py: the checkout's folders, wherever this file lies
PKG = os.path.join(paths.ROOT, "deadpool_hpc")
OWNERS = ("cp", "peers", "plane")   # names an object holding the control plane's generation goes by


def _writes(attr: str):
    """(file, line, target text) of every assignment to ``<something>.<attr>`` in the package."""
    out = []
    for d, _dirs, files in os.walk(PKG):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(d, f)
            with open(path) as fh:
                tree = ast.parse(fh.read(), path)
            for node in ast.walk(tree):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
                for t in targets:
                    for leaf in ast.walk(t):
                        if isinstance(leaf, ast.Attribute) and leaf.attr == attr:
                            out.append((os.path.relpath(path, PKG), node.lineno, ast.unparse(leaf)))
    return out


def test_nothing_writes_the_control_planes_generation_but_enter_generation():
    stray = [w for w in _writes("generation") if any(o in w[2].split(".")[-2] for o in OWNERS)]
    assert not stray, f"the control plane's generation written around ControlPlane.enter_generation: {stray}"
    private = [w for w in _writes("_generation") if w[0].startswith("control/") or "cp" in w[2]]
    assert {(f, t) for f, _line, t in private} == {("control/plane.py", "self._generation")}, private
    assert len(private) == 2, private   # __init__ (0) and enter_generation


def test_peers_reads_the_generation_it_is_handed_and_has_no_copy():
    assert isinstance(Peers.generation, property) and Peers.generation.fset is None
    held = {"g": 4}
    bare = types.SimpleNamespace(_generation_of=lambda: held["g"])
    assert Peers.generation.fget(bare) == 4
    held["g"] = 5
    assert Peers.generation.fget(bare) == 5


def test_enter_generation_takes_integers_from_zero_up_and_names_a_bad_value():
    cp = types.SimpleNamespace(_generation=0)
    ControlPlane.enter_generation(cp, 3)
    assert ControlPlane.generation.fget(cp) == 3 and ControlPlane.generation.fset is None
    for bad in (-1, 2.0, "2", True, None):
        with pytest.raises(ValueError, match=f"generation {bad!r}"):
            ControlPlane.enter_generation(cp, bad)
    assert cp._generation == 3
