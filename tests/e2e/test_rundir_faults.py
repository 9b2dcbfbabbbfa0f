"""Issue 42: a run directory that fails writes (full, read-only) never stops training.

End to end on a real tmpfs of 6 MB (a checkpoint of the demo's 3 ranks is about 11 MB: no persist round fits),
mounted by the test (root only; skipped where mount is not permitted), with real MPI processes:

- full with ``--persist-every 1``: the run completes bitwise equal to its failure-free run, every failed round is a
  ``persist_failed`` event with its reason, and ``deadpool run`` prints the summary it could not write (exit 3);
- turned read-only mid-run (an ext4 error with errors=remount-ro, on a loop device): the same, with EROFS;
- a no-spare checkpoint on a full disk: the run ends, with that reason named (``checkpoint_failed`` and the error).

And the event log's rules on /dev/full (every write fails with ENOSPC): counted, spilled, never raised.
"""
import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from deadpool_hpc.events import EventLog, EventSpill
from deadpool_hpc.process.fence import is_alive

from runs import SMALL_RUN_STEPS as STEPS, run_driven, run_events, run_faults  # tests/runs.py

# the default heartbeat deadline: the first persist round's import of torch.distributed.checkpoint in each agent
# (seconds on 2 busy cores) once made heartbeats late enough to fence a live node; with suspicions confirmed by
# probes (control/suspicion.py) these runs keep every node
PACE_S = "1.2"   # trainfns:paced: 24 steps last >= 29 s: several persist rounds (one a second) start and end, the
#                 first one's import of torch.distributed.checkpoint (seconds on 2 busy cores) included


@pytest.fixture(autouse=True)
def paced(monkeypatch):
    monkeypatch.setenv("DEADPOOL_TEST_STEP_S", PACE_S)


