"""The run directory: its paths, its one-run-at-a-time lock, fresh vs resumed runs, crash-safe writes.

Owns where each file of a run lives, which checks a path must pass to be a run directory, the lock
that keeps a second run out, what a fresh run removes (``prepare_run_dir``: every launch path calls it, the
local launcher, the batch template through ``python -m deadpool_hpc.launch.batch prepare`` and submitit's
HotSwapJob), atomic writes of config.json and of the summaries, and the ``requeued`` event (``emit_requeued``).
Does not own what the files hold (config.py, events.py, summary.py) nor the checkpoint format
(replica/persist.py).

Layout of ``RUN_DIR``::

    run.lock       locked (flock) by the run that uses the directory; says who: {pid, start, host, run_id, since}
    config.json    the RunConfig of the run (written atomically)
    events.jsonl   the event log (events.py), appended by every process
    launcher.log   stdout/stderr of mpiexec and the workers (local launcher)
    summary.json   the run summary, written when the launcher ends, interrupted or not
    checkpoint/    persistent checkpoints: no spare left, or preempted (replica/persist.py)
    Slurm jobs also: slurm_job_id, job.sbatch, task-N.log, batch.alive, finisher.lock, exited/ATTEMPT/,
    ready/ATTEMPT/ (launch/slurm_job.py), launch.json, starting/ATTEMPT.LAUNCH/, relaunch/ (launch/slurm_startup.py),
    .secret (submitit)

Use::

    rd = RunDir(check_run_dir(path))          # ConfigError for a path that cannot be a run directory
    with rd.locked(run_id):                   # RunDirBusy (a ConfigError) if another run holds it
        rd.prepare()                          # a fresh run: the previous run's outputs go
        rd.write_config(cfg)
        ...
        rd.write_summary(summary, also=cfg.summary_path)

A resumed run (a requeued attempt, Slurm's ``RESUME=1``) calls ``prepare(resume=True)``: the event log goes
on, and the workers start from ``checkpoint/LATEST``; only the previous attempt's own files go.

The lock is ``flock`` on ``run.lock``, taken before anything in the directory is touched; its file
descriptor is close-on-exec, so no child holds it, and the kernel releases it when the holder dies
(even by SIGKILL). A directory on a file system without ``flock`` is refused.
"""
from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import stat
import tempfile
import time
from contextlib import contextmanager

from .errors import ConfigError
from .events import read_events

LOCK = "run.lock"
# what a new attempt of a run removes (a resumed one too): the previous attempt's summary and per-attempt files
ATTEMPT_FILES = ("summary.json", "finisher.lock", "launch.json")
ATTEMPT_GLOBS = ("task-*.log", "health-check-node*.log")
# swap: planned-swap requests (deadpool swap); starting, relaunch: a Slurm start-up's beacons and relaunches
# (launch/slurm_startup.py)
ATTEMPT_DIRS = ("exited", "ready", "swap", "starting", "relaunch")
# what a fresh run removes besides: the run's history (slurm_job_id: the job that runs here writes its own)
FRESH_FILES = ("events.jsonl", "launcher.log", "slurm_job_id")
FRESH_DIRS = ("checkpoint",)
OUTPUTS = ATTEMPT_FILES + FRESH_FILES  # the files a fresh run removes (with the globs and directories)


class RunDirBusy(ConfigError):
    """Another live run holds the directory's lock. ``holder``: what it wrote in run.lock (may be {})."""

    def __init__(self, message: str, holder: dict):
        super().__init__(message)
        self.holder = holder


