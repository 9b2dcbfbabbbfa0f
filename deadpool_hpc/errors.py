"""Exceptions shared by every plane. Small and dependency-free on purpose."""


class ConfigError(ValueError):
    """A run layout or fault spec that cannot work. The message names the bad value and what is accepted."""


class PeerFailure(RuntimeError):
    """A peer of the current generation failed (or is suspected): leave the step and recover.

    Raised by pollable collectives and replica waits when the control plane's failure flag is set
    or a gloo collective errors out. Never escapes ``Context.run``.
    """


class ReplicaError(RuntimeError):
    """A replica failed verification (wrong step, checksum, size) and must not be used."""


class WireError(ValueError):
    """A control message failed its authentication tag or could not be decoded."""


class CheckpointFailed(RuntimeError):
    """A checkpoint the run needs now (no spare left, preempted) could not be written (ENOSPC, EDQUOT, EROFS, EIO,
    a write that did not complete in time): the run ends with this reason; checkpoint/LATEST still names the
    previous complete checkpoint, if any."""


class JobAborted(RuntimeError):
    """Another process hit an error in user code and asked the whole job to stop."""


class RecoveryTimeout(RuntimeError):
    """A recovery round produced no decision within its deadline (``recovery_timeout``): the process gives up
    with this clear error instead of waiting for ever."""


class StartupTimeout(RecoveryTimeout):
    """The job did not start within ``--startup-timeout`` seconds: a process died or froze during start-up."""


class Fenced(RuntimeError):
    """The others declared this process failed (a false suspicion, a frozen process woken up, a node cut off):
    it learns so from a ``fenced`` notice or from the decision, and must stop."""


class RunFinished(RuntimeError):
    """The run completed (rank 0 said so) while this process was recovering: it has nothing left to do."""


class ChannelError(RuntimeError):
    """The local channel between a node agent and a training process failed: a refused or broken connection,
    a malformed frame, or a reply that did not come within its deadline."""


class AgentLost(ChannelError):
    """The training process's node agent is gone (its end of the channel closed): the process must exit."""


class ChannelTimeout(ChannelError, TimeoutError):
    """A wait on the local channel reached its deadline (the other side is frozen, busy, or never answered)."""


# A training process's exit code when it failed before reaching ``ctx.run`` (importing the user's module, building
# the model): its node agent reports the node failed with cause "startup_failed" (worker/entry.py, agent/node.py).
STARTUP_FAILED_EXIT = 3

# The exit status of a run that a crash loop stopped (control/crashloop.py: the same training rank ended the same way at
# the same step on more than --crash-loop-limit other nodes): its node agents' (after saving the checkpoint of the cut
# step) and ``deadpool run``'s. Not 75: such a run is never requeued, it would resume into the same crash.
CRASH_LOOP_EXIT = 4
