"""What a completion's patch may touch when tests decide its reward, and how a patch is found in a completion.

The reward paths (the ``swe`` verifier, ``TestsPassRatio``) apply the completion's patch, then the task's test patch,
then run the task's tests: a patch that edits the tests, or what configures or extends the test runner
(``conftest.py``, ``sitecustomize.py``, ``.pth`` files, pytest/tox/setup configuration), could decide its own
reward, so it scores 0 unrun.
"""

from __future__ import annotations

import re

PROTECTED = re.compile(r"(^|/)(conftest\.py|sitecustomize\.py|usercustomize\.py|pytest\.ini|tox\.ini|setup\.cfg|"
                       r"pyproject\.toml|noxfile\.py|[^/]*\.pth|test_[^/]*\.py|[^/]*_test\.py)$|"
                       r"(^|/)(tests?|testing)/|^\.kiln-task/")
# git apply drops the first component of a header's path (-p1), whatever it is; quotes may wrap it.
_DIFF_PATHS = re.compile(r'^(?:diff --git "?[^/\s]+/(\S+?)"? "?[^/\s]+/(\S+?)"?|--- "?[^/\s]+/(\S+?)"?|'
                         r'\+\+\+ "?[^/\s]+/(\S+?)"?|(?:rename|copy) (?:from|to) "?(\S+?)"?)(?:\t.*)?$', re.MULTILINE)
# The same files for ``git apply --exclude`` (fnmatch, ``*`` crosses ``/``): whatever a header parser misses, git
# itself never writes them.
APPLY_EXCLUDES = " ".join(f"--exclude='{g}'" for g in (
    "*conftest.py", "*sitecustomize.py", "*usercustomize.py", "*.pth", "*pytest.ini", "*tox.ini", "*setup.cfg",
    "*pyproject.toml", "*noxfile.py", "*test_*.py", "*_test.py", "tests/*", "*/tests/*", "test/*", "*/test/*",
    "testing/*", "*/testing/*", ".kiln-task/*"))


def patched_paths(diff: str) -> set[str]:
    """Every path a unified or git diff names (old and new names, renames and copies)."""
    return {path for match in _DIFF_PATHS.finditer(diff) for path in match.groups() if path}


_FOUND = re.compile(r"<patch>\n?(.*?)</patch>|```(?:diff|patch)\n(.*?)```", re.DOTALL)


def patch_text(completion: str, *, whole: bool) -> str | None:
    """The patch in ``<patch>…</patch>`` or a ```diff fence; else the whole text when ``whole``, else None."""
    found = _FOUND.search(completion)
    if found is None:
        return completion if whole else None
    return next(g for g in found.groups() if g is not None)


def protected_paths(patch: str, test_patch: str = "") -> list[str]:
    """The paths of ``patch`` it may not touch: tests, test configuration, and whatever ``test_patch`` touches."""
    theirs = patched_paths(test_patch)
    return sorted(p for p in patched_paths(patch) if PROTECTED.search(p) or p in theirs)