def check_run_dir(path: str, option: str = "--run-dir") -> str:
    """Check that ``path`` can be (or already is) a run directory; return it absolute. Touches nothing.

    Refused (ConfigError naming the value and what is accepted): an empty path, an existing file, a path
    under a file, a directory that cannot be written, and an existing, non-empty directory that no
    deadpool run has used (a fresh run deletes the previous run's files there, so ``--run-dir .`` in a
    project with a ``checkpoint/`` folder would lose it)."""
    if not path or not str(path).strip():
        raise ConfigError(f"{option} {path!r}: empty; accepted: a directory path (default deadpool-run)")
    full = os.path.abspath(path)
    if os.path.lexists(full) and not os.path.isdir(full):
        raise ConfigError(f"{option} {path!r}: {full} exists and is not a directory; accepted: a new or "
                          f"existing directory")
    existing = full
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{option} {path!r}: {existing} is not a directory, so {full} cannot be made")
    _check_writable(existing, f"{option} {path!r}")
    if existing == full and os.listdir(full) and not is_run_dir(full):
        raise ConfigError(f"{option} {path!r}: {full} holds other files and no deadpool run ({LOCK}, "
                          f"config.json or events.jsonl of a run); a run there would delete files; accepted: "
                          f"a new or empty directory, or one a deadpool run used")
    return full


_CONFIG_KEYS = {"layout", "train", "output"}  # sections in every RunConfig written


def is_run_dir(path: str) -> bool:
    """True if a deadpool run used ``path``: it has run.lock, an event log, or a config.json written from a
    RunConfig (every section and field known, and the layout section there: ``{"lr": 1}`` is somebody else's)."""
    if os.path.exists(os.path.join(path, LOCK)) or os.path.exists(os.path.join(path, "events.jsonl")):
        return True
    try:
        from .config import RunConfig

        with open(os.path.join(path, "config.json")) as fh:
            text = fh.read()
        RunConfig.from_json(text)
        return _CONFIG_KEYS <= set(json.loads(text))
    except (OSError, ValueError, TypeError):
        return False


def check_output_file(path: str, option: str = "--summary", run_dir: str | None = None) -> str:
    """Check that a file can be written at ``path`` (its directory exists, or is ``run_dir``, which the run
    creates, and takes new files; an existing target is not a directory and can be written; it is not the run
    directory itself nor one of the files the run keeps there); return it absolute. Leaves nothing behind.
    Raises ConfigError naming the value."""
    if not path or not str(path).strip():
        raise ConfigError(f"{option} {path!r}: empty; accepted: a file path")
    full = os.path.abspath(path)
    if run_dir is not None:
        rd = os.path.abspath(run_dir)
        if full == rd:
            raise ConfigError(f"{option} {path!r} is the run directory; accepted: a file path, e.g. "
                              f"{os.path.join(path, 'summary.json')}")
        if os.path.dirname(full) == rd and os.path.basename(full) in _RUN_FILES:
            raise ConfigError(f"{option} {path!r} would overwrite the run's own {os.path.basename(full)}; accepted: "
                              f"another name (summary.json is written there anyway)")
        if os.path.dirname(full) == rd and not os.path.exists(rd):
            return full  # the run directory does not exist yet: the run creates it
    if os.path.isdir(full):
        raise ConfigError(f"{option} {path!r}: {full} is a directory; accepted: a file path, e.g. "
                          f"{os.path.join(path, 'summary.json')}")
    parent = os.path.dirname(full)
    if not os.path.isdir(parent):
        what = "does not exist" if not os.path.lexists(parent) else "is not a directory"
        raise ConfigError(f"{option} {path!r}: its directory {parent} {what}")
    _check_writable(parent, f"{option} {path!r}")
    if os.path.exists(full):
        try:
            os.close(os.open(full, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC))
        except OSError as exc:
            raise ConfigError(f"{option} {path!r}: {full} cannot be written ({exc.strerror})") from None
    return full


_RUN_FILES = ("events.jsonl", "config.json", "launcher.log", "run.lock", "checkpoint")


