"""Replica transports: the extension point for how a node agent's replica server is reached (docs/plugins.md).

The replica protocol (push, go, ack: replica/pusher.py and holder.py; restore, go, ack: replica/restore.py; signed JSON
headers, raw payloads, CRC-32C end to end) runs over stream sockets (replica/stream.py ``Link``). A transport decides
which sockets: their family, their address, how a listener is made and how a connection is opened. Registered in the
entry point group ``deadpool_hpc.transports``; ``--replica-transport NAME`` picks one (default ``tcp``).

Interface (an object, or a class whose instances are, registered under a name):

- ``listen(host) -> socket.socket``: a bound, listening stream socket for one replica server; ``host`` is the
  address this node's agents are reached at (Slurm: the node's IP);
- ``address(listener) -> list``: the JSON form peers connect to (exchanged among agents at start-up);
- ``open(address) -> (socket.socket, sockaddr)``: a new, unconnected stream socket and the sockaddr to connect it
  to (the caller connects it without blocking and bounds every call, ``Link.connect``); raises OSError if the
  address cannot be resolved;
- ``peer(address) -> str``: how messages name that peer.

What a transport cannot change: the messages, their HMAC, the checksums and the bounded waits (a transport only
supplies sockets). Built in: ``tcp`` (TCP, TCP_NODELAY; any hosts) and ``unix`` (abstract Unix-domain sockets:
every node agent on one machine, i.e. ``deadpool run``, or a site's co-located agents; no TCP/IP stack).
"""
from __future__ import annotations

import os
import secrets
import socket

from ..plugins import PluginError, load_named

GROUP = "deadpool_hpc.transports"
DEFAULT = "tcp"
BACKLOG = 64


class TcpTransport:
    """TCP: ``[host, port]``. The listener binds ``host`` as given (never a wildcard)."""
    name = "tcp"

    def listen(self, host: str) -> socket.socket:
        if host in ("", "0.0.0.0", "::"):
            raise ValueError(f"replica server host {host!r} is a wildcard; pass the address peers reach this "
                             "process at (127.0.0.1 locally, the node's IP under Slurm)")
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, 0), family=family, backlog=BACKLOG)

    def address(self, listener: socket.socket) -> list:
        return list(listener.getsockname()[:2])

    def open(self, address) -> tuple[socket.socket, object]:
        host, port = address[0], int(address[1])
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        return socket.socket(family, kind, proto), sockaddr

    def peer(self, address) -> str:
        return f"{address[0]}:{address[1]}"


class UnixTransport:
    """Abstract Unix-domain sockets: ``["unix", NAME]``, reachable from this machine's network namespace only (the
    local launcher's emulated nodes). The name is random (``deadpool-replica-<pid>-<hex>``), so another job cannot
    guess it; every message is still signed with the job secret."""
    name = "unix"

    def listen(self, host: str) -> socket.socket:
        name = f"deadpool-replica-{os.getpid()}-{secrets.token_hex(6)}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind("\0" + name)
            sock.listen(BACKLOG)
        except OSError:
            sock.close()
            raise
        return sock

    def address(self, listener: socket.socket) -> list:
        name = listener.getsockname()
        name = name.decode() if isinstance(name, bytes) else name
        return ["unix", name.lstrip("\0")]

    def open(self, address) -> tuple[socket.socket, object]:
        if len(address) != 2 or address[0] != "unix":
            raise OSError(f"not a unix replica address: {address!r}")
        return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), "\0" + str(address[1])

    def peer(self, address) -> str:
        return f"unix:{address[1]}"


def check_transport(name: str):
    """The transport registered as ``name``, built (a class is instantiated). Raises PluginError naming
    ``--replica-transport`` and the installed ones if there is none, or if it fails to import or lacks the
    interface."""
    obj = load_named(GROUP, name, "replica transport", "--replica-transport")
    try:
        t = obj() if isinstance(obj, type) else obj
    except Exception as exc:  # noqa: BLE001
        raise PluginError(f"replica transport plugin {name!r} raised at start-up: {type(exc).__name__}: {exc}") from exc
    missing = [m for m in ("listen", "address", "open", "peer") if not callable(getattr(t, m, None))]
    if missing:
        raise PluginError(f"replica transport plugin {name!r} ({t!r}) lacks {', '.join(missing)}(): see "
                          f"deadpool_hpc/replica/transports.py for the interface")
    return t
