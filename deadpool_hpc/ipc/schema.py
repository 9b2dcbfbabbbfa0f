"""One schema for the messages that cross a process: a frozen dataclass per kind, its wire form derived from its
type hints.

A message is a frozen dataclass deriving from ``Message``; ``class Failure(Message, plane=TO_WORKER,
kind="failure")`` gives it a ``KIND`` and puts it in ``KINDS[plane]`` (kind -> class). A plane is one kind of
connection, one way: the same kind may mean another message elsewhere (``abort`` on the channel and between
agents). ``to_wire()`` returns the JSON-safe dict a frame carries (no
pickle on the wire: ipc/wire.py signs and sends JSON); ``from_wire(body)`` reads one back, checking every field
against its type hint, and raises ValueError naming the kind, the key, the value and what was expected.

Field types and their wire form:

- ``int`` (a bool is not an int; a ``typing.NewType`` of int, the ids of deadpool_hpc/ids.py, is an int),
  ``float`` (an int or a float, read back as a float), ``str``, ``bool``.
- ``X | None``: null or X; ``str | bool`` (scalars): the first that fits. ``tuple[X, ...]`` / ``list[X]``: a JSON list
  of X.
- ``dict[str, X]``; ``dict[int, X]``: a JSON object keyed by ``str(int)`` (JSON has only string keys), read back
  with int keys. ``dict`` / ``list`` bare: any JSON object / list, passed as it is.
- another ``Message``: its own wire form, nested under the field's key; ``Annotated[M, FLAT]``: its keys in the
  enclosing body (an optional flat message is None when none of its keys is there).
- ``Annotated[T, Codec(...)]``: a field with a wire form of its own (control/decision.py's runs of ids).

A field with a default may be absent from a body (the default is taken); any other must be there (null for an
optional one). A class with ``SPARSE = True`` leaves out of its body each field that is None and has the default
None. Keys a class does not name are ignored. A family of messages of one kind told apart by a key
(``role``: ``{"what": "train", ...}``) is a base ``class Role(Message, kind="role", tag="what")`` with variants
``class Train(Role, variant="train")``: ``Role.from_wire`` returns the variant the tag names. ``OneOf`` registers a
kind whose body is one of a few messages told apart by a rule (a decision, or a failed round).
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Annotated, Any, Callable, ClassVar, Union

TO_AGENT = "channel: training process -> agent"     # agent/channel.py receives, worker/client.py sends
TO_WORKER = "channel: agent -> training process"    # worker/client.py receives
CONTROL = "control plane: agent -> agent"           # control/peers.py over MPI
REPLICA = "replica stream"                          # replica/stream.py, both ways
FORKSERVER = "fork server"                          # process/forkserver.py: an agent asks, the server answers
WATCH = "ring watch"                                # agent/ringlink.py: an agent's hello to its ring successor
JOIN = "join link: replacement node <-> agent"      # control/joining.py: a replacement node's admission
PLANES = (TO_AGENT, TO_WORKER, CONTROL, REPLICA, FORKSERVER, WATCH, JOIN)

KINDS: dict[str, dict[str, Any]] = {p: {} for p in PLANES}   # plane -> kind -> the class (or OneOf) reading it


class Codec:
    """A field's own wire form: ``encode(value)`` -> JSON-safe value; ``decode(raw, label)`` -> the value, raising
    ValueError naming ``label`` (which names the kind and the key) when ``raw`` is malformed."""

    def __init__(self, encode: Callable, decode: Callable[[Any, str], Any]):
        self.encode, self.decode = encode, decode

    def read(self, v, kind: str, path: str):
        return self.decode(v, f"{kind} message: key {path!r}")


class _Flat:
    def __repr__(self) -> str:
        return "FLAT"


FLAT = _Flat()   # Annotated[SomeMessage, FLAT]: the nested message's keys sit in the enclosing body


def register(plane: str, kind: str, reader) -> None:
    """Put ``reader`` (a Message class or a OneOf) in ``KINDS[plane]`` under ``kind``. Raises ValueError for an
    unknown plane, or a kind of that plane registered already to another reader."""
    if plane not in KINDS:
        raise ValueError(f"message plane {plane!r} is unknown; accepted: {list(KINDS)}")
    old = KINDS[plane].get(kind)
    if old is not None and old is not reader:
        raise ValueError(f"message kind {kind!r} of the {plane} has a schema already ({old!r}); refusing {reader!r}")
    KINDS[plane][kind] = reader


def reader_of(plane: str, kind: str):
    """The class (or OneOf) that reads ``kind`` on ``plane``. Raises ValueError naming the kinds accepted there."""
    r = KINDS.get(plane, {}).get(kind)
    if r is None:
        raise ValueError(f"message kind {kind!r} has no schema on the {plane}; accepted: "
                         f"{sorted(KINDS.get(plane, ()))}")
    return r


class OneOf:
    """A kind whose body is one of ``types`` (Message classes): ``pick(body)`` says which (a class)."""

    def __init__(self, plane: str, kind: str, types_: tuple, pick: Callable[[dict], type]):
        self.KIND, self.types, self.pick = kind, tuple(types_), pick
        register(plane, kind, self)

    def from_wire(self, body):
        if not isinstance(body, dict):
            raise ValueError(f"{self.KIND} message is {type(body).__name__}; expected an object")
        return self.pick(body).from_wire(body)

    def __repr__(self) -> str:
        return f"OneOf({self.KIND!r}, {[t.__name__ for t in self.types]})"


def _what(v) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _bad(kind: str, path: str, v, expected: str) -> ValueError:
    return ValueError(f"{kind} message: key {path!r} is {_what(v)}; expected {expected}")


class _Bad(ValueError):
    """A value of the wrong type at ``path`` (a container names itself instead, when the value is one of its items)."""

    def __init__(self, kind: str, path: str, v, expected: str):
        super().__init__(str(_bad(kind, path, v, expected)))
        self.path = path


def _is_item(inner: str, path: str) -> bool:
    """Whether ``inner`` is the path of an item of the container at ``path`` (not of something deeper)."""
    return re.fullmatch(re.escape(path) + r"\[[^\]]*\]", inner) is not None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Factory:
    __slots__ = ("make",)

    def __init__(self, make):
        self.make = make


class _Field:
    __slots__ = ("name", "enc", "dec", "default", "flat", "optional")
    # optional: for a flat field, whether it may be None; else whether the field is left out when None (SPARSE)

    def __init__(self, name, enc, dec, default, flat, optional):
        self.name, self.enc, self.dec, self.default, self.flat, self.optional = name, enc, dec, default, flat, optional


def _base(hint):
    """A ``typing.NewType``'s base type (``NodeId`` -> ``int``: the wire form of the type it names), else ``hint``."""
    while isinstance(hint, typing.NewType):
        hint = hint.__supertype__
    return hint


