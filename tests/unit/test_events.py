from deadpool_hpc.events import EventLog, EventTail, read_events


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
