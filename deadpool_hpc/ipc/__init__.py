"""How the run's processes talk, below everything that talks: signed messages (``wire``: JSON + HMAC, for MPI
control messages, the agent channel, the ring link, the replica stream and the fork server), the messages' schema
(``schema``: a dataclass per kind, its wire form from its type hints), the agent channel's frames (``frames``) and
its messages (``messages``), and the memory a node agent shares with its
training processes (``shm``: buffers, the progress page, the doorbell). Imports nothing of the planes, the agent or
the worker."""
