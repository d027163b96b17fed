"""The suite's own cleanup (tests/topic_hygiene.py): a session deletes the test topics it made and no other
session's, so the local broker does not accumulate partitions run after run."""

from __future__ import annotations

import os

import pytest

from kiln.streams import admin
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import TopicSpec
from tests import topic_hygiene


def _names(kafka: KilnSettings) -> set[str]:
    return set(admin.admin_client(kafka).list_topics(timeout=30).topics)


def test_a_session_deletes_its_own_test_topics_and_no_other_sessions(kafka: KilnSettings, unique: str) -> None:
    other_tag = "0000" if topic_hygiene.SESSION_TAG != "0000" else "ffff"
    mine, others, user = f"t{unique}.echo.requests", f"t{other_tag}{unique[4:]}.echo.requests", f"user-{unique}"
    admin.create_topics(kafka, [TopicSpec(name, 1) for name in (mine, others, user)])
    try:
        # Nested inside this session (alive), so it purges nothing of others' at its start; at its end it deletes
        # the topics that carry this session's tag.
        with topic_hygiene.session_topics(kafka):
            assert {mine, others, user} <= _names(kafka)
        left = _names(kafka)
        assert mine not in left and {others, user} <= left
    finally:
        admin.delete_topics(kafka, [others, user])



def test_a_purge_spares_a_live_learning_runs_topics(kafka: KilnSettings) -> None:
    """`kiln rl learn`, the demo and bench/rl.py run outside any test session: their rl<pid><hex>. topics are purged
    only once the process that runs them is gone (a purge once deleted a live bench run's topics mid-run)."""
    pytest.importorskip("torch")  # the rl extra (KILN_RL=0 leaves it out)
    from kiln.rl.local import LearningRun, RunConfig

    run = LearningRun(kafka, RunConfig(name="hygiene"))
    prefix = run.settings.topic_prefix
    assert topic_hygiene.TEST_TOPIC.match(prefix) and int(prefix[2:8], 16) == os.getpid()
    assert not topic_hygiene.leftover(f"{prefix}rollouts")
    dead = 2**22 + 1  # above the kernel's default pid_max: no process has it
    assert topic_hygiene.leftover(f"rl{dead:06x}00.rollouts")
    assert topic_hygiene.leftover("t0123456789.echo.requests") and not topic_hygiene.leftover("user.topic")
