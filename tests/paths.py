"""The checkout's folders, the same for every test wherever it lies under tests/ (unit/<room>/, e2e/, project/):
``import paths`` (tests/ is on sys.path: conftest.py lies there)."""
import os

TESTS = os.path.dirname(os.path.abspath(__file__))   # tests/
ROOT = os.path.dirname(TESTS)                        # the checkout