def _codec_of(hint, owner: str):
    """(encode(value), decode(raw, label), expected) for a type hint; a NewType has its base type's."""
    hint = _base(hint)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Annotated:
        for meta in hint.__metadata__:
            if isinstance(meta, Codec):
                return meta.encode, meta.read, "its wire form"
        return _codec_of(args[0], owner)
    if hint is int:
        def dec(v, kind, path):
            if not _is_int(v):
                raise _Bad(kind, path, v, "an int")
            return v
        return (lambda v: v), dec, "an int"
    if hint is float:
        def dec(v, kind, path):
            if not (isinstance(v, (int, float)) and not isinstance(v, bool)):
                raise _Bad(kind, path, v, "a number")
            return float(v)
        return (lambda v: v), dec, "a number"
    if hint is bool:
        def dec(v, kind, path):
            if not isinstance(v, bool):
                raise _Bad(kind, path, v, "a boolean")
            return v
        return (lambda v: v), dec, "a boolean"
    if hint is str:
        def dec(v, kind, path):
            if not isinstance(v, str):
                raise _Bad(kind, path, v, "a string")
            return v
        return (lambda v: v), dec, "a string"
    if hint is dict or origin is dict and not args:
        def dec(v, kind, path):
            if not isinstance(v, dict):
                raise _Bad(kind, path, v, "an object")
            return v
        return (lambda v: v), dec, "an object"
    if hint is list:
        def dec(v, kind, path):
            if not isinstance(v, (list, tuple)):
                raise _Bad(kind, path, v, "a list")
            return list(v)
        return (lambda v: list(v)), dec, "a list"
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        optional = len(inner) < len(args)
        if len(inner) > 1 and not all(_base(a) in (int, float, str, bool) for a in inner):
            raise TypeError(f"{owner}: a union of several types is of int, float, str and bool only, not {hint!r}")
        parts = [_codec_of(a, owner) for a in inner]
        expected = " or ".join([p[2] for p in parts] + (["null"] if optional else []))

        def dec(v, kind, path):
            if v is None and optional:
                return None
            for _enc1, dec1, _exp1 in parts:
                try:
                    return dec1(v, kind, path)
                except _Bad as exc:
                    if exc.path != path or len(parts) == 1 and not optional:
                        raise
            raise _Bad(kind, path, v, expected)
        enc1 = parts[0][0]   # a scalar's wire form is itself
        return (lambda v: None if v is None else enc1(v)), dec, expected
    if origin in (tuple, list):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            raise TypeError(f"{owner}: a tuple field is tuple[X, ...], not {hint!r}")
        enc1, dec1, exp1 = _codec_of(args[0], owner)
        expected = f"a list of {_plural(exp1)}"
        make = tuple if origin is tuple else list

        def dec(v, kind, path):
            if not isinstance(v, (list, tuple)):
                raise _Bad(kind, path, v, expected)
            try:
                return make(dec1(x, kind, f"{path}[{i}]") for i, x in enumerate(v))
            except _Bad as exc:
                if _is_item(exc.path, path):
                    raise _Bad(kind, path, v, expected) from None
                raise
        return (lambda v: [enc1(x) for x in v]), dec, expected
    if origin is dict:
        kt, vt = _base(args[0]), args[1]
        if kt not in (str, int):
            raise TypeError(f"{owner}: a dict field is keyed by str or int, not {kt!r}")
        enc1, dec1, exp1 = _codec_of(vt, owner)
        expected = f"an object of {'int' if kt is int else 'str'} -> {exp1}"

        def key_of(k, v, kind, path):
            if kt is str:
                return k
            if not (isinstance(k, str) and k.lstrip("-").isdigit()):
                raise _Bad(kind, path, v, expected)
            return int(k)

        def dec(v, kind, path):
            if not isinstance(v, dict):
                raise _Bad(kind, path, v, expected)
            try:
                return {key_of(k, v, kind, path): dec1(x, kind, f"{path}[{k}]") for k, x in v.items()}
            except _Bad as exc:
                if _is_item(exc.path, path):
                    raise _Bad(kind, path, v, expected) from None
                raise
        return (lambda v: {str(k): enc1(x) for k, x in v.items()}), dec, expected
    if isinstance(hint, type) and issubclass(hint, Message):
        def dec(v, kind, path):
            if not isinstance(v, dict):
                raise _Bad(kind, path, v, "an object")
            return hint._read(v, kind, path + ".")
        return (lambda v: v.to_wire()), dec, "an object"
    raise TypeError(f"{owner}: no wire form for the type {hint!r}")


