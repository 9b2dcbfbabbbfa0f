"""Detector plugins for tests/e2e/test_planned_swap.py, registered through a dist-info the test writes on PYTHONPATH."""


def raises_at_start(node):
    raise RuntimeError(f"cannot reach the health service from {node.name} (test fixture)")


class _Flaky:
    interval_s = 0.2

    def check(self):
        raise OSError("health service timed out (test fixture)")


def flaky(node):
    """A detector whose every check raises: logged once (detector_error), the run goes on."""
    return _Flaky()
