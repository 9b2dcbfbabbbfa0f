"""The local channel, training-process side: this process's link to its node agent, and the agent-backed Store.

Owns: connecting to the agent (``AgentClient.connect``: the ``hello``, the ``welcome`` with the progress page),
a reader thread that dispatches the agent's messages to handlers or per-kind queues, noticing the agent's death
(EOF: ``lost`` is set and ``on_lost`` called at once), mapping the shared buffers the agent passes
(``attach_slots``), and ``AgentStore``, a ``torch.distributed.Store`` whose ``set``/``get``/``wait``/``check``
are answered by the agent (``agent/store.py``), so a generation's rendezvous needs no store host. Does not own:
the frame format (``ipc/frames.py``) and admission (``agent/channel.py``), what the messages mean (the worker
loop), or the snapshot layout (``replica/snapshot.py``).

Every wait has a deadline: ``connect`` (``timeout``), ``get`` (``timeout``, required), ``send`` (the kernel
buffer is full for ``send_timeout`` seconds: the agent is frozen), the store's ops (their timeout). A wait ends
at once with AgentLost when the agent's end closes, and ``get`` also with PeerFailure when its ``failure``
turns true. The reader thread itself waits on the socket only (a daemon thread, ended by EOF or ``close``).
"""
from __future__ import annotations

import base64
import concurrent.futures as cf
import datetime as dt
import itertools
import logging
import math
import os
import socket
import threading
import time
from collections import defaultdict, deque

import torch.distributed as dist

from ..errors import AgentLost, ChannelError, ChannelTimeout, PeerFailure
from ..ipc.frames import ENV, FD_KEY, MAX_FDS, RESERVED, FrameReader, address_of, encode_frame
from ..ipc.messages import STORE_REQUESTS, Hello, Layout, Refused, Slots, StoreReply, StoreRequest, Welcome
from ..process import children
from ..ipc.shm import Doorbell, ProgressPage, SharedBuffer

logger = logging.getLogger(__name__)

_READ_CHUNK = 64 * 1024
_FAILURE_SLICE = 0.02   # seconds between two looks at a ``failure`` predicate while waiting


def _deadline(timeout, what: str) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"{what}: timeout {timeout!r} must be a positive, finite number of seconds")
    return time.monotonic() + timeout


