"""Diagnostics through logging (deadpool_hpc/logs.py): one handler per process, named, level from the env."""
import logging

from deadpool_hpc import logs


def test_one_handler_named_after_the_process(monkeypatch, capsys):
    monkeypatch.setenv(logs.ENV, "warning")
    logs.setup("agent")
    root = logs.setup("node3")  # a node agent renames itself once MPI told it its node
    assert root.handlers.count(logs._handler) == 1 and root.level == logging.WARNING
    logging.getLogger("deadpool_hpc.control.peers").info("hidden")
    logging.getLogger("deadpool_hpc.control.peers").warning("shown %d", 7)
    err = capsys.readouterr().err
    assert "hidden" not in err
    assert "[deadpool node3] WARNING deadpool_hpc.control.peers: shown 7" in err


def test_bad_level_falls_back_to_info_and_says_so(monkeypatch, capsys):
    monkeypatch.setenv(logs.ENV, "loud")
    root = logs.setup("launcher")
    assert root.level == logging.INFO
    assert "DEADPOOL_LOG_LEVEL='LOUD' is not a level" in capsys.readouterr().err
