"""A training module whose import fails on one node (issue 28): the node named by ``DEADPOOL_TEST_BROKEN_NODE``
raises ImportError while its training process imports this module, as a node with a broken driver or a missing
library would. Elsewhere (the launcher's own check included) it is the demo."""
import os

if os.environ.get("DEADPOOL_NODE") is not None and \
        os.environ.get("DEADPOOL_NODE") == os.environ.get("DEADPOOL_TEST_BROKEN_NODE"):
    raise ImportError(f"node {os.environ['DEADPOOL_NODE']}: a library this module needs does not load here (test)")

from deadpool_hpc.train.demo import train  # noqa: E402,F401 - the arithmetic is the demo's
