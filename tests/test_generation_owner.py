"""The generation has one owner: ``ControlPlane`` stores it in its frozen view (control/membership.py Membership),
``adopt`` is the view's one writer (``enter_generation`` goes through it), and the control thread
(``Peers.generation``) reads the plane's value instead of keeping a copy. Pure: the sources are parsed (ast) and the
writers are run on a plane made without its ``__init__``; nothing starts MPI."""
import ast
import dataclasses
import os
import types

import pytest

from deadpool_hpc.control.peers import Peers
from deadpool_hpc.control.membership import Membership
from deadpool_hpc.control.plane import ControlPlane

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deadpool_hpc")
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
    stray = [w for attr in ("generation", "assignment", "spare_nodes", "members", "coordinator")
             for w in _writes(attr) if any(o in w[2].split(".")[-2] for o in OWNERS)]
    assert not stray, f"the control plane's view written around ControlPlane.adopt: {stray}"
    copies = [w for w in _writes("_generation") if w[0].startswith("control/") or "cp" in w[2]]
    assert not copies, f"a copy of the control plane's generation: {copies}"
    private = _writes("_membership")
    assert {(f, t) for f, _line, t in private} == {("control/plane.py", "self._membership")}, private
    assert len(private) == 2, private   # __init__ (generation 0) and adopt


def test_peers_reads_the_generation_it_is_handed_and_has_no_copy():
    assert isinstance(Peers.generation, property) and Peers.generation.fset is None
    held = {"g": 4}
    bare = types.SimpleNamespace(_generation_of=lambda: held["g"])
    assert Peers.generation.fget(bare) == 4
    held["g"] = 5
    assert Peers.generation.fget(bare) == 5


def _plane(view: Membership) -> ControlPlane:
    cp = ControlPlane.__new__(ControlPlane)   # no MPI: only the view's members are used
    cp._membership = view
    return cp


def test_enter_generation_takes_integers_from_zero_up_and_names_a_bad_value():
    cp = _plane(Membership.initial(ranks_per_node=2, active_nodes=2, size=3))
    ControlPlane.enter_generation(cp, 3)
    assert cp.generation == 3 and ControlPlane.generation.fset is None
    assert cp.assignment == (0, 1, 2, 3) and cp.spare_nodes == (2,) and cp.members == tuple(range(6))
    for bad in (-1, 2.0, "2", True, None):
        with pytest.raises(ValueError, match=f"generation {bad!r}"):
            ControlPlane.enter_generation(cp, bad)
    assert cp.generation == 3


def test_the_view_is_replaced_never_changed():
    cp = _plane(Membership.initial(ranks_per_node=1, active_nodes=2, size=3))
    before = cp.membership
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.spare_nodes = (1,)
    cp.adopt(before.with_spare(3, 1))
    assert before.spare_nodes == (2,) and cp.spare_nodes == (2, 3) and cp.members == (0, 1, 2, 3)
    assert cp.membership.with_spare(3, 1) == cp.membership   # listed once
    with pytest.raises(TypeError, match="Membership"):
        cp.adopt({"generation": 1})
    for name in ("generation", "assignment", "spare_nodes", "members", "coordinator"):
        assert getattr(ControlPlane, name).fset is None, name