class AgentClient:
    """A connected, welcomed channel to this node's agent. Build it with ``connect``.

    Attributes: ``local_rank``; ``agent_pid``; ``progress`` (the ProgressPage: ``beat()``, ``set_step``, ``arm``);
    ``lost`` (threading.Event, set once the agent's end closed); ``lost_why`` (str).
    """

    def __init__(self, sock: socket.socket, secret: bytes, local_rank: int, reader: FrameReader, welcome: Welcome,
                 page: ProgressPage, on_lost=None, send_timeout: float = 10.0):
        self.sock = sock
        children.keep_from_children(sock.fileno())   # a forked child (loader worker) must not hold our channel
        self.secret = secret
        self.local_rank = local_rank
        self.agent_pid = welcome.agent_pid
        self.progress = page
        self.bell: Doorbell | None = None   # the agent's doorbell (agent/desk.py), from ``attach_slots``
        self.on_lost = on_lost
        self.send_timeout = send_timeout
        self.lost = threading.Event()
        self.lost_why: str | None = None
        self._reader = reader
        self._send_lock = threading.Lock()
        self._dispatch_lock = threading.RLock()   # handlers see messages in order, backlog included
        self._cond = threading.Condition()
        self._queues: dict[str, deque] = defaultdict(deque)
        self._handlers: dict[str, object] = {}
        self._replies: dict[int, cf.Future] = {}
        self._ids = itertools.count(1)
        self._closing = False
        self.stores: deque = deque(maxlen=8)   # AgentStores of the newest generations, kept alive (see AgentStore)
        self.link_store = None   # the pre-flight link check's AgentStore, once made (worker/preflight.py)
        self._thread = threading.Thread(target=self._run, name="deadpool-agent-channel", daemon=True)
        self._thread.start()

    # ---- connecting --------------------------------------------------------------------
    @classmethod
    def connect(cls, name: str | None, secret: bytes, local_rank: int, timeout: float = 10.0, *, on_lost=None,
                send_timeout: float = 10.0) -> "AgentClient":
        """Connect to the agent's channel ``name`` (default: ``$DEADPOOL_AGENT_SOCK``) as ``local_rank``.

        Retries while nobody listens yet, sends ``hello {local_rank, pid}``, waits for the ``welcome`` and maps the
        progress page it carries; all within ``timeout`` seconds. on_lost(why): called once, from the thread that
        noticed (the reader at EOF, or a sender whose write failed), when the agent's end closes or the channel
        breaks (the caller should make the process exit: its agent is gone).
        send_timeout: seconds ``send`` may wait for room in the socket buffer.

        Raises ChannelError when the agent refuses (the reason, when it could be read), closes the connection, or
        answers with another secret; ChannelTimeout when no agent listens or none answers within ``timeout``;
        ValueError for a bad name or timeout.
        """
        name = name if name is not None else os.environ.get(ENV)
        if not name:
            raise ValueError(f"no channel name given and ${ENV} is not set")
        addr = address_of(name)
        deadline = _deadline(timeout, "connecting to the node agent")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        reader = FrameReader(secret)
        try:
            while True:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                try:
                    sock.connect(addr)
                    break
                except (ConnectionRefusedError, FileNotFoundError, BlockingIOError) as exc:  # none yet / backlog full
                    if time.monotonic() + 0.05 > deadline:
                        raise ChannelTimeout(f"no node agent listens on channel {name!r} (${ENV}) after "
                                             f"{timeout:g} s: {exc}") from None
                    time.sleep(0.05)
                except TimeoutError:
                    raise ChannelTimeout(f"the node agent on channel {name!r} did not accept within {timeout:g} s") \
                        from None
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                sock.sendall(encode_frame(Hello.KIND, Hello(local_rank, os.getpid()).to_wire(), secret),
                             socket.MSG_NOSIGNAL)
            except TimeoutError:
                raise ChannelTimeout(f"the node agent took no hello within {timeout:g} s") from None
            except OSError as exc:
                raise ChannelError(f"the node agent closed the channel before the hello: {exc}") from None
            kind, body = _first_message(sock, reader, deadline, timeout)
            fds = body.pop(FD_KEY, [])
            try:
                if kind == Refused.KIND:
                    raise ChannelError(f"the node agent refused local rank {local_rank}: {Refused.from_wire(body).why}")
                if kind != Welcome.KIND or len(fds) != 1:
                    raise ChannelError(f"the node agent answered the hello with {kind!r}; expected 'welcome' with 1 fd")
                welcome = Welcome.from_wire(body)
            except (ChannelError, ValueError) as exc:
                for fd in fds:
                    os.close(fd)
                raise exc if isinstance(exc, ChannelError) else ChannelError(str(exc)) from exc
            page = ProgressPage.attach(fds[0])
        except BaseException:
            sock.close()
            reader.close()
            raise
        sock.settimeout(send_timeout)
        return cls(sock, secret, local_rank, reader, welcome, page, on_lost, send_timeout)

    # ---- sending -------------------------------------------------------------------------
    def send(self, kind: str, body: dict) -> None:
        """Send message ``kind`` to the agent. Raises AgentLost if the agent is gone, ChannelTimeout if it took
        nothing for ``send_timeout`` seconds (the channel is then unusable: ``lost`` is set), WireError if the
        message exceeds ``wire.MAX_MESSAGE_BYTES``, ValueError for a reserved kind."""
        if kind in RESERVED:
            raise ValueError(f"message kind {kind!r} is reserved for the channel itself")
        frame = encode_frame(kind, body, self.secret)
        with self._send_lock:
            if self.lost.is_set():
                raise AgentLost(f"cannot send {kind!r}: {self.lost_why}")
            try:
                self.sock.sendall(frame, socket.MSG_NOSIGNAL)
                return
            except TimeoutError:
                why, err = (f"the node agent read nothing for {self.send_timeout:g} s (frozen?); a frame was cut",
                            ChannelTimeout)
            except OSError as exc:
                why, err = f"the node agent's end of the channel failed: {exc}", AgentLost
        self._lose(why)   # outside the lock: on_lost may try to send (and learn that it cannot)
        raise err(f"cannot send {kind!r}: {why}")

    # ---- receiving -----------------------------------------------------------------------
    def on(self, kind: str, fn) -> None:
        """Call ``fn(body)`` in the reader thread for every ``kind`` message from now on (instead of queueing it).
        ``fn`` must return quickly and must not wait on this client (its reader is the one calling). A body that
        carried fds has them in ``body["_fds"]`` (a list of ints, now owned by ``fn``). ``fn`` None: queue again.
        Messages of ``kind`` already queued are handed to ``fn`` now, in order."""
        with self._dispatch_lock:
            with self._cond:
                if fn is None:
                    self._handlers.pop(kind, None)
                    return
                self._handlers[kind] = fn
                backlog = list(self._queues.pop(kind, ()))
            for body in backlog:
                self._call(fn, kind, body)

    def get(self, kind: str, timeout: float, failure=None) -> dict:
        """The next queued ``kind`` message's body (oldest first), waiting up to ``timeout`` seconds.

        failure: a threading.Event, or a callable returning a reason (truthy) or None: the wait ends with
        PeerFailure as soon as it is set / returns a reason (looked at every 20 ms, and at once on ``wake()``).
        Raises AgentLost if the agent is gone, ChannelTimeout at the deadline, ValueError for a bad timeout.
        """
        deadline = _deadline(timeout, f"waiting for {kind!r}")
        check = None if failure is None else (failure.is_set if hasattr(failure, "is_set") else failure)
        with self._cond:
            while True:
                q = self._queues.get(kind)
                if q:
                    return q.popleft()
                if self.lost.is_set():
                    raise AgentLost(f"waiting for {kind!r} from the node agent: {self.lost_why}")
                if check is not None:
                    reason = check()
                    if reason:
                        raise PeerFailure(f"a failure ended the wait for {kind!r}"
                                          + ("" if reason is True else f": {reason}"))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ChannelTimeout(f"no {kind!r} message from the node agent within {timeout:g} s")
                self._cond.wait(left if check is None else min(left, _FAILURE_SLICE))

    def wake(self) -> None:
        """Wake every ``get`` so it looks at its ``failure`` now (call it where the failure flag is raised)."""
        with self._cond:
            self._cond.notify_all()

    def submit(self, kind: str, body: dict) -> cf.Future:
        """Send store request ``kind`` (one of ``ipc/messages.py`` STORE_REQUESTS) with ``body`` and a fresh ``id``
        and return at once: the Future gets the agent's StoreReply with that id (``answer`` reads it), or AgentLost
        if the channel goes first. Raises AgentLost if it is gone already, ValueError for a request that is not one
        (naming the key)."""
        rid = next(self._ids)
        fut: cf.Future = cf.Future()
        fut.rid = rid
        with self._cond:
            if self.lost.is_set():
                raise AgentLost(f"request {kind!r}: {self.lost_why}")
        if kind not in STORE_REQUESTS:
            raise ValueError(f"request kind {kind!r} is not a store request; accepted: {sorted(STORE_REQUESTS)}")
        msg: StoreRequest = STORE_REQUESTS[kind].from_wire(dict(body, id=rid))
        with self._cond:
            self._replies[rid] = fut
        fut.add_done_callback(lambda _f: self._forget(rid))
        try:
            self.send(kind, msg.to_wire())
        except BaseException:
            self._forget(rid)
            raise
        return fut

    def _forget(self, rid: int) -> None:
        with self._cond:
            self._replies.pop(rid, None)

    def request(self, kind: str, body: dict, timeout: float) -> StoreReply:
        """Send store request ``kind`` with a fresh ``id`` and wait for the agent's ``store_reply`` with that id
        (``timeout`` seconds). Returns the reply. Raises AgentLost, ChannelTimeout, or what ``submit`` and ``answer``
        raise."""
        deadline = _deadline(timeout, f"request {kind!r}")
        fut = self.submit(kind, body)
        try:
            reply = fut.result(max(0.0, deadline - time.monotonic()))
        except cf.TimeoutError:
            raise ChannelTimeout(f"no reply to {kind!r} from the node agent within {timeout:g} s") from None
        finally:
            self._forget(fut.rid)   # a reply that comes later is dropped
        return self.answer(kind, body, reply)

    @staticmethod
    def answer(kind: str, body: dict, reply: StoreReply) -> StoreReply:
        """The reply if it says ``ok``; else raises PeerFailure (``code`` "failed": the generation failed or
        was left), ChannelTimeout (``code`` "timeout"), ChannelError (anything else)."""
        if reply.ok:
            return reply
        code, error = reply.code, reply.error or "no reason given"
        if code == "failed":
            raise PeerFailure(f"{kind} {body.get('key') or body.get('keys')}: {error}")
        if code == "timeout":
            raise ChannelTimeout(f"{kind} {body.get('key') or body.get('keys')}: {error}")
        raise ChannelError(f"{kind} {body.get('key') or body.get('keys')}: {error}")

    def attach_slots(self, nbytes: int, timeout: float, count: int = 2, **layout) -> list[SharedBuffer]:
        """Ask the agent for ``count`` snapshot slots of ``nbytes`` bytes (``Layout``; ``layout``: its other fields,
        ``tensors``, ``rng_nbytes``, ``local_nbytes``, what the payload holds, for the agent's checkpoint writer),
        wait for its ``Slots`` message with the fds, map them. Returns the SharedBuffers (``.tensor`` / ``.array``
        views; ``.pin()`` on a GPU node). Raises ChannelError if the agent's answer does not match, TypeError for a
        ``layout`` field that ``Layout`` lacks."""
        self.send(Layout.KIND, Layout(nbytes=nbytes, count=count, **layout).to_wire())
        body = self.get(Slots.KIND, timeout)
        fds = body.get(FD_KEY, [])
        try:
            try:
                slots = Slots.from_wire(body)
            except ValueError as exc:
                raise ChannelError(str(exc)) from exc
            if slots.nbytes != nbytes or len(fds) != count + slots.bell:
                raise ChannelError(f"the agent sent {len(fds)} fds for slots of {slots.nbytes} bytes; asked "
                                   f"for {count} of {nbytes}" + (" and its doorbell" if slots.bell else ""))
        except ChannelError:
            for fd in fds:
                os.close(fd)
            raise
        if slots.bell:
            fd = fds.pop()
            # SCM_RIGHTS fds come without close-on-exec: the user's programs never get it
            os.set_inheritable(fd, False)
            self.bell = Doorbell(fd)        # agent/desk.py: rung after each claim and written word
            children.keep_from_children(fd)
        bufs = []
        try:
            for fd in fds:
                bufs.append(SharedBuffer.attach(fd, nbytes))   # takes fd: closed there, mapped or not
        except BaseException:
            for fd in fds[len(bufs) + 1:]:
                os.close(fd)
            for b in bufs:
                b.close()
            raise
        return bufs

    # ---- the reader thread ---------------------------------------------------------------
    def _run(self) -> None:
        why = None
        try:
            self._dispatch()   # whatever arrived with the welcome
            while why is None:
                try:
                    data, fds, flags, _ = socket.recv_fds(self.sock, _READ_CHUNK, MAX_FDS)
                except TimeoutError:
                    continue
                except OSError as exc:
                    why = f"the node agent's end of the channel failed: {exc}"
                    break
                for fd in fds:
                    os.set_inheritable(fd, False)
                if flags & socket.MSG_CTRUNC:
                    for fd in fds:
                        os.close(fd)
                    why = "fds from the node agent were cut off (MSG_CTRUNC)"
                    break
                if not data:
                    why = "the node agent's end of the channel closed (it exited or was killed)"
                    break
                self._reader.feed(data, fds)
                self._dispatch()
        except ChannelError as exc:
            why = f"bad frame from the node agent: {exc}"
        except BaseException as exc:  # noqa: BLE001 - the reader must report, never die silently
            why = f"the channel's reader failed: {exc!r}"
        if not self._closing:
            self._lose(why)

    def _dispatch(self) -> None:
        for kind, body in self._reader.messages():
            if kind == StoreReply.KIND:
                try:
                    reply = StoreReply.from_wire(body)
                except ValueError as exc:
                    raise ChannelError(str(exc)) from exc
                with self._cond:
                    fut = self._replies.get(reply.id)
                if fut is not None and not fut.done():
                    fut.set_result(reply)
                continue
            with self._dispatch_lock:
                with self._cond:
                    fn = self._handlers.get(kind)
                    if fn is None:
                        self._queues[kind].append(body)
                        self._cond.notify_all()
                if fn is not None:
                    self._call(fn, kind, body)

    @staticmethod
    def _call(fn, kind: str, body: dict) -> None:
        try:
            fn(body)
        except Exception:  # noqa: BLE001 - a handler's bug must not stop the channel
            logger.exception("handler for %r failed", kind)

    def _lose(self, why: str) -> None:
        """The channel is gone: set ``lost``, end every wait at once, call ``on_lost`` (once)."""
        with self._cond:
            if self.lost.is_set():
                return
            self.lost_why = why
            self.lost.set()
            replies, self._replies = list(self._replies.values()), {}
            self._cond.notify_all()
        for fut in replies:
            if not fut.done():
                fut.set_exception(AgentLost(why))
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self.on_lost is not None and not self._closing:
            try:
                self.on_lost(why)
            except Exception:  # noqa: BLE001
                logger.exception("on_lost handler failed")

    def close(self) -> None:
        """Close the channel (the agent sees EOF; ``on_lost`` is not called). Waits up to 1 s for the reader."""
        self._closing = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(1.0)
        with self._cond:
            if not self.lost.is_set():
                self.lost_why = "closed by this process"
                self.lost.set()
            replies, self._replies = list(self._replies.values()), {}
            self._cond.notify_all()
        for fut in replies:
            if not fut.done():
                fut.set_exception(AgentLost(self.lost_why))
        children.release(self.sock.fileno())
        self.sock.close()
        self._reader.close()
        with self._cond:
            for q in self._queues.values():   # fds that came with messages nobody took
                for body in q:
                    for fd in body.get(FD_KEY, ()):
                        os.close(fd)
            self._queues.clear()
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        if self.bell is not None:
            if self.bell.fd is not None:
                children.release(self.bell.fd)
            self.bell.close()