def _check_writable(directory: str, what: str) -> None:
    """Create and remove a file in ``directory`` (access() lies for root and some file systems)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".deadpool-check-", dir=directory)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot create files in {directory} ({exc.strerror or exc})") from None


def write_json(path: str, obj) -> None:
    """Write ``obj`` as JSON to ``path`` crash-safely (write_atomic)."""
    write_atomic(path, (json.dumps(obj, indent=1) + "\n").encode())


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` crash-safely: a temp file in the same directory, fsync, rename (a reader sees
    the old file or the new one, never a part). A path that exists and is not a regular file (``/dev/stdout``,
    a FIFO) is written in place. Raises OSError (ENOSPC, EDQUOT, EROFS, EIO, ...) if it cannot be written; the
    old file, if any, is then left as it was and the temp file is removed."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        with open(path, "wb") as fh:
            fh.write(data)
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        try:
            os.unlink(tmp)   # a write that failed (a full disk: ENOSPC at flush or fsync) leaves no part behind
        except OSError:
            pass


class RunDir:
    """One run directory (an absolute path; see the module docstring for its layout)."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self._lock_fd: int | None = None

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def events(self) -> str:
        return self.file("events.jsonl")

    @property
    def config(self) -> str:
        return self.file("config.json")

    @property
    def launcher_log(self) -> str:
        return self.file("launcher.log")

    @property
    def summary(self) -> str:
        return self.file("summary.json")

    @property
    def checkpoint(self) -> str:
        return self.file("checkpoint")

    # ---- the lock ------------------------------------------------------------------------------------------
    def acquire(self, run_id: str = "") -> None:
        """Create the directory if needed and lock it for this process (non-blocking). Raises RunDirBusy
        naming the directory and the holder (pid, host) if another run holds it, ConfigError if the
        directory cannot be created or locked. Nothing else in the directory is touched."""
        try:
            os.makedirs(self.path, exist_ok=True)
            fd = os.open(self.file(LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise ConfigError(f"--run-dir {self.path}: cannot create {LOCK} there ({exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            who = "another process"
            if holder.get("pid"):
                who = f"pid {holder['pid']} on {holder.get('host')}" + (f", since {holder['since']}"
                                                                       if holder.get("since") else "")
            raise RunDirBusy(f"--run-dir {self.path} is in use by another run ({who}); accepted: a directory no "
                             f"other run is using (wait for that run to end, stop it, or pick another --run-dir)",
                             holder) from None
        except OSError as exc:
            os.close(fd)
            raise ConfigError(f"--run-dir {self.path}: cannot lock {LOCK} ({exc.strerror or exc}); accepted: a "
                              f"directory on a file system with flock (a local disk)") from None
        from .process.fence import identity

        me = identity()
        info = {"pid": me["pid"], "start": me["start"], "host": me["host"], "run_id": run_id,
                "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._lock_fd = fd

    def release(self) -> None:
        """Release the lock (closing the descriptor releases it; run.lock stays, it is harmless)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    @contextmanager
    def locked(self, run_id: str = ""):
        """``acquire`` for the duration of a ``with`` block."""
        self.acquire(run_id)
        try:
            yield self
        finally:
            self.release()

    # ---- fresh run, outputs -----------------------------------------------------------------------------------
    def prepare(self, resume: bool = False) -> dict | None:
        """prepare_run_dir, while this process holds the lock."""
        assert self._lock_fd is not None, "RunDir.prepare() without the lock"
        return prepare_run_dir(self.path, resume=resume)

    def write_config(self, cfg) -> str:
        """Write ``cfg`` (a RunConfig) to config.json atomically. Returns the path."""
        return write_config(self.path, cfg)

    def write_summary(self, summary: dict, also: str | None = None) -> None:
        """Write ``summary`` to summary.json and, if given, to ``also`` (the user's --summary), each atomically.
        Both are tried; raises the first OSError if either could not be written (the launcher then prints it)."""
        errors = []
        for path in (self.summary, also) if also else (self.summary,):
            try:
                write_json(path, summary)
            except OSError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


def prepare_run_dir(path: str, resume: bool = False, keep_events: bool = False) -> dict | None:
    """Make ``path`` ready for a new attempt of a run; the same on every launch path. Only by the lock's holder
    (this process: ``RunDir.prepare``; or the batch shell that runs it: launch/templates/train.sbatch holds
    run.lock).

    ``resume`` and a checkpoint there (checkpoint/LATEST): the event log and the checkpoint stay (the workers
    resume from it); returns LATEST (a dict). Otherwise a fresh run: the previous run's event log, launcher
    log, Slurm job id and checkpoints go too (a new run starts at step 0); returns None. Either way the
    previous attempt's summary.json, finisher.lock, task-N.log and exited/ and ready/ markers go. config.json,
    run.lock and the job's own files (job.sbatch, .secret) stay. ``keep_events``: the event log stays even when the
    run starts again at step 0 (a requeued attempt of a Slurm job whose earlier attempts made no checkpoint: its
    earlier requeues must still count, launch/slurm.py ``prepare``)."""
    latest = latest_checkpoint(path) if resume else None
    fresh = tuple(f for f in FRESH_FILES if not (keep_events and f == "events.jsonl"))
    files = ATTEMPT_FILES + (() if latest is not None else fresh)
    dirs = ATTEMPT_DIRS + (() if latest is not None else FRESH_DIRS)
    for name in files + tuple(os.path.basename(p) for g in ATTEMPT_GLOBS for p in glob.glob(os.path.join(path, g))):
        try:
            os.remove(os.path.join(path, name))
        except FileNotFoundError:
            pass
    for name in dirs:
        shutil.rmtree(os.path.join(path, name), ignore_errors=True)
    return latest


def latest_checkpoint(path: str) -> dict | None:
    """The newest complete checkpoint of run directory ``path``: its checkpoint/LATEST ({step, world_size, generation,
    high_water}, written by replica/persist.py's ``commit``), or None. The one reader of LATEST; imports no torch."""
    try:
        with open(os.path.join(path, "checkpoint", "LATEST")) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def discard_uncommitted(path: str) -> list[str]:
    """Remove ``checkpoint/step{T}`` directories of run directory ``path`` that LATEST does not name: the rounds of
    background persistence a run's end cut short, or that failed (a full disk). Only once no process of the run is
    left (the local launcher, after the run). Returns what was removed; never raises."""
    root = os.path.join(path, "checkpoint")
    keep = (latest_checkpoint(path) or {}).get("step")
    try:
        names = os.listdir(root)
    except OSError:
        return []
    gone = [n for n in names if n.startswith("step") and n[4:].isdigit() and int(n[4:]) != keep]
    for name in gone:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return gone


def write_config(path: str, cfg) -> str:
    """Write ``cfg`` (a RunConfig, or the text of one) to ``path``/config.json atomically (write_atomic).
    Returns the file's path."""
    out = os.path.join(path, "config.json")
    write_atomic(out, (cfg if isinstance(cfg, str) else cfg.to_json()).encode())
    return out


def emit_requeued(log, attempt: int | None = None, **fields) -> dict:
    """Log ``requeued`` to ``log`` (an events.EventLog): the run goes on from its checkpoint in a new attempt.
    ``attempt``: this requeue's number (1 for the first); None: one more than the ``requeued`` events already in
    the log. ``fields``: what the launch path knows (checkpoint, slurm_job_id, reason, ...). Returns the event."""
    if attempt is None:
        attempt = 1 + sum(1 for e in read_events(log.path) if e["event"] == "requeued") \
            if os.path.exists(log.path) else 1
    return log.emit("requeued", attempt=attempt, **fields)


def check_free(path: str) -> None:
    """Raise RunDirBusy (exit 2 in the CLI) if a run holds ``path``'s lock now; take and release it otherwise.
    Used where a run is prepared in one process and runs in others (``deadpool submit``, submitit's HotSwapJob),
    before the preparation touches the directory; the run itself then holds the lock (launch/templates/train.sbatch,
    HotSwapJob's task 0)."""
    rd = RunDir(path)
    rd.acquire("check")
    rd.release()


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
