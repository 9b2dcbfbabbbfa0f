"""The message schema (ipc/schema.py): a frozen dataclass's wire form derived from its type hints, read back only
when every key has the type its hint says, and refused by kind, key, value and expectation otherwise. Pure logic.
Run: .venv/bin/python -m pytest -q -p no:cacheprovider -n 0 tests/unit/ipc/test_schema.py
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated

import pytest

from deadpool_hpc.ids import Generation, NodeId, ProcId, Rank
from deadpool_hpc.ipc import schema
from deadpool_hpc.ipc.schema import FLAT, Codec, Message, OneOf


@dataclass(frozen=True)
class Inner(Message):
    a: int
    b: tuple[int, ...]


@dataclass(frozen=True)
class Everything(Message, plane=schema.CONTROL, kind="t_everything"):
    i: int
    f: float
    s: str
    yes: bool
    maybe: int | None
    ids: tuple[int, ...]
    names: list[str]
    by_rank: dict[int, tuple[int, ...]]
    by_name: dict[str, float]
    raw: dict | None
    inner: Inner
    inners: tuple[Inner, ...]
    flat: Annotated[Inner, FLAT]
    later: int = 7


@dataclass(frozen=True)
class Outer(Message, plane=schema.CONTROL, kind="t_outer"):
    x: int
    plan: Annotated[Inner | None, FLAT] = None


@dataclass(frozen=True)
class Shape(Message, plane=schema.CONTROL, kind="t_shape", tag="what"):
    pass


@dataclass(frozen=True)
class Square(Shape, variant="square"):
    side: float


@dataclass(frozen=True)
class Dot(Shape, variant="dot"):
    pass


DOUBLED = Codec(lambda v: v * 2, lambda raw, label: raw // 2)


@dataclass(frozen=True)
class Sparse(Message, plane=schema.CONTROL, kind="t_sparse"):
    SPARSE = True
    ok: bool
    rank: int | None = None
    address: list | None = None


@dataclass(frozen=True)
class Coded(Message, plane=schema.CONTROL, kind="t_coded"):
    n: Annotated[int, DOUBLED]


EV = Everything(i=1, f=2.5, s="x", yes=True, maybe=None, ids=(1, 2), names=["a"], by_rank={3: (4, 5)},
                by_name={"k": 1.0}, raw={"any": [1, {"x": None}]}, inner=Inner(1, ()), inners=(Inner(2, (3,)),),
                flat=Inner(9, (8,)))


def _json(msg):
    return json.loads(json.dumps(msg.to_wire()))


def test_every_type_survives_its_wire_form_and_the_form_is_plain_json():
    wire = _json(EV)
    assert wire["by_rank"] == {"3": [4, 5]} and wire["a"] == 9 and wire["b"] == [8] and "flat" not in wire
    assert wire["inner"] == {"a": 1, "b": []} and wire["later"] == 7
    assert Everything.from_wire(wire) == EV
    assert Outer.from_wire(_json(Outer(1))) == Outer(1) and _json(Outer(1)) == {"x": 1}
    assert Outer.from_wire(_json(Outer(1, Inner(2, (3,))))) == Outer(1, Inner(2, (3,)))
    assert Coded.from_wire(Coded(4).to_wire()) == Coded(4) and Coded(4).to_wire() == {"n": 8}


def test_a_default_from_a_factory_is_made_for_each_message_read():
    from deadpool_hpc.control.messages import Report

    a, b = Report.from_wire({}), Report.from_wire({})
    assert a == Report() and a.held == {} and a.held is not b.held


def test_a_sparse_message_leaves_out_the_fields_that_are_none():
    assert Sparse(True).to_wire() == {"ok": True} and Sparse.from_wire({"ok": True}) == Sparse(True)
    full = Sparse(False, 3, ["h", 1])
    assert full.to_wire() == {"ok": False, "rank": 3, "address": ["h", 1]} and Sparse.from_wire(full.to_wire()) == full
    with pytest.raises(ValueError, match="key 'address' is 'h:1'; expected a list or null"):
        Sparse.from_wire({"ok": True, "address": "h:1"})


def test_a_field_with_a_default_may_be_absent_and_unknown_keys_are_ignored():
    wire = _json(EV)
    del wire["later"]
    wire["extra"] = "ignored"
    assert Everything.from_wire(wire).later == 7


def test_variants_carry_their_tag_and_the_base_reads_the_one_it_names():
    assert Square(2.0).to_wire() == {"what": "square", "side": 2.0} and Dot().to_wire() == {"what": "dot"}
    assert Shape.from_wire({"what": "square", "side": 3}) == Square(3.0)
    assert isinstance(Shape.from_wire({"what": "square", "side": 3}).side, float)
    with pytest.raises(ValueError, match=r"t_shape message: 'what' is 'circle'; expected one of \['dot', 'square'\]"):
        Shape.from_wire({"what": "circle"})
    with pytest.raises(ValueError, match="t_shape message lacks key 'what'"):
        Shape.from_wire({})


@pytest.mark.parametrize("key, value, match", [
    ("i", True, "t_everything message: key 'i' is True; expected an int"),
    ("i", 1.0, "key 'i' is 1.0; expected an int"),
    ("f", "2", "key 'f' is '2'; expected a number"),
    ("f", False, "key 'f' is False; expected a number"),
    ("yes", 1, "key 'yes' is 1; expected a boolean"),
    ("s", None, "key 's' is None; expected a string"),
    ("maybe", "3", "key 'maybe' is '3'; expected an int or null"),
    ("ids", [1, "2"], r"key 'ids' is \[1, '2'\]; expected a list of ints"),
    ("ids", 5, "key 'ids' is 5; expected a list of ints"),
    ("by_rank", {"one": [1]}, "key 'by_rank' is .*; expected an object of int -> a list of ints"),
    ("by_rank", {"1": [True]}, "key 'by_rank' is .*; expected an object of int -> a list of ints"),
    ("raw", [], r"key 'raw' is \[\]; expected an object or null"),
    ("inner", {"a": 1}, "t_everything message lacks key 'inner.b'"),
    ("inner", {"a": "1", "b": []}, "key 'inner.a' is '1'; expected an int"),
    ("inners", [{"a": 1, "b": ["x"]}], r"key 'inners\[0\].b' is \['x'\]; expected a list of ints"),
    ("inners", [5], r"key 'inners' is \[5\]; expected a list of objects"),
    ("a", "9", "key 'a' is '9'; expected an int"),
])
def test_a_bad_value_is_refused_naming_the_kind_the_key_and_what_was_expected(key, value, match):
    wire = dict(_json(EV), **{key: value})
    with pytest.raises(ValueError, match=match):
        Everything.from_wire(wire)


def test_a_missing_key_or_a_body_that_is_not_an_object_is_refused():
    wire = _json(EV)
    del wire["ids"]
    with pytest.raises(ValueError, match="t_everything message lacks key 'ids'"):
        Everything.from_wire(wire)
    with pytest.raises(ValueError, match="t_everything message is list; expected an object"):
        Everything.from_wire([])


def test_kinds_are_registered_once_per_plane_and_a_oneof_picks_by_its_rule():
    assert schema.reader_of(schema.CONTROL, "t_everything") is Everything and schema.KINDS[schema.CONTROL]["t_shape"] is Shape
    with pytest.raises(ValueError, match="has a schema already"):
        schema.register(schema.CONTROL, "t_everything", Outer)
    schema.register(schema.REPLICA, "t_everything", Outer)   # another plane, another message
    with pytest.raises(ValueError, match="has no schema on the replica stream; accepted: .*'t_everything'"):
        schema.reader_of(schema.REPLICA, "t_nothing")
    with pytest.raises(ValueError, match="plane 'nowhere' is unknown"):
        schema.register("nowhere", "x", Outer)
    with pytest.raises(TypeError, match="both or neither"):
        class Half(Message, kind="t_half"):
            pass
    either = OneOf(schema.CONTROL, "t_either", (Square, Dot), lambda b: Square if "side" in b else Dot)
    assert schema.KINDS[schema.CONTROL]["t_either"] is either
    assert either.from_wire({"side": 1}) == Square(1.0) and either.from_wire({}) == Dot()


def test_a_type_without_a_wire_form_is_refused_when_first_used():
    @dataclass(frozen=True)
    class Bad(Message):
        s: set[int]

    with pytest.raises(TypeError, match="no wire form"):
        Bad({1}).to_wire()


def test_a_newtype_of_int_has_the_wire_form_of_an_int_and_is_refused_as_one():
    """The typed ids (deadpool_hpc/ids.py) are NewTypes of int: a field, a list item, a dict key and a member of a
    union annotated with one read and write plain JSON integers, and a bad value is refused as an int's is."""
    @dataclass(frozen=True)
    class Typed(Message):
        generation: Generation
        nodes: tuple[NodeId, ...]
        sources: dict[Rank, ProcId]
        coordinator: NodeId | None = None
        either: NodeId | str = "x"

    msg = Typed(Generation(3), (NodeId(0), NodeId(2)), {Rank(1): ProcId(5)}, NodeId(4), NodeId(6))
    wire = msg.to_wire()
    assert json.loads(json.dumps(wire)) == wire == {"generation": 3, "nodes": [0, 2], "sources": {"1": 5},
                                                    "coordinator": 4, "either": 6}
    assert Typed.from_wire(wire) == msg
    assert Typed.from_wire(dict(wire, coordinator=None)).coordinator is None
    with pytest.raises(ValueError, match=r"generation.*an int"):
        Typed.from_wire(dict(wire, generation="3"))
    with pytest.raises(ValueError, match=r"sources.*int -> an int"):
        Typed.from_wire(dict(wire, sources={"one": 5}))
