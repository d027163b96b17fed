"""Every trainer adapter with a real sandboxed verdict: a right answer scores 1, a wrong one 0, and a check kiln
could not make (a checker past its own time: kiln's ``timeout``, retried, still failing) is that trainer's "no
reward" — never a 0, never an exception in the trainer's step save where the trainer's own form is one. Each adapter
is driven by its trainer's own code (``kiln setup trainers``: verl's reward-function loader, AReaL's
``AsyncRewardWrapper`` and its process pool, ``verifiers``' ``Task.score``, OpenRLHF's remote-RM HTTP client; pinned
verl 0.9.1, areal 1.0.4, verifiers 0.4.0, openrlhf 0.11.2); TRL calls reward functions as
``f(completions=..., prompts=..., **columns)``. A program's own failure (past its time) is a real 0."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kiln.integrations.trainers as trainers
import kiln.integrations.trainers.verl as kiln_verl
from kiln.integrations.trainers.areal import reward_fn
from kiln.integrations.trainers.errors import NoReward
from kiln.integrations.trainers.trl import OutputMatches, Verified
from kiln.streams.settings import KilnSettings
from tests.integrations.gateway.conftest import gateway_process
from tests.integrations.trainers.conftest import trainer
from tests.workers.verify.conftest import task, timing_out

pytestmark = pytest.mark.docker
RIGHT = task().model_dump(exclude={"task_id", "prompt"})  # a dataset's label: the kiln task without its id
LATE = timing_out().model_dump(exclude={"task_id", "prompt"})
RETRIES = {"KILN_VERIFY_RETRY_ATTEMPTS": "2", "KILN_VERIFY_RETRY_BACKOFF_S": "0.05", "KILN_VERIFY_GROUP_WAIT_S": "1"}


@pytest.fixture
def kiln(stack: KilnSettings, monkeypatch: pytest.MonkeyPatch) -> Iterator[KilnSettings]:
    """The adapters' client on the stack, retrying kiln's failures twice, quickly."""
    for name, value in RETRIES.items():
        monkeypatch.setenv(name, value)
    trainers.configure(stack)
    yield stack
    trainers.configure(None)


async def _verl() -> list[Any]:
    trainer("verl.trainer.ppo.reward")
    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import get_custom_reward_fn

    def load(name: str) -> Any:  # loaded by file path, as verl's trainer does
        config = OmegaConf.create({"reward": {"custom_reward_function": {"path": kiln_verl.__file__, "name": name}}})
        return get_custom_reward_fn(config)

    compute_score, compute_score_batch = load("compute_score"), load("compute_score_batch")
    single = [await compute_score(data_source="kiln", solution_str=s, ground_truth=g, extra_info={})
              for s, g in (("7", json.dumps(RIGHT)), ("8", json.dumps(RIGHT)), ("7", json.dumps(LATE)))]
    # The batch reward manager's call (verl/workers/reward_manager/batch.py): the whole step at once.
    batch = await asyncio.to_thread(compute_score_batch, data_sources=["kiln"] * 3, solution_strs=["7", "8", "7"],
                                    ground_truths=["", "", ""], extra_infos=[{"kiln_task": t} for t in
                                                                             (RIGHT, RIGHT, LATE)])
    assert [s["kiln_failure"] for s in single + batch] == ["", "", "timeout"] * 2
    # The verifier's version, per sample (verl keeps the extra keys in reward_extra_info): one check, one version;
    # the timing-out task's check differs, so its version does.
    assert {s["kiln_verifier"] for s in single + batch} == {"exec"}
    versions = [s["kiln_version"] for s in single + batch]
    assert all(versions) and versions[0] == versions[1] == versions[3] != versions[2] == versions[5]
    return [s["score"] for s in single] + [s["score"] for s in batch]


async def _areal() -> list[Any]:
    reward_api = trainer("areal.api.reward_api")
    # AReaL's RLVRWorkflow wraps reward_fn so: a process pool (each process its own kiln client).
    wrapped: Any = reward_api.AsyncRewardWrapper(reward_fn, timeout_seconds=60, max_workers=1, max_retries=0)
    rewards = [await wrapped("3+4=", c, [1], [2], kiln_task=t) for c, t in (("7", RIGHT), ("8", RIGHT))]
    with pytest.raises(NoReward, match="timeout"):  # AReaL rejects the episode's group (areal.py)
        await wrapped("3+4=", "7", [1], [2], kiln_task=LATE)
    return rewards


async def _verifiers() -> list[Any]:
    vf = trainer("verifiers.v1")
    from kiln.integrations.trainers.prime import KilnTask, KilnTaskData

    rewards = []
    for reply, label in (("7", RIGHT), ("8", RIGHT), ("7", LATE)):
        trace = vf.Trace.model_construct(root_reply=reply, rewards={}, metrics={})
        try:
            await KilnTask(KilnTaskData(prompt="3+4=", kiln_task=label)).score(trace)
        except vf.SandboxError as e:  # verifiers' "no reward": the trace errs
            assert "timeout" in str(e)
            rewards.append(None)
            continue
        rewards.append(trace.rewards["kiln"].value)
    return rewards


async def _openrlhf(url: str) -> list[Any]:
    agent = trainer("openrlhf.utils.agent")  # OpenRLHF's own client of --remote_rm_url
    executor = agent.SingleTurnAgentExecutor(remote_rm_url=f"{url}/openrlhf/reward")
    answers = [(await executor._fetch_rewards_via_http([q], ["3+4="], [json.dumps(t)]))[0]
               for q, t in (("3+4=7", RIGHT), ("3+4=8", RIGHT), ("3+4=7", LATE))]
    assert [a["extra_logs"]["kiln_failed"] for a in answers] == [[0.0], [0.0], [1.0]]
    ids = [a["extra_logs"]["kiln_version_id"][0] for a in answers]
    assert ids[0] == ids[1] != ids[2] and all(ids)
    # The late one is alone in its group (no real verdict there): the group's constant, 0, flagged kiln_failed.
    return [a["rewards"][0] for a in answers]


class Noted(logging.Handler):
    """What ``kiln.rewards`` logs, read from kiln's logger object itself: once AReaL is imported, its ``getLogger``
    replaces the logging module's root and manager (areal/utils/logging.py:347, every call), so records of loggers
    made before it no longer reach a handler on the new root (pytest's caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def noted() -> Iterator[Noted]:
    handler, logger = Noted(), trainers.log
    level, logger.disabled = logger.level, False
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


async def test_every_adapter_gives_real_sandboxed_verdicts(kiln: KilnSettings, tmp_path: Path, noted: Noted) -> None:
    verl = await _verl()
    assert verl[:2] == verl[3:5] == [1.0, 0.0] and math.isnan(verl[2]) and math.isnan(verl[5])
    assert await _areal() == [1.0, 0.0]
    assert await _verifiers() == [1.0, 0.0, None]
    with gateway_process(kiln, tmp_path / "gateway.log", **RETRIES) as url:
        assert await _openrlhf(url) == [1.0, 0.0, 0.0]
    trl = Verified(settings=kiln)
    try:  # as GRPOTrainer calls a reward function: completions, prompts, and the dataset's columns
        rewards = await asyncio.to_thread(trl, completions=["7", "8", "7"], prompts=["3+4="] * 3,
                                          kiln_task=[RIGHT, RIGHT, LATE])
    finally:
        trl.close()
    assert rewards == [1.0, 0.0, None]
    # Bare-float trainers (TRL, AReaL, prime) get the verifier's version in their log, once per version.
    scored = [m for m in noted.messages if "rewards scored by verifier exec" in m]
    assert len(scored) == len(set(scored)) >= 2, scored
    # kiln's own TRL rewards, through the stage: a program checked on its stdin — right, wrong, and past its time,
    # which is the program's own failure: a real 0.
    programs = OutputMatches(settings=kiln, timeout_s=10, through_stage=True)  # wall time, on a loaded machine
    try:
        scores = await asyncio.to_thread(programs, ["print(int(input()) + 4)", "print(8)", "while True: pass"],
                                         stdin=["3\n"] * 3, expected_output=["7"] * 3)
    finally:
        programs.close()
    assert scores == [1.0, 0.0, 0.0]
