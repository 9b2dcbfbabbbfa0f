"""Issue 42: a run directory that fails writes (full, read-only) never stops training.

End to end on a real tmpfs of 6 MB (a checkpoint of the demo's 3 ranks is about 11 MB: no persist round fits),
mounted by the test (root only; skipped where mount is not permitted), with real MPI processes:

- full with ``--persist-every 1``: the run completes bitwise equal to its failure-free run, every failed round is a
  ``persist_failed`` event with its reason, and ``deadpool run`` prints the summary it could not write (exit 3);
- turned read-only mid-run (an ext4 error with errors=remount-ro, on a loop device): the same, with EROFS;
- a no-spare checkpoint on a full disk: the run ends, with that reason named (``checkpoint_failed`` and the error).

The event log's rules on /dev/full (every write fails with ENOSPC: counted, spilled, never raised) are
tests/unit/test_events.py's.
"""
import json
import os
import subprocess
import sys
import time

import pytest

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


def _ballast(mnt, leave: int) -> None:
    """Fill the 6 MB tmpfs ``mnt`` with a file of someone else's until ``leave`` bytes are left."""
    with open(mnt / "ballast", "wb") as fh:
        fh.write(b"\0" * ((6 << 20) - leave))


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
