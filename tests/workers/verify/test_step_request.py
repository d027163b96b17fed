"""A training step's groups in one verify request (``VerifyRequest.groups``): a request carries either one task and its
completions or groups, never both nor neither, at most ``MAX_COMPLETIONS`` completions in all; the stage judges each
group as a request of its own would be (its own verifier and version, a failing group failing alone) and answers
one result whose ``groups`` say whose verdicts are where. In process, through the stage's own ``verified`` (what a
worker answers and ``kiln verify rescore`` re-computes); end to end: tests/workers/verify/test_batching.py,
test_verify_stage.py, test_rescore.py."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kiln.schemas.rl import RolloutTask
from kiln.schemas.verify import MAX_COMPLETIONS, VerifyGroup, VerifyRequest, VerifyResult
from kiln.streams.client import KilnClient
from kiln.streams.settings import KilnSettings
from kiln.workers.verifiers import VerifierContext, Verifiers
from kiln.workers.verify.stage import verified


def add(answer: str, verifier: str = "exact_match") -> RolloutTask:
    return RolloutTask(task_id=f"add-{answer}-{verifier}", prompt="?", answer=answer, verifier=verifier)


def test_a_request_is_one_task_or_groups() -> None:
    one = VerifyRequest(task=add("7"), completions=["7", "8"])
    assert [(g.task.task_id, g.completions) for g in one.each()] == [("add-7-exact_match", ["7", "8"])]
    step = VerifyRequest(groups=[VerifyGroup(task=add("7"), completions=["7"]),
                                 VerifyGroup(task=add("5"), completions=["5", "6"])])
    assert [g.completions for g in step.each()] == [["7"], ["5", "6"]]
    assert VerifyRequest.model_validate_json(step.model_dump_json(), strict=True) == step
    for wrong in ({}, {"task": add("7")}, {"completions": ["7"]},
                  {"task": add("7"), "completions": ["7"], "groups": [{"task": add("7"), "completions": ["7"]}]},
                  {"groups": []}, {"groups": [{"task": add("7"), "completions": []}]},
                  {"groups": [{"task": add(str(n)), "completions": ["1"] * 1025} for n in range(4)]}):
        with pytest.raises(ValidationError):
            VerifyRequest.model_validate(wrong)
    # The same bound as a request of one task: MAX_COMPLETIONS in all.
    VerifyRequest(groups=[VerifyGroup(task=add(str(n)), completions=["1"] * (MAX_COMPLETIONS // 4)) for n in range(4)])


async def test_a_steps_groups_are_judged_each_as_its_own_request() -> None:
    verifiers = Verifiers(VerifierContext(KilnClient(KilnSettings(), "unused"), failures_as_verdicts=True))
    step = VerifyRequest(groups=[VerifyGroup(task=add("7"), completions=["7", "8", " 7\n"]),
                                 VerifyGroup(task=add("5", verifier="nope"), completions=["5"]),
                                 VerifyGroup(task=add("5"), completions=["5", "x"])])
    result = await verified(verifiers, step, "step-1")
    assert (result.task_id, result.verifier) == ("", "exact_match+nope")
    assert [(g.task_id, g.verifier, g.count) for g in result.groups or []] == [
        ("add-7-exact_match", "exact_match", 3), ("add-5-nope", "nope", 1), ("add-5-exact_match", "exact_match", 2)]
    by_group = result.by_group()
    assert [[(v.reward, v.failure) for v in verdicts] for verdicts in by_group] == [
        [(1.0, None), (0.0, None), (1.0, None)], [(0.0, "invalid_task")], [(1.0, None), (0.0, None)]]
    assert "no verifier 'nope'" in by_group[1][0].reason
    # Each group's verdicts are those of the same group sent alone: the verifier, its version, the reward.
    for group, verdicts in zip(step.each(), by_group, strict=True):
        alone = await verified(verifiers, VerifyRequest(task=group.task, completions=group.completions), "alone")
        assert alone.groups is None and alone.by_group() == [alone.verdicts]
        assert [(v.reward, v.failure, v.verifier, v.version) for v in alone.verdicts] == [
            (v.reward, v.failure, v.verifier, v.version) for v in verdicts]
    assert VerifyResult.model_validate_json(result.model_dump_json()) == result