def _plural(expected: str) -> str:
    for one, many in (("an int", "ints"), ("a number", "numbers"), ("a string", "strings"), ("a boolean", "booleans"),
                      ("an object", "objects")):
        if expected == one:
            return many
    return expected


class Message:
    """Base of a message (a frozen dataclass). Class keywords: ``plane`` and ``kind`` (register it in ``KINDS``),
    ``tag`` (the key that tells the variants of this kind apart), ``variant`` (this class's value of its base's
    tag)."""

    KIND: ClassVar[str] = ""
    TAG: ClassVar[str] = ""
    VARIANT: ClassVar[str] = ""
    SPARSE: ClassVar[bool] = False
    _variants: ClassVar[dict]
    _plan: ClassVar[list | None] = None

    def __init_subclass__(cls, plane: str | None = None, kind: str | None = None, tag: str | None = None,
                          variant: str | None = None, **kw):
        super().__init_subclass__(**kw)
        cls._plan = None
        if (plane is None) != (kind is None):
            raise TypeError(f"{cls.__name__}: a message kind is registered with its plane (both or neither)")
        if kind is not None:
            cls.KIND = kind
            register(plane, kind, cls)
        if tag is not None:
            cls.TAG = tag
            cls._variants = {}
        if variant is not None:
            if not cls.TAG:
                raise TypeError(f"{cls.__name__}: variant {variant!r} of a base without a tag")
            cls.VARIANT = variant
            cls._variants[variant] = cls

    @classmethod
    def _fields(cls) -> list[_Field]:
        if cls.__dict__.get("_plan") is None:
            if not dataclasses.is_dataclass(cls):
                raise TypeError(f"{cls.__name__} is a Message but not a dataclass")
            hints = typing.get_type_hints(cls, include_extras=True)
            plan = []
            for f in dataclasses.fields(cls):
                hint = hints[f.name]
                # a default: its value, or its factory (called for each message read: no mutable default shared)
                default = f.default if f.default is not dataclasses.MISSING else (
                    _Factory(f.default_factory) if f.default_factory is not dataclasses.MISSING
                    else dataclasses.MISSING)
                flat = typing.get_origin(hint) is Annotated and any(m is FLAT for m in hint.__metadata__)
                if flat:
                    inner = typing.get_args(hint)[0]
                    optional = typing.get_origin(inner) in (Union, types.UnionType)
                    msg = [a for a in typing.get_args(inner) if a is not type(None)][0] if optional else inner
                    if not (isinstance(msg, type) and issubclass(msg, Message)):
                        raise TypeError(f"{cls.__name__}.{f.name}: FLAT is for a Message field, not {inner!r}")
                    plan.append(_Field(f.name, None, msg, default, True, optional))
                else:
                    enc, dec, _ = _codec_of(hint, f"{cls.__name__}.{f.name}")
                    plan.append(_Field(f.name, enc, dec, default, False, cls.SPARSE and default is None))
            cls._plan = plan
        return cls._plan

    def to_wire(self) -> dict:
        """The JSON-safe body of this message (with its tag, for a variant)."""
        out = {}
        for f in self._fields():
            v = getattr(self, f.name)
            if f.flat:
                if v is not None:
                    out.update(v.to_wire())
            elif not (f.optional and v is None):
                out[f.name] = f.enc(v)
        if self.VARIANT:
            out[self.TAG] = self.VARIANT
        return out

    @classmethod
    def from_wire(cls, body):
        """The message ``body`` (a frame's JSON object) carries. Raises ValueError naming the kind, the first
        missing or malformed key, its value and what was expected."""
        kind = cls.KIND or cls.__name__
        if not isinstance(body, dict):
            raise ValueError(f"{kind} message is {type(body).__name__}; expected an object")
        if cls.TAG and not cls.VARIANT:
            what = body.get(cls.TAG)
            if cls.TAG not in body:
                raise ValueError(f"{kind} message lacks key {cls.TAG!r}")
            if what not in cls._variants:
                raise ValueError(f"{kind} message: {cls.TAG!r} is {_what(what)}; expected one of "
                                 f"{sorted(cls._variants)}")
            return cls._variants[what]._read(body, kind, "")
        return cls._read(body, kind, "")

    @classmethod
    def _read(cls, body: dict, kind: str, prefix: str):
        vals = {}
        for f in cls._fields():
            if f.flat:
                if f.optional and not any(g.name in body for g in f.dec._fields() if not g.flat):
                    vals[f.name] = None
                else:
                    vals[f.name] = f.dec._read(body, kind, prefix)
                continue
            if f.name not in body:
                if f.default is not dataclasses.MISSING:
                    vals[f.name] = f.default.make() if isinstance(f.default, _Factory) else f.default
                    continue
                raise ValueError(f"{kind} message lacks key {prefix + f.name!r}")
            vals[f.name] = f.dec(body[f.name], kind, prefix + f.name)
        return cls(**vals)


