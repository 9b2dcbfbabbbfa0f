"""A generation's key/value store, agent side: the replica every member agent keeps, and its parked waits.

Owns: the key/value map of one generation (``GenerationStore``), answering the store requests of the training
processes of this node (``store_set``/``store_get``/``store_wait``/``store_check``, sent by
``worker/client.py:AgentStore``), parking a ``get``/``wait`` until its keys arrive or its deadline passes, and
failing every parked request at once (``fail_all``) when the failure flag rises or the generation is left, so a
rendezvous that cannot complete ends in milliseconds instead of at its timeout. Does not own: carrying a ``set``
to the other member agents (the ``broadcast(key, value)`` callback: the agent wires it to its control plane, and
calls ``apply`` for the keys other agents broadcast), nor the socket (``agent/channel.py``).

No leader: every member agent holds the whole map, so no store host can be lost. Hence no ``add`` or
``compare_set`` (they would need one); gloo's and NCCL's rendezvous need neither (set/wait/get, measured on
torch 2.13). Values are bytes (base64 in messages). Thread-safe: requests come from the channel's thread, ``apply``
from the control plane's, ``fail_all`` from whichever sees the failure; replies are sent outside the lock.
"""
from __future__ import annotations

import base64
import math
import threading
import time

from ..ipc.messages import STORE_REQUESTS, StoreCheck, StoreGet, StoreReply, StoreSet


class _Parked:
    __slots__ = ("keys", "deadline", "done", "value_of")

    def __init__(self, keys, deadline, done, value_of):
        self.keys = keys
        self.deadline = deadline
        self.done = done          # done(reply_body)
        self.value_of = value_of  # the key whose value the reply carries (get), or None (wait)