def _first_message(sock: socket.socket, reader: FrameReader, deadline: float, timeout: float):
    """Read until one whole frame is in (the agent's answer to the hello), within ``deadline``."""
    while True:
        try:
            for kind, body in reader.messages():
                return kind, body
        except ChannelError as exc:
            if "HMAC" in str(exc):
                raise ChannelError("the node agent's answer fails verification: this process's job secret "
                                   "(DEADPOOL_JOB_SECRET) is not the agent's") from None
            raise
        left = deadline - time.monotonic()
        if left <= 0:
            raise ChannelTimeout(f"the node agent did not answer the hello within {timeout:g} s")
        sock.settimeout(left)
        try:
            data, fds, flags, _ = socket.recv_fds(sock, _READ_CHUNK, MAX_FDS)
        except TimeoutError:
            raise ChannelTimeout(f"the node agent did not answer the hello within {timeout:g} s") from None
        except OSError as exc:
            raise ChannelError(f"the node agent closed the channel during the hello: {exc}") from None
        for fd in fds:
            os.set_inheritable(fd, False)
        reader.feed(data, fds)
        if not data:
            raise ChannelError("the node agent closed the channel during the hello without a reason (refused: see "
                               "its agent_refused event)")


def _b64(value) -> str:
    return base64.b64encode(bytes(value)).decode("ascii")


