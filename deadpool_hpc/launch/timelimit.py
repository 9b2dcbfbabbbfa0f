"""The time limit and the signal lead of a Slurm job, checked before it is submitted (pure logic, no Slurm call).

A hot-swap job asks Slurm for a warning signal (``#SBATCH --signal=USR2@LEAD``, templates/train.sbatch; submitit's
``signal_delay_s``) LEAD seconds before its time limit: the ranks save a checkpoint at the next agreed step, the
job is requeued and resumes (docs/slurm.md, "Signals"). Slurm sends that signal *up to 60 s earlier* than asked
(sbatch(1), ``--signal``: "Due to the resolution of event handling by Slurm, the signal may be sent up to 60
seconds earlier than specified"; slurmctld looks at the time limits every 30 s). A lead close to the time limit
therefore stops the job as soon as it starts, and again after every requeue (``deadpool submit --time 2`` with
the template's USR2@120 would do that).

What is accepted: ``lead >= MIN_SIGNAL_LEAD_S`` and ``limit - lead >= SIGNAL_EARLY_S + MIN_TRAIN_S`` (90 s); a job
with no time limit is not checked. Otherwise the submission is refused (ConfigError, exit 2 in the CLI) naming the
time limit, the lead and what would be accepted. The lead is never shortened behind the user's back: it is the
time the save of *their* model needs, which only they know (a save cut short by the time limit's SIGKILL, after
KillWait, loses it); the refusal costs one flag (``--signal-lead``).
"""
from __future__ import annotations

import argparse
import math
import re
import signal as _signal

from ..errors import ConfigError

# the template's ``#SBATCH --signal=USR2@120`` (tests/unit/launch/test_timelimit.py keeps them equal)
DEFAULT_SIGNAL_LEAD_S = 120
SIGNAL_EARLY_S = 60           # Slurm may send the --signal this much earlier than asked (sbatch(1))
MIN_TRAIN_S = 30              # after the earliest signal: the job's start-up and its first steps (docs/slurm.md:
                              # first step 12.5-12.7 s after Slurm started the attempt, 2 + 1 nodes, the demo; up to
                              # 40 s after a requeue on the busy CI machine: a floor, an attempt without a step is
                              # requeued, a bounded number of times, by slurm_job.settle)
MIN_SIGNAL_LEAD_S = 10        # the ranks' save + srun's end + the requeue: SIGUSR2 to requeued 1.1-1.8 s measured
                              # here (docs/slurm.md); a big model's save needs more: raise the lead
MAX_SIGNAL_LEAD_S = 65535     # Slurm's limit for --signal's @sig_time
ACCEPTED_TIME = ("accepted (Slurm's --time formats): MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS, "
                 "DAYS-HOURS:MINUTES, DAYS-HOURS:MINUTES:SECONDS, or 0, -1, UNLIMITED, INFINITE (no limit)")

_HMS = re.compile(r"(\d+)(?::(\d+)(?::(\d+))?)?")
_DHMS = re.compile(r"(\d+)-(?:(\d+)(?::(\d+)(?::(\d+))?)?)?")


def parse_time_limit(text: str, what: str = "--time") -> int | None:
    """A Slurm time limit (``sbatch --time``) in seconds, as Slurm applies it: seconds rounded up to a whole minute
    (Slurm's resolution), ``None`` for no limit (``0``, ``-1``, ``UNLIMITED``, ``INFINITE``, or any form of zero).
    Formats: MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS, DAYS-HOURS:MINUTES,
    DAYS-HOURS:MINUTES:SECONDS (``2`` and ``2:00`` are 120 s, ``0:30`` is 60 s, ``1-0`` is 86400 s; compared with
    sbatch 22.05 on the local cluster, tests/slurm/test_slurm_timelimit.py). Raises ConfigError naming ``what``,
    the value and the accepted formats for anything else (sbatch refuses those too)."""
    s = str(text)
    if s.upper() in ("-1", "UNLIMITED", "INFINITE"):
        return None
    m = _DHMS.fullmatch(s)
    if m:
        d, h, mi, se = (int(g or 0) for g in m.groups())
        secs = d * 86400 + h * 3600 + mi * 60 + se
    else:
        m = _HMS.fullmatch(s)
        if m is None:
            raise ConfigError(f"{what} {s!r} is not a Slurm time limit; {ACCEPTED_TIME}")
        a, b, c = m.groups()
        if c is not None:
            secs = int(a) * 3600 + int(b) * 60 + int(c)
        elif b is not None:
            secs = int(a) * 60 + int(b)
        else:
            secs = int(a) * 60
    return math.ceil(secs / 60) * 60 or None


def parse_signal(text: str) -> tuple[str, int]:
    """sbatch's ``--signal=[{R|B}:]SIG[@SECONDS]`` -> (the signal's name, the lead in seconds; Slurm's default 60).
    Raises ConfigError naming the value."""
    m = re.fullmatch(r"(?:([RB]{1,2}):)?([A-Za-z0-9]+)(?:@(\d+))?", str(text))
    name = None
    if m:
        sig = m.group(2).upper()
        if sig.isdigit():
            try:
                name = _signal.Signals(int(sig)).name
            except ValueError:
                name = None
        else:
            name = sig if sig.startswith("SIG") else "SIG" + sig
            name = name if name in _signal.Signals.__members__ else None
    if name is None:
        raise ConfigError(f"--signal {text!r}: accepted: [R:|B:]SIGNAL[@SECONDS], e.g. USR2@120 or B:USR2@120")
    return name, int(m.group(3)) if m.group(3) else 60


