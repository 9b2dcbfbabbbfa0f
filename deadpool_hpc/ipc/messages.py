"""Names the agent channel's messages use at both ends (``agent/`` answers, ``worker/`` asks), beyond the frames
(``ipc/frames.py``).

The generation store: a training process's ``AgentStore`` (worker/client.py) sends ``STORE_KINDS`` requests with
a ``generation``; its agent's ``GenerationStore`` of that generation (agent/store.py) answers ``store_reply``.
"""
from __future__ import annotations

STORE_KINDS = frozenset({"store_set", "store_get", "store_wait", "store_check"})
# the store the start-up's link check meets through (agent/preflight.py): served by every agent, spares included,
# under this generation number, which no generation of the job has (they count from 0)
LINK_GENERATION = -1
