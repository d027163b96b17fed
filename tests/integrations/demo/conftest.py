"""The demo's learning run needs torch (the ``rl`` extra); without it its test is not collected."""

from tests.collection import unless_importable

collect_ignore_glob = unless_importable(__file__, "torch", "test_*.py", "needs the rl extra: torch")
