import os
import time
import uuid

from deadpool_hpc.events import EventLog, EventSpill, EventTail, read_events


def test_tail_returns_only_new_complete_lines(tmp_path):
    path = str(tmp_path / "events.jsonl")
    tail = EventTail(path)
    assert tail.poll() == []
    log = EventLog(path, mpi_rank=1)
    log.emit("a", x=1)
    assert [e["event"] for e in tail.poll()] == ["a"]
    with open(path, "a") as fh:
        fh.write('{"t": 1, "event": "b"}\n{"t": 2, "ev')  # a writer killed mid-line
    assert [e["event"] for e in tail.poll()] == ["b"]
    with open(path, "a") as fh:
        fh.write('ent": "c"}\n')
    assert [e["event"] for e in tail.poll()] == ["c"]
    assert [e["event"] for e in read_events(path)] == ["a", "b", "c"]
    assert all("pid" in e for e in read_events(path) if e["event"] == "a")


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
