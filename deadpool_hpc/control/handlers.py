"""The control plane's table of message handlers: which function the node agent's main thread runs for a control
message of each kind that ``ControlPlane`` does not handle itself (``ControlPlane.pump`` dispatches to it).

Owns: registration (one handler per kind, refused twice, refused for a kind the plane keeps for itself) and the
read-only view dispatch reads. Does not own: the messages, their transport (control/peers.py) or the thread that runs
the handlers (the agent's main thread, in ``pump``). Pure logic: tests/unit/control/test_handlers.py runs it without
MPI.

A kind with a schema on the control plane (ipc/schema.py ``KINDS``; control/messages.py) reaches its handler typed:
``dispatch`` reads the body into its message first. A kind without one (a few still) reaches it as the dict.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from ..ipc.schema import CONTROL, KINDS, Message

Handler = Callable[[int, "Message | dict"], None]   # handler(src, msg): src is the sender's MPI rank


class HandlerTable(Mapping):
    """{kind: handler(src, body)}, readable as a mapping and written only through ``on`` / ``off``.

    reserved: kinds the owner handles itself (a handler registered for one would never run).
    """

    def __init__(self, reserved=()):
        self.reserved = frozenset(reserved)
        self._fns: dict[str, Handler] = {}

    def on(self, kind: str, handler: Handler) -> None:
        """Register ``handler`` for messages of ``kind``. Raises ValueError for a kind registered already (naming
        both handlers), a reserved kind (naming the reserved ones), or a handler that is not callable."""
        if not callable(handler):
            raise ValueError(f"handler for control message kind {kind!r} is {handler!r}: not callable")
        if kind in self.reserved:
            raise ValueError(f"control message kind {kind!r} is handled by the control plane itself; a handler "
                             f"({handler!r}) may be registered for any kind but {sorted(self.reserved)}")
        old = self._fns.get(kind)
        if old is not None:
            raise ValueError(f"control message kind {kind!r} has a handler already ({old!r}); refusing a second "
                             f"one ({handler!r})")
        self._fns[kind] = handler

    def off(self, owner) -> list[str]:
        """Unregister every handler that is a method of ``owner`` (an object being replaced). Returns the kinds
        unregistered, in registration order."""
        kinds = [k for k, fn in self._fns.items() if getattr(fn, "__self__", None) is owner]
        for k in kinds:
            del self._fns[k]
        return kinds

    def dispatch(self, src: int, kind: str, body: dict) -> bool:
        """Run the handler of ``kind`` (if any: False when none) with ``src`` and the body, read into its message when
        the kind has a schema. Raises ValueError (naming the kind and the key) for a malformed body; the handler
        does not run then."""
        fn = self._fns.get(kind)
        if fn is None:
            return False
        reader = KINDS[CONTROL].get(kind)
        fn(src, body if reader is None else reader.from_wire(body))
        return True

    def __getitem__(self, kind: str) -> Handler:
        return self._fns[kind]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fns)

    def __len__(self) -> int:
        return len(self._fns)
