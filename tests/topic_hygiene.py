"""Test topics do not outlive their session: the local broker loads every partition's log before it opens its port,
so topics left run after run (on CI's persistent cache: thousands) once made it miss its start deadline.

A session deletes the test topics it made when it ends: their names carry its tag (the first four hex digits of the
``unique`` fixture), so a session never deletes another's. Topics left by a session that died are deleted by the next
one that starts while no other session is alive (a live one may still be using its topics); sessions mark
themselves alive with a file named by their pid in a temp directory named by the broker's address."""

from __future__ import annotations

import os
import re
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kiln.streams import admin
from kiln.streams.settings import KilnSettings

# The names only tests and kiln's local learning runs make: t<10 hex>. / s<10 hex>. prefixes (tests), rl<8 hex>.
# (LearningRun: its process's pid in the first six), and the raw test topics of the `topics` fixture and tests/infra.
TEST_TOPIC = re.compile(r"^(?:[ts](?P<prefixed>[0-9a-f]{10})\.|rl(?P<run_pid>[0-9a-f]{6})[0-9a-f]{2}\."
                        r"|(?:t-share|t-commit|req|res)-(?P<raw>[0-9a-f]{10})(?:\.|$))")
SESSION_TAG = os.urandom(2).hex()


def unique_name() -> str:
    """A short unique suffix for topic, group and bucket names that carries this session's tag."""
    return SESSION_TAG + uuid.uuid4().hex[:6]


def _made_by_this_session(name: str) -> bool:
    """A LearningRun's rl<hex>. topics are never this session's: the run deletes them itself."""
    m = TEST_TOPIC.match(name)
    return m is not None and (m["prefixed"] or m["raw"] or "").startswith(SESSION_TAG)


def _topic_names(settings: KilnSettings) -> set[str]:
    return set(admin.admin_client(settings).list_topics(timeout=60).topics)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def leftover(name: str) -> bool:
    """A test topic no live process uses: a learning run's (bench, demo, `kiln rl learn`, outside any session)
    only once the process that runs it is gone."""
    m = TEST_TOPIC.match(name)
    return m is not None and not (m["run_pid"] and _pid_alive(int(m["run_pid"], 16)))


def _live_sessions(markers: Path) -> list[Path]:
    live = []
    for marker in markers.glob("*.pid"):
        try:
            os.kill(int(marker.stem), 0)
            live.append(marker)
        except (ValueError, ProcessLookupError):
            marker.unlink(missing_ok=True)
        except PermissionError:  # alive, another user's
            live.append(marker)
    return live


def _delete(settings: KilnSettings, names: set[str]) -> None:
    doomed = sorted(names)
    for start in range(0, len(doomed), 500):  # one request per batch keeps each within the admin timeout
        for problem in admin.delete_topics(settings, doomed[start:start + 500], timeout=120):
            print(f"could not delete a test topic: {problem}")  # cleanup only: a leftover harms nothing at once


@contextmanager
def session_topics(settings: KilnSettings) -> Iterator[None]:
    broker = re.sub(r"[^0-9A-Za-z.]+", "_", settings.bootstrap_servers)
    markers = Path(tempfile.gettempdir()) / f"kiln-test-sessions-{broker}"
    markers.mkdir(parents=True, exist_ok=True)
    if not _live_sessions(markers):
        _delete(settings, {n for n in _topic_names(settings) if leftover(n)})
    mine = markers / f"{os.getpid()}.pid"
    mine.touch()
    try:
        yield
    finally:
        mine.unlink(missing_ok=True)
        _delete(settings, {n for n in _topic_names(settings) if _made_by_this_session(n)})
