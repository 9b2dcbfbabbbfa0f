"""The node agent's collaborators see it through narrow host protocols (issue 44): each module below declares a
``typing.Protocol`` listing what it uses of its NodeAgent, and takes its host annotated with it. Checked from the
sources (ast; nothing is imported or started): every attribute a module reads or writes on its host is listed in its
protocol and every member listed is used (no more, no less), each constructor is annotated with it, and NodeAgent
(agent/node.py) has every member."""
from __future__ import annotations

import ast
import os

import pytest

import paths  # tests/paths.py: the checkout's folders, wherever this file lies
AGENT = os.path.join(paths.ROOT, "deadpool_hpc", "agent")
# module -> (its host protocol, the class that takes the host)
HOSTS = {"persister": ("PersistHost", "Persister"), "recovery": ("RecoveryHost", "Recovery"),
         "comeback": ("ComebackHost", "Comeback"), "sparecheck": ("SpareCheckHost", "SpareChecks"),
         "planned": ("SwapHost", "PlannedSwaps"), "stragglers": ("StragglerHost", "Stragglers")}
HOST_NAMES = ("a", "agent", "host")   # how the modules name their host: ``a = self.agent``, ``self.host``, ``self.a``


def _tree(name: str) -> ast.Module:
    path = os.path.join(AGENT, f"{name}.py")
    with open(path) as fh:
        return ast.parse(fh.read(), path)


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    found = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"no class {name}"
    return found[0]


def _members(proto: ast.ClassDef) -> set[str]:
    out = set()
    for st in proto.body:
        if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
            out.add(st.target.id)
        elif isinstance(st, ast.FunctionDef):
            out.add(st.name)
    return out


def _used(tree: ast.Module) -> set[str]:
    """Every attribute taken of the host: ``a.X``, ``agent.X``, ``host.X``, ``self.agent.X``, ``self.host.X``,
    ``self.a.X``."""
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if isinstance(v, ast.Name) and v.id in HOST_NAMES:
            out.add(node.attr)
        elif isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and v.value.id == "self" \
                and v.attr in HOST_NAMES:
            out.add(node.attr)
    return out


def _node_agent() -> set[str]:
    """NodeAgent's methods, properties and the attributes it assigns (``self.X = ...``, tuples included)."""
    cls = _class(_tree("node"), "NodeAgent")
    out = {st.name for st in cls.body if isinstance(st, ast.FunctionDef)}
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    out.add(e.attr)
    return out


def test_the_checker_sees_an_unlisted_use_and_an_unused_member():
    """The checker itself, on a made-up module: a use the protocol lacks and a member nobody uses are both seen."""
    tree = ast.parse("class H(Protocol):\n    cfg: object\n    def tick(self): ...\n"
                     "class C:\n    def __init__(self, agent: H):\n        self.agent = agent\n"
                     "    def f(self):\n        a = self.agent\n        a.log.emit(a.cfg)\n")
    assert _used(tree) == {"cfg", "log"} and _members(_class(tree, "H")) == {"cfg", "tick"}


@pytest.mark.parametrize("module", sorted(HOSTS))
def test_a_host_protocol_lists_exactly_what_its_module_uses(module):
    proto_name, user = HOSTS[module]
    tree = _tree(module)
    members, used = _members(_class(tree, proto_name)), _used(tree)
    assert not used - members, f"agent/{module}.py uses {sorted(used - members)} of its host; list them in {proto_name}"
    assert not members - used, f"{proto_name} lists {sorted(members - used)}, which agent/{module}.py does not use"
    init = next(st for st in _class(tree, user).body if isinstance(st, ast.FunctionDef) and st.name == "__init__")
    annotated = {ast.unparse(arg.annotation) for arg in init.args.args if arg.annotation is not None}
    assert proto_name in annotated, f"{user}.__init__ takes its host without the {proto_name} annotation"
    missing = members - _node_agent()
    assert not missing, f"NodeAgent (agent/node.py) lacks {sorted(missing)} of {proto_name}"
