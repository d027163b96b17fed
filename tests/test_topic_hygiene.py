"""The suite's own cleanup (tests/topic_hygiene.py): a session deletes the test topics it made and no other
session's, so the local broker does not accumulate partitions run after run."""

from __future__ import annotations

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
