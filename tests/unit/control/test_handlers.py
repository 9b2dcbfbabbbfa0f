"""Registration of control-message handlers (control/handlers.py, ``ControlPlane.on`` / ``off``): one handler per
kind, none for a kind the control plane handles itself, and the table dispatch reads cannot be written around
``on``. Pure logic: no MPI, no process."""
import ast
import inspect
import textwrap

import pytest

from deadpool_hpc.control import plane
from deadpool_hpc.control.handlers import HandlerTable


class _Owner:
    def __init__(self):
        self.got = []

    def on_a(self, src, body):
        self.got.append(("a", src, body))

    def on_b(self, src, body):
        self.got.append(("b", src, body))


def test_a_kind_registered_twice_is_refused_naming_both_handlers():
    t = HandlerTable()
    first, second = _Owner(), _Owner()
    t.on("swap_ask", first.on_a)
    with pytest.raises(ValueError) as err:
        t.on("swap_ask", second.on_b)
    msg = str(err.value)
    assert "'swap_ask'" in msg and "on_a" in msg and "on_b" in msg
    t["swap_ask"](3, {"x": 1})   # the first registration stands
    assert first.got == [("a", 3, {"x": 1})] and second.got == []


def test_a_reserved_kind_or_a_non_callable_is_refused():
    t = HandlerTable(reserved={"decision", "sync"})
    with pytest.raises(ValueError, match="'decision'.*'sync'"):
        t.on("decision", _Owner().on_a)
    with pytest.raises(ValueError, match="not callable"):
        t.on("kv", None)
    assert dict(t) == {}


def test_the_table_is_read_only_outside_on_and_off():
    t = HandlerTable()
    with pytest.raises(TypeError):
        t["kv"] = print   # a Mapping: dispatch reads it, nothing writes it around ``on``
    assert "kv" not in t and len(t) == 0


def test_off_drops_only_the_owners_handlers_so_a_replacement_can_register():
    t = HandlerTable()
    old, other = _Owner(), _Owner()
    t.on("swap_ask", old.on_a)
    t.on("swap_answer", old.on_b)
    t.on("kv", other.on_a)
    assert t.off(old) == ["swap_ask", "swap_answer"]
    assert list(t) == ["kv"]
    new = _Owner()
    t.on("swap_ask", new.on_a)   # what agent/node.py does for a returned node's fresh collaborators
    assert t["swap_ask"].__self__ is new and t.off(_Owner()) == []


def _compared_kinds(fn) -> set[str]:
    """String constants a function compares ``kind`` with (``kind == "x"``, ``kind in ("x", ...)``)."""
    out = set()
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn)))):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "kind":
            for c in node.comparators:
                for leaf in ast.walk(c):
                    if isinstance(leaf, ast.Constant) and isinstance(leaf.value, str):
                        out.add(leaf.value)
    return out


def test_the_reserved_kinds_are_the_ones_pump_dispatches_itself():
    """``OWN_KINDS`` keeps up with ``ControlPlane.pump``: every kind it handles before the handlers is reserved."""
    pumped = _compared_kinds(plane.ControlPlane.pump) | {plane.Readmit.KIND}
    assert pumped and pumped <= plane.OWN_KINDS, sorted(pumped - plane.OWN_KINDS)


def test_a_kind_with_a_schema_reaches_its_handler_typed_and_a_malformed_one_not_at_all():
    from deadpool_hpc.control.messages import Persist

    t, got = HandlerTable(), []
    t.on("persist", lambda src, msg: got.append((src, msg)))
    t.on("no_schema_kind", lambda src, body: got.append((src, body)))
    assert t.dispatch(3, "persist", {"g": 1, "step": 8}) and got[-1] == (3, Persist(g=1, step=8))
    assert t.dispatch(2, "no_schema_kind", {"x": 1}) and got[-1] == (2, {"x": 1})
    with pytest.raises(ValueError, match="persist message: key 'step' is '8'; expected an int"):
        t.dispatch(3, "persist", {"g": 1, "step": "8"})
    assert len(got) == 2 and not t.dispatch(1, "nobody", {})