class GenerationStore:
    """The key/value replica of ``generation``.

    broadcast(key: str, value: bytes): called (outside the lock, in the caller's thread) after every ``set`` from a
    local training process; the agent sends the key to every other member agent, which ``apply`` it. Its errors
    are reported to the caller of ``set`` (as ``failed``).
    """

    def __init__(self, generation: int, broadcast=None):
        self.generation = generation
        self.broadcast = broadcast
        self._lock = threading.Lock()
        self._data: dict[str, bytes] = {}
        self._parked: list[_Parked] = []
        self._failed: str | None = None

    # ---- the map ---------------------------------------------------------------------------
    def set(self, key: str, value: bytes) -> None:
        """A local set: store, wake the waits it completes, broadcast. Raises the broadcast's error."""
        self.apply(key, value)
        if self.broadcast is not None:
            self.broadcast(key, value)

    def apply(self, key: str, value: bytes) -> None:
        """A set that another member agent broadcast (or ``set``'s own store): no broadcast. Ignored once failed."""
        value = bytes(value)
        with self._lock:
            if self._failed is not None:
                return
            self._data[key] = value
            ready = [p for p in self._parked if key in p.keys and all(k in self._data for k in p.keys)]
            if ready:
                self._parked = [p for p in self._parked if p not in ready]
                replies = [(p, self._ok(p)) for p in ready]
        if ready:
            for p, body in replies:
                p.done(body)

    def drop(self, prefix: str) -> int:
        """Forget every key that starts with ``prefix`` (a link re-check's, once judged: agent/node.py). Returns
        how many. A parked wait keeps waiting (for a key set again, or its deadline)."""
        with self._lock:
            gone = [k for k in self._data if k.startswith(prefix)]
            for k in gone:
                del self._data[k]
        return len(gone)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._data

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._data)

    @property
    def failed(self) -> str | None:
        """The reason given to ``fail_all``, or None."""
        return self._failed

    def parked(self) -> int:
        """Requests waiting for keys."""
        with self._lock:
            return len(self._parked)

    # ---- requests (callback style: never blocks) ------------------------------------------
    def get(self, key: str, done, timeout: float) -> None:
        """``done({"ok": True, "value": base64})`` once ``key`` is present (now or later), or ``done({"ok": False,
        "code": "failed"|"timeout", "error": ...})`` at ``fail_all`` or after ``timeout`` seconds."""
        self._request([key], done, timeout, key)

    def wait(self, keys: list[str], done, timeout: float) -> None:
        """``done({"ok": True})`` once every key is present; failures as in ``get``."""
        self._request(list(keys), done, timeout, None)

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            return all(k in self._data for k in keys)

    def _request(self, keys, done, timeout, value_of) -> None:
        with self._lock:
            if self._failed is not None:
                body = self._fail_body(self._failed)
            elif all(k in self._data for k in keys):
                body = self._ok(_Parked(keys, 0.0, done, value_of))
            else:
                self._parked.append(_Parked(keys, time.monotonic() + timeout, done, value_of))
                return
        done(body)

    def _ok(self, p: _Parked) -> dict:
        if p.value_of is None:
            return {"ok": True}
        return {"ok": True, "value": base64.b64encode(self._data[p.value_of]).decode("ascii")}

    def _fail_body(self, reason: str) -> dict:
        return {"ok": False, "code": "failed", "error": f"generation {self.generation}'s store failed: {reason}"}

    def fail_all(self, reason: str) -> int:
        """Fail every parked request now, and every later one at once (the failure flag rose, or the generation was
        left). Idempotent (the first reason stays). Returns the number of requests failed now."""
        with self._lock:
            if self._failed is None:
                self._failed = reason
            parked, self._parked = self._parked, []
            body = self._fail_body(self._failed)
        for p in parked:
            p.done(body)
        return len(parked)

    def expire(self, now: float | None = None) -> int:
        """Answer ``timeout`` to the parked requests past their deadline (the agent calls this every iteration of its
        loop). Returns how many expired."""
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [p for p in self._parked if p.deadline <= now]
            if not gone:
                return 0
            self._parked = [p for p in self._parked if p.deadline > now]
        for p in gone:
            missing = [k for k in p.keys if k not in self._data]
            p.done({"ok": False, "code": "timeout",
                    "error": f"keys {missing} of generation {self.generation} did not arrive in time"})
        return len(gone)

    # ---- the channel's messages -----------------------------------------------------------
    def handle(self, local_rank: int, kind: str, body: dict, send) -> bool:
        """Serve one store message from ``local_rank``'s training process; the reply goes out as
        ``send(local_rank, "store_reply", {id, ok, ...})`` (``ChannelServer.send``), now or when the request
        completes. Returns False (and does nothing) if ``kind`` is not a store message. A request for another
        generation, or malformed, is answered with ``code: "bad"``.
        """
        cls = STORE_REQUESTS.get(kind)
        if cls is None:
            return False
        rid = body.get("id")
        rid = rid if isinstance(rid, int) and not isinstance(rid, bool) else None

        def done(reply: dict) -> None:
            send(local_rank, StoreReply.KIND, StoreReply(id=rid, **reply).to_wire())

        gen = body.get("generation")
        if gen != self.generation:
            done({"ok": False, "code": "failed" if self._failed else "bad",
                  "error": f"a store request for generation {gen!r}; this agent serves generation {self.generation}"})
            return True
        try:
            req = cls.from_wire(body)
            if not math.isfinite(req.timeout) or req.timeout <= 0:
                raise ValueError(f"timeout {req.timeout!r} is not a positive number of seconds")
            if isinstance(req, StoreSet):
                value = base64.b64decode(req.value, validate=True)
                if self._failed is not None:
                    done(self._fail_body(self._failed))
                    return True
                try:
                    self.set(req.key, value)
                except Exception as exc:  # noqa: BLE001 - the broadcast failed: the caller must hear it
                    done({"ok": False, "code": "failed", "error": f"broadcasting {req.key!r} failed: {exc}"})
                else:
                    done({"ok": True})
            elif isinstance(req, StoreCheck):
                done({"ok": True, "value": self.check(list(req.keys))})
            elif isinstance(req, StoreGet):
                self.get(req.key, done, req.timeout)
            else:
                self.wait(list(req.keys), done, req.timeout)
        except (ValueError, TypeError) as exc:
            done({"ok": False, "code": "bad", "error": f"malformed {kind}: {exc!r}"})
        return True
