"""A verdict's version: the same verifier source, check and images give the same version; a change to any of them
gives another; every verdict ``Verifiers`` hands out is stamped with it, and an unknown verifier's with none."""

from __future__ import annotations

import asyncio

from kiln.schemas.rl import RolloutTask
from kiln.workers.verifiers import ExactMatch, Verdict, VerifierContext, Verifiers
from kiln.workers.verifiers.version import images_of, verifier_version


class Other:
    """A verifier of another source file would differ; a class of this module stands in for one."""


def test_the_version_digests_source_check_and_images() -> None:
    task = RolloutTask(task_id="t", prompt="p", answer="7", verifier="exec",
                       check={"image": "kiln/toolchain:latest", "command": "python3 check.py"})
    v = verifier_version(ExactMatch(), task)
    assert len(v) == 16 and v == verifier_version(ExactMatch(), task.model_copy())
    assert v != verifier_version(Other(), task)  # another module's source
    assert v != verifier_version(ExactMatch(), task.model_copy(update={"check": {**task.check, "command": "x"}}))
    pinned = {**task.check, "image": "kiln/toolchain@sha256:" + "0" * 64}
    assert v != verifier_version(ExactMatch(), task.model_copy(update={"check": pinned}))
    # The order of the check's keys is not part of it (canonical JSON); the task's prompt and answer are not either.
    assert v == verifier_version(ExactMatch(), task.model_copy(update={
        "check": dict(reversed(task.check.items())), "prompt": "q", "answer": "8"}))
    assert images_of({"image": "a", "images": ["b", "a", 3]}) == ["a", "b"]


def test_verifiers_stamp_every_verdict() -> None:
    verifiers = Verifiers(VerifierContext(kiln=None))  # type: ignore[arg-type]  # exact_match needs no client
    task = RolloutTask(task_id="t", prompt="p", answer="7")
    verdicts = asyncio.run(verifiers.get("exact_match").verify(task, ["7", "8"], ""))
    stamped = verifiers.stamped(task, verdicts)
    assert [(v.reward, v.verifier, v.version) for v in stamped] == [
        (1.0, "exact_match", verifier_version(ExactMatch(), task)), (0.0, "exact_match", verifier_version(
            ExactMatch(), task))]
    unknown = task.model_copy(update={"verifier": "nope"})
    assert [(v.verifier, v.version) for v in verifiers.stamped(unknown, [Verdict(reward=0.0)])] == [("nope", "")]
