"""A detector plugin whose module fails to import (tests/e2e/test_planned_swap.py): the run must not start."""
raise ImportError("this plugin's dependency is missing (test fixture)")
