"""This node's address as other nodes reach it, without importing torch (the control-plane probes of the scale
study, docs/scaling.md, start 256 processes on one machine: torch in each would not fit its memory)."""
from __future__ import annotations

import os
import socket


def store_host() -> str:
    """Address other nodes use to reach a store served here: $DEADPOOL_STORE_HOST, else this host's IP."""
    env = os.environ.get("DEADPOOL_STORE_HOST")
    if env:
        return env
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