class AgentStore(dist.Store):
    """A ``torch.distributed.Store`` served by this process's node agent (``agent/store.py``), for one generation.

    client: the AgentClient. generation: the generation whose store this is (the agent answers only for its
    current one). timeout: seconds for ``get`` and for ``wait`` without its own timeout (torch passes one).

    Supported: ``set``, ``get``, ``wait``, ``check`` (gloo's init uses set/wait/get, measured on torch 2.13;
    NCCL's unique id travels by set/get). Values are bytes, base64 in the JSON message: at most ~45 KiB each.
    Others (``add``, ``compare_set``, ``delete_key``, ``num_keys``) raise ChannelError: a replicated map
    without a leader cannot make them atomic. Errors: PeerFailure when the generation fails or is left while a
    call waits (``GenerationStore.fail_all``); ChannelTimeout at a deadline; AgentLost if the agent is gone.

    Lifetime: torch holds only the C++ half of a Python store; once the Python object is collected, every call from
    C++ fails with "INTERNAL ASSERT FAILED ... Not implemented" (measured, torch 2.13: ``PrefixStore("g",
    AgentStore(...))`` with no other reference broke gloo's init at world size 2). So each AgentStore registers
    itself in ``client.stores`` (the newest 8 generations' stores stay alive).
    """

    def __init__(self, client: AgentClient, generation: int, timeout: float = 60.0):
        super().__init__()
        _deadline(timeout, "AgentStore")
        self.client = client
        self.generation = generation
        self._timeout_s = float(timeout)
        client.stores.append(self)

    def _req(self, kind: str, body: dict, timeout: float) -> StoreReply:
        body = dict(body, generation=self.generation, timeout=timeout)
        return self.client.request(kind, body, timeout + 1.0)   # +1 s: the agent's own deadline answers first

    def set(self, key: str, value) -> None:
        self._req("store_set", {"key": key, "value": _b64(value)}, self._timeout_s)

    def get(self, key: str) -> bytes:
        return base64.b64decode(self._req("store_get", {"key": key}, self._timeout_s).value)

    def wait(self, keys, timeout=None) -> None:
        if isinstance(timeout, dt.timedelta):
            timeout = timeout.total_seconds()
        t = self._timeout_s if not timeout or timeout <= 0 else float(timeout)
        self._req("store_wait", {"keys": list(keys)}, t)

    def check(self, keys) -> bool:
        return bool(self._req("store_check", {"keys": list(keys)}, self._timeout_s).value)

    def _unsupported(self, op: str):
        raise ChannelError(f"AgentStore supports set/get/wait/check only; {op} is not available (no leader to "
                           f"make it atomic)")

    def add(self, key, value):
        self._unsupported("add")

    def compare_set(self, key, expected, desired):
        self._unsupported("compare_set")

    def delete_key(self, key):
        self._unsupported("delete_key")

    def num_keys(self):
        self._unsupported("num_keys")