def signal_lead(text: str) -> int:
    """``--signal-lead``: whole seconds, MIN_SIGNAL_LEAD_S to MAX_SIGNAL_LEAD_S. Raises ConfigError naming the
    value otherwise."""
    try:
        v = int(str(text))
    except ValueError:
        v = None
    if v is None or not MIN_SIGNAL_LEAD_S <= v <= MAX_SIGNAL_LEAD_S:
        raise ConfigError(f"--signal-lead {text!r}: accepted: whole seconds from {MIN_SIGNAL_LEAD_S} (the ranks' "
                          f"save and the job's requeue must fit in it; raise it for a big model) to "
                          f"{MAX_SIGNAL_LEAD_S} (Slurm's limit)")
    return v


def signal_lead_arg(text: str) -> int:
    """argparse ``type`` of ``--signal-lead`` (``deadpool submit``): signal_lead's ConfigError as argparse's error,
    so the command exits 2 naming the value."""
    try:
        return signal_lead(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--signal-lead ")) from None


def max_lead(limit_s: int) -> int:
    """The longest signal lead (s) a time limit of ``limit_s`` seconds accepts."""
    return limit_s - SIGNAL_EARLY_S - MIN_TRAIN_S


def min_time_min(lead_s: int) -> int:
    """The shortest time limit (whole minutes) that a signal lead of ``lead_s`` seconds accepts."""
    return math.ceil((lead_s + SIGNAL_EARLY_S + MIN_TRAIN_S) / 60)


def check_lead(limit_s: int | None, lead_s: int, time_what: str, lead_opt: str = "--signal-lead {}",
               time_opt: str = "--time {}", sig: str = "SIGUSR2", time_with: str | None = None) -> None:
    """Refuse a signal lead of ``lead_s`` seconds that leaves no time to train before the signal under a time limit
    of ``limit_s`` seconds (None: no limit, accepted). ``time_what`` names where the limit came from (e.g.
    ``--time 2``); ``lead_opt`` and ``time_opt`` spell the options in the caller's words (``{}``: the value);
    ``sig``: the signal's name; ``time_with``: how the accepted lead is said to go with that limit (default
    ``with <time_what>``). Raises ConfigError naming the limit, the lead and what is accepted: a lead of at most
    ``max_lead(limit_s)`` (if that is still at least MIN_SIGNAL_LEAD_S), or a time limit of at least
    ``min_time_min(lead_s)`` minutes."""
    if limit_s is None or limit_s - lead_s >= SIGNAL_EARLY_S + MIN_TRAIN_S:
        return
    lead_words = lead_opt.format(lead_s)
    fits = max_lead(limit_s)
    accepted = [time_opt.format(min_time_min(lead_s)) + f" or more with {lead_words}"]
    if fits >= MIN_SIGNAL_LEAD_S:
        accepted.insert(0, lead_opt.format(fits) + f" or less (at least {MIN_SIGNAL_LEAD_S}) "
                           + (time_with or f"with {time_what}"))
    when = "as soon as it starts" if lead_s + SIGNAL_EARLY_S >= limit_s else \
        f"{limit_s - lead_s - SIGNAL_EARLY_S} s after it starts, at the earliest"
    raise ConfigError(
        f"{time_what} ({limit_s} s) leaves no time to train before the signal: {lead_words} asks Slurm for {sig} "
        f"{lead_s} s before the time limit (to save a checkpoint and requeue the job), and Slurm may send it up to "
        f"{SIGNAL_EARLY_S} s earlier, so every attempt of the job would be told to stop {when}; accepted: "
        f"{', or '.join(accepted)} (the time limit must exceed the lead by {SIGNAL_EARLY_S + MIN_TRAIN_S} s: "
        f"{SIGNAL_EARLY_S} s of Slurm's early signal + {MIN_TRAIN_S} s to start and train)")


def sbatch_option(args: list[str] | None, long: str, short: str | None = None) -> str | None:
    """The value of the last ``--LONG=V`` / ``--LONG V`` / ``-SV`` / ``-S V`` among extra sbatch arguments (the
    last one is the one sbatch applies), or None."""
    found = None
    args = list(args or [])
    for i, a in enumerate(args):
        if a.startswith(f"--{long}="):
            found = a.split("=", 1)[1]
        elif a == f"--{long}" and i + 1 < len(args):
            found = args[i + 1]
        elif short and a == f"-{short}" and i + 1 < len(args):
            found = args[i + 1]
        elif short and a.startswith(f"-{short}") and len(a) > 2 and not a.startswith("--"):
            found = a[2:]
    return found


def check_submitit(time, delay_s, time_name: str = "timeout_min", lead_name: str = "signal_delay_s") -> None:
    """The submitit executors' check (``SubmititExecutor``, the plugin's ``DeadpoolExecutor``): the time
    limit ``time`` (submitit's ``timeout_min``: minutes, or any Slurm --time string; None: no limit) against
    submitit's signal lead ``delay_s`` (``signal_delay_s``, seconds; submitit's default 90), as check_lead. Raises
    ConfigError naming the parameters by ``time_name`` and ``lead_name``."""
    if (isinstance(delay_s, bool) or not isinstance(delay_s, int)
            or not MIN_SIGNAL_LEAD_S <= delay_s <= MAX_SIGNAL_LEAD_S):
        raise ConfigError(f"{lead_name}={delay_s!r}: accepted: whole seconds from {MIN_SIGNAL_LEAD_S} (the ranks' save "
                          f"and the job's requeue must fit in it; raise it for a big model) to {MAX_SIGNAL_LEAD_S}")
    limit = parse_time_limit(str(time), time_name) if time is not None else None
    check_lead(limit, delay_s, f"{time_name}={time}", lead_opt=f"{lead_name}={{}}", time_opt=f"{time_name}={{}}")
