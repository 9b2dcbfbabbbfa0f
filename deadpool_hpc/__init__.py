"""deadpool-hpc: keep large training jobs alive by hot-swapping a failed node for a spare.

The public API, in one place (see docs/worker-contract.md for the training-function contract). Fault injection
(``deadpool_hpc.faultinject``) is for tests and demos, not part of it.
"""
from .config import RunConfig as RunConfig
from .errors import ConfigError as ConfigError
from .errors import PeerFailure as PeerFailure
from .errors import ReplicaError as ReplicaError
from .summary import build_summary as build_summary

__version__ = "0.1.0"