@pytest.fixture
def tmpfs(tmp_path):
    """A 6 MB tmpfs at tmp_path/mnt, unmounted (lazily, if busy) at the end; skips where mount is refused."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({p.stderr.strip() or p.returncode}): needs root")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.fixture
def ext4(tmp_path):
    """A 64 MB ext4 file system (a loop device: room for two persist rounds of 3 x 3.6 MB and the one being cleaned
    up, so the only failure is the one the test makes) mounted with ``errors=remount-ro`` at tmp_path/ext4; yields (mount
    point, ``make_read_only()``). ``make_read_only`` does what the kernel does on a file-system error: the file system
    turns read-only at once, under open files too (``mount -o remount,ro`` refuses while a run holds files open for
    writing: EBUSY). Unmounted at the end; skips where loop mounts or ext4's trigger_fs_error are not available."""
    img, mnt = tmp_path / "ext4.img", tmp_path / "ext4"
    mnt.mkdir()
    with open(img, "wb") as fh:
        fh.truncate(64 << 20)
    p = subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], capture_output=True, text=True)
    if p.returncode == 0:
        p = subprocess.run(["mount", "-o", "loop,errors=remount-ro", str(img), str(mnt)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot make and loop-mount an ext4 file system here ({p.stderr.strip()}): needs root")
    dev = subprocess.run(["findmnt", "-no", "SOURCE", str(mnt)], capture_output=True, text=True).stdout.strip()
    trigger = f"/sys/fs/ext4/{os.path.basename(dev)}/trigger_fs_error"

    def make_read_only() -> None:
        with open(trigger, "w") as fh:
            fh.write("1")

    try:
        if not os.path.exists(trigger):
            pytest.skip(f"{trigger} does not exist (a kernel without ext4's trigger_fs_error)")
        yield mnt, make_read_only
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.fixture(scope="module")
def base_digest(failure_free):
    return failure_free(nodes=3, steps=STEPS)["param_digest"]   # tests/conftest.py: shared with test_never_hang


def test_event_log_write_failures_are_counted_spilled_and_never_raised():
    spill = EventSpill(f"deadpool-test-{uuid.uuid4().hex}")
    try:
        for background in (False, True):
            log = EventLog("/dev/full", background=background, spill=spill.name, node=1)
            for i in range(5):
                log.emit("step", step=i)
            assert log.flush(5.0)
            # (a background log also queues its report line, which fails and counts too)
            assert log.failed >= 5 and log.last_error.startswith("ENOSPC"), log.counts()
            got = _received(spill, lambda got: sum(e["event"] == "step" for e in got) >= 5)
            assert [e["step"] for e in got if e["event"] == "step"] == list(range(5)), got
            assert {e["error"] for e in got if e["event"] == "event_log_failed"} == {log.last_error}
            log.close()
            final = [e for e in _received(spill, lambda got: any(e.get("final") for e in got))
                     if e["event"] == "event_log_failed"]
            assert final and final[-1]["final"] and final[-1]["failed"] >= 5
    finally:
        spill.close()
    # nothing to spill to (a Slurm job's process): still counted, still no exception
    log = EventLog("/dev/full", spill="")
    log.emit("x")
    assert log.failed == 1 and log.spilled == 0


def _ballast(mnt, leave: int) -> None:
    """Fill the 6 MB tmpfs ``mnt`` with a file of someone else's until ``leave`` bytes are left."""
    with open(mnt / "ballast", "wb") as fh:
        fh.write(b"\0" * ((6 << 20) - leave))


def _received(spill, enough, wait_s: float = 3.0) -> list[dict]:
    """What ``spill`` received (its thread takes each datagram as it comes), once ``enough(records)`` or after
    ``wait_s``."""
    got, end = [], time.monotonic() + wait_s
    while time.monotonic() < end:
        got += spill.poll()
        if enough(got):
            break
        time.sleep(0.02)
    return got


def _cli_run(run_dir, *args, timeout=300):
    """``deadpool run`` as a user runs it; returns (exit status, stdout, the summary it printed or wrote)."""
    p = subprocess.run([sys.executable, "-m", "deadpool_hpc.launch.cli", "run", "--run-dir", str(run_dir), *args],
                       capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, COLUMNS="200", OMP_NUM_THREADS="1", DEADPOOL_TEST_STEP_S=PACE_S))
    out = p.stdout
    if "--- deadpool summary" in out:
        body = out.split("--- deadpool summary", 1)[1].split("\n", 1)[1].split("--- end of deadpool summary", 1)[0]
        return p.returncode, out, json.loads(body)
    with open(os.path.join(str(run_dir), "summary.json")) as fh:
        return p.returncode, out, json.load(fh)


@pytest.mark.e2e
def test_full_run_dir_persist_every_1_completes_bitwise(tmpfs, base_digest):
    """A 6 MB tmpfs with 2 MB left and --persist-every 1: every persist round fails (ENOSPC) as an event, LATEST is
    never written, training goes on to the end, bitwise the failure-free run; the summary is written or printed in full
    with exit status 3; no process is left behind."""
    _ballast(tmpfs, leave=2 << 20)   # a full project space: 2 MB left, less than one rank's shard (3.6 MB)
    os.makedirs(tmpfs / "run")
    rc, out, s = _cli_run(tmpfs / "run", "--nodes", "3", "--spares", "1", "--steps", str(STEPS), "--persist-every",
                          "1", "--train-fn", "trainfns:paced")
    assert s["completed"] and s["steps_completed"] == STEPS, (rc, out[-3000:])
    assert s["param_digest"] == base_digest, "a run whose persist rounds failed diverged from the failure-free run"
    assert s["failures"] == [], "a live node was lost to a slow persist round: " + repr(s["failures"])
    seen = [e["event"] for e in run_events(tmpfs / "run") if "persist" in e["event"]]
    assert s["persist"]["failed"] >= 1 and s["persist"]["committed"] == [], (s["persist"], seen)
    assert all(r.startswith("ENOSPC") for r in s["persist"]["reasons"]), s["persist"]
    assert not os.path.exists(tmpfs / "run" / "checkpoint" / "LATEST")   # nothing half-written is named
    assert rc == (0 if s["summary_written"] else 3), (rc, s.get("summary_error"))
    for e in run_events(tmpfs / "run"):
        if e["event"] == "hello":
            assert not is_alive(e), f"pid {e['pid']} ({e.get('role')}) outlived the run"


@pytest.mark.e2e
def test_run_dir_turns_read_only_mid_run(ext4, base_digest):
    """The run directory's file system turns read-only at step 6 (an ext4 error with errors=remount-ro): every write
    fails with EROFS from then on (events, persist rounds, launcher.log, the summary); the run still completes,
    bitwise, and says what failed: the event log's failures counted, the summary not written and why."""
    mnt, make_read_only = ext4

    def drive(run_dir, th):
        steps, end = [], time.monotonic() + 240
        while th.is_alive() and time.monotonic() < end:
            steps = [e for e in run_events(run_dir) if e["event"] == "step"] \
                if os.path.exists(run_dir / "events.jsonl") else []
            if steps and steps[-1]["step"] >= 6:
                break
            time.sleep(0.2)
        make_read_only()
        return steps[-1]["step"] if steps else None

    s, at = run_driven(mnt, "run", drive, spares=1, persist_every=1, train_fn="trainfns:paced")
    assert at is not None and at < STEPS, at
    assert s["completed"] and s["steps_completed"] == STEPS, s["errors"]
    assert s["param_digest"] == base_digest
    assert s["failures"] == [], "a live node was lost to a slow persist round: " + repr(s["failures"])
    assert s["summary_written"] is False and "EROFS" in s["summary_error"], s.get("summary_error")
    assert s["event_log"]["failed"] >= 1 and any("EROFS" in e for e in s["event_log"]["errors"]), s["event_log"]
    # a write in flight when ext4 records its error fails with EIO before the remount makes the rest EROFS (seen in
    # CI: reasons ['EIO: Input/output error', 'EROFS: Read-only file system']); both name the file system's fault
    assert s["persist"]["failed"] >= 1 and any(r.startswith("EROFS") for r in s["persist"]["reasons"]) \
        and all(r.startswith(("EROFS", "EIO")) for r in s["persist"]["reasons"]), s["persist"]
    assert s["launcher_log"]["dropped_bytes"] > 0 or s["launcher_log"]["error"] is None, s["launcher_log"]


@pytest.mark.e2e
def test_no_spare_checkpoint_on_a_full_disk_ends_the_run_with_the_reason(tmpfs):
    """No spare left (node1 killed at step 10, --requeue): the checkpoint the run needs cannot be written (the
    tmpfs is filled up to 256 KB beforehand), so the run ends there, naming it: a checkpoint_failed event with
    ENOSPC, CheckpointFailed in the summary's errors, no requeue, no LATEST."""
    _ballast(tmpfs, leave=256 << 10)
    os.makedirs(tmpfs / "run")   # the ballast is not the run's: it lives beside it
    s = run_faults(tmpfs, "run", "kill node1@10", nodes=3, spares=0, requeue=True, persist_every=0)
    assert not s["completed"]
    assert s["requeues"] == 0, s
    failed = s["checkpoint_failed"]
    assert failed and all(f["reason"].startswith("ENOSPC") for f in failed), failed
    assert any("CheckpointFailed" in e and "ENOSPC" in e for e in s["errors"]), s["errors"]
    assert not os.path.exists(tmpfs / "run" / "checkpoint" / "LATEST")


def test_slurm_summary_that_cannot_be_written_is_printed_not_raised(tmp_path, capsys):
    """The Slurm path's summary writer (batch script, headless finisher, submitit): an output that refuses the write
    (/dev/full: ENOSPC) leaves summary_written False with the reason, and the whole summary on stdout."""
    from deadpool_hpc.config import RunConfig
    from deadpool_hpc.launch.slurm_common import write_summary
    from deadpool_hpc.rundir import write_config

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_config(str(run_dir), RunConfig(nodes=2, steps=3, run_dir=str(run_dir)))
    s = write_summary(str(run_dir), out="/dev/full")
    assert s["summary_written"] is False and "/dev/full: ENOSPC" in s["summary_error"], s.get("summary_error")
    printed = capsys.readouterr().out
    body = printed.split("--- deadpool summary", 1)[1].split("\n", 1)[1].split("--- end of deadpool summary", 1)[0]
    assert json.loads(body)["summary_error"] == s["summary_error"]
    assert os.path.exists(run_dir / "summary.json")   # the one that could be written was


def test_a_failed_write_names_its_errno():
    """persist.failure_reason: an OSError anywhere in the chain (torch wraps the writer's), else the first line of the
    message (the file system's state, which the end-to-end tests check, comes between)."""
    from deadpool_hpc.replica.persist import failure_reason

    try:
        try:
            open("/dev/full", "wb", buffering=0).write(b"x")
        except OSError as inner:
            raise RuntimeError("the writer failed") from inner
    except RuntimeError as exc:
        assert failure_reason(exc).startswith("ENOSPC"), failure_reason(exc)
    assert failure_reason(RuntimeError("boom\nmore")) == "RuntimeError: boom"


def test_a_write_that_blocks_never_blocks_emit(tmp_path, monkeypatch):
    """A file system that stops answering, as a FIFO nobody reads (its 64 KB fill, then write() blocks in the kernel):
    a background log's emit returns at once, lines past the blocked write are spilled to the launcher after STUCK_S,
    a full queue drops and counts (ENOBUFS), and flush/sync give up at their timeout."""
    import deadpool_hpc.events as events

    monkeypatch.setattr(events, "QUEUE_MAX", 50)
    monkeypatch.setattr(events, "STUCK_S", 0.2)
    fifo = str(tmp_path / "events.jsonl")
    os.mkfifo(fifo)
    keep = os.open(fifo, os.O_RDWR)   # a reader that never reads: the writer's open does not wait, its writes do
    spill = EventSpill(f"deadpool-test-{uuid.uuid4().hex}")
    try:
        log = EventLog(fifo, background=True, spill=spill.name)
        t0 = time.monotonic()
        for i in range(200):
            log.emit("step", step=i, pad="x" * 1000)   # 200 KB: past the pipe's 64 KB
        assert time.monotonic() - t0 < 1.0
        time.sleep(0.5)   # the writer is stuck now
        spill.poll()      # (the launcher drains its socket every 0.25 s: a datagram queue holds about 200 KB)
        t0 = time.monotonic()
        for i in range(200, 300):
            log.emit("step", step=i)
        assert time.monotonic() - t0 < 0.5
        assert log.dropped >= 1, log.counts()
        t0 = time.monotonic()
        assert log.sync(timeout=0.5) is False
        assert time.monotonic() - t0 < 1.5
        got = {e.get("step") for e in _received(spill, lambda got: len(got) >= 100) if e["event"] == "step"}
        assert set(range(200, 300)) <= got, sorted(got)[:10]   # each line after the stall reached the launcher
    finally:
        spill.close()
        os.close(keep)
