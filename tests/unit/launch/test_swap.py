"""launch/swap.py: ``deadpool swap``'s view of a run's layout, from its events (pure). Its real runs are
tests/e2e/test_planned_swap.py's."""


def test_the_current_layout_is_read_from_the_current_attempts_decisions():
    """deadpool swap's view (pure): node1 replaced by spare 3, then a requeue starts the layout afresh."""
    from deadpool_hpc.launch.swap import _view

    ev = [{"event": "decision", "failed_nodes": [1], "replaced": {"1": 3}},
          {"event": "node_failed", "node": 1}]
    assert _view(ev, 5, 3) == ({1}, [4])   # node 3 now active, node 4 the spare left
    assert _view(ev + [{"event": "requeued"}], 5, 3) == (set(), [3, 4])
