"""Every trainer adapter with a real sandboxed verdict: a right answer scores 1, a wrong one 0, a checker past its
time is a ``timeout`` failure that scores 0 — never an exception in the trainer's step. Each adapter is driven by its
trainer's own code where that package is installed in this environment (verl's reward-function loader, AReaL's
``AsyncRewardWrapper`` and its process pool, ``verifiers``' ``Task.score``, OpenRLHF's remote-RM HTTP client), else
through the call shapes those packages use (read from their code: verl 0.9.1, areal 1.0.4, verifiers 0.4.0,
openrlhf 0.11.2); TRL calls reward functions as ``f(completions=..., prompts=..., **columns)``."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest

import kiln.integrations.trainers as trainers
import kiln.integrations.trainers.verl as kiln_verl
from kiln.integrations.trainers.areal import async_reward_fn, reward_fn
from kiln.integrations.trainers.trl import OutputMatches, Verified
from kiln.streams.settings import KilnSettings
from tests.integrations.gateway.conftest import gateway_process
from tests.workers.verify.conftest import task, timing_out

pytestmark = pytest.mark.docker
RIGHT = task().model_dump(exclude={"task_id", "prompt"})  # a dataset's label: the kiln task without its id
LATE = timing_out().model_dump(exclude={"task_id", "prompt"})


def installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


async def _verl() -> list[Any]:
    compute_score: Any = kiln_verl.compute_score
    compute_score_batch: Any = kiln_verl.compute_score_batch
    if installed("verl.trainer.ppo.reward"):  # loaded by file path, as verl's trainer does
        from omegaconf import OmegaConf
        from verl.trainer.ppo.reward import get_custom_reward_fn

        def load(name: str) -> Any:
            config = OmegaConf.create({"reward": {"custom_reward_function": {"path": kiln_verl.__file__,
                                                                              "name": name}}})
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
    if installed("areal.api.reward_api"):  # AReaL's RLVRWorkflow wraps reward_fn so: a process pool
        from areal.api.reward_api import AsyncRewardWrapper

        wrapped: Any = AsyncRewardWrapper(reward_fn, timeout_seconds=60, max_workers=1, max_retries=0)
        return [await wrapped("3+4=", c, [1], [2], kiln_task=t) for c, t in (("7", RIGHT), ("8", RIGHT),
                                                                             ("7", LATE))]
    return [await async_reward_fn("3+4=", c, [1], [2], kiln_task=t) for c, t in (("7", RIGHT), ("8", RIGHT),
                                                                                 ("7", LATE))]


async def _verifiers() -> list[Any]:
    if not installed("verifiers.v1"):
        return []
    import verifiers.v1 as vf

    from kiln.integrations.trainers.prime import KilnTask, KilnTaskData

    rewards = []
    for reply, label in (("7", RIGHT), ("8", RIGHT), ("7", LATE)):
        trace = vf.Trace.model_construct(root_reply=reply, rewards={}, metrics={})
        await KilnTask(KilnTaskData(prompt="3+4=", kiln_task=label)).score(trace)
        rewards.append(trace.rewards["kiln"].value if hasattr(trace.rewards["kiln"], "value")
                       else trace.rewards["kiln"])
    return rewards


async def _openrlhf(url: str) -> list[Any]:
    queries, prompts, labels = ["3+4=7", "3+4=8", "3+4=7"], ["3+4="] * 3, [json.dumps(t) for t in (RIGHT, RIGHT,
                                                                                                LATE)]
    if installed("openrlhf.utils.agent"):  # OpenRLHF's own client of --remote_rm_url
        from openrlhf.utils.agent import SingleTurnAgentExecutor

        executor = SingleTurnAgentExecutor(remote_rm_url=f"{url}/openrlhf/reward")
        answers = [(await executor._fetch_rewards_via_http([q], [p], [lab]))[0]
                   for q, p, lab in zip(queries, prompts, labels, strict=True)]
    else:  # its request shape (openrlhf/utils/agent.py)
        async with httpx.AsyncClient(timeout=120) as http:
            answers = [(await http.post(f"{url}/openrlhf/reward", json={"query": [q], "prompts": [p],
                                                                         "labels": [lab]})).json()
                       for q, p, lab in zip(queries, prompts, labels, strict=True)]
    assert [a["extra_logs"]["kiln_failed"] for a in answers] == [[0.0], [0.0], [1.0]]
    ids = [a["extra_logs"]["kiln_version_id"][0] for a in answers]
    assert ids[0] == ids[1] != ids[2] and all(ids)
    return [a["rewards"][0] for a in answers]


async def test_every_adapter_gives_real_sandboxed_verdicts(stack: KilnSettings, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kiln.rewards")
    trainers.configure(stack)
    try:
        assert await _verl() == [1.0, 0.0, 0.0] * 2
        assert await _areal() == [1.0, 0.0, 0.0]
        assert await _verifiers() in ([], [1.0, 0.0, 0.0])
        with gateway_process(stack, tmp_path / "gateway.log") as url:
            assert await _openrlhf(url) == [1.0, 0.0, 0.0]
        trl = Verified(settings=stack)
        try:  # as GRPOTrainer calls a reward function: completions, prompts, and the dataset's columns
            rewards = await asyncio.to_thread(trl, completions=["7", "8", "7"], prompts=["3+4="] * 3,
                                              kiln_task=[RIGHT, RIGHT, LATE])
        finally:
            trl.close()
        assert rewards == [1.0, 0.0, 0.0]
        # Bare-float trainers (TRL, AReaL, prime) get the verifier's version in their log, once per version.
        noted = [r.getMessage() for r in caplog.records if "rewards scored by verifier exec" in r.getMessage()]
        assert len(noted) == len(set(noted)) >= 2, noted
        # kiln's own TRL rewards, through the stage: a program checked on its stdin — right, wrong, past its time.
        programs = OutputMatches(settings=stack, timeout_s=2, through_stage=True)
        try:
            scores = await asyncio.to_thread(programs, ["print(int(input()) + 4)", "print(8)", "while True: pass"],
                                             stdin=["3\n"] * 3, expected_output=["7"] * 3)
        finally:
            programs.close()
        assert scores == [1.0, 0.0, 0.0]
    finally:
        trainers.configure(None)
