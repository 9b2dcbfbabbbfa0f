"""The fast tier's guard (tests/fasttier.py, run by conftest.py for every test): a test without the ``e2e`` marker
cannot start a process by any of the usual ways, the refusal names the test and what it tried, and it is recorded
for the test even when the test catches it; a test with the marker starts processes as usual."""
import multiprocessing
import os
import re
import subprocess
import sys

import pytest

import fasttier  # tests/fasttier.py


def _fork_and_exit():
    if os.fork() == 0:   # only if the guard failed: the child leaves at once, whatever happens in the parent
        os._exit(0)


def test_an_unmarked_test_cannot_start_a_process(request):
    ways = {
        "subprocess.run": lambda: subprocess.run(["true"]),
        "os.fork": _fork_and_exit,
        "multiprocessing fork": lambda: multiprocessing.get_context("fork").Process(target=os._exit, args=(0,)).start(),
        "multiprocessing spawn": lambda: multiprocessing.get_context("spawn").Process(target=os._exit, args=(0,)).start(),
        "os.system": lambda: os.system("true"),
        "os.posix_spawn": lambda: os.posix_spawn("/bin/true", ["true"], dict(os.environ)),
    }
    for how, start in ways.items():
        with pytest.raises(fasttier.StartsAProcess, match=re.escape(request.node.nodeid) + " starts a process"):
            start()
    refused = request.node.stash[fasttier.REFUSED]
    assert len(refused) == len(ways), refused
    assert "Popen._execute_child: ['true']" in refused[0], refused[0]
    assert fasttier.refusal(request.node) == refused[0]
    refused.clear()   # caught on purpose here: conftest's pytest_runtest_call would fail this test otherwise


@pytest.mark.e2e
def test_a_marked_test_starts_processes_as_usual():
    assert subprocess.run([sys.executable, "-c", "import sys; sys.exit(7)"]).returncode == 7
