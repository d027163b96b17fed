"""SWE-style multi-turn rollouts: a scripted policy (tests/fakes/scripted_policy.py) reads the repository and runs
its tests through tool calls in its own exec session, then answers with a patch; the ``swe`` verifier applies each
patch and the task's test patch to a copy of the built repository and runs its tests in an isolated session. Tool
output is in the sample but masked out of training."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kiln.rl.tasks import Problem, RepositoryTasks
from kiln.rl.train import to_group
from kiln.rl.trainer import PolicyTrainer
from kiln.schemas.exec import ExecRequest
from kiln.schemas.rl import RolloutGroup, RolloutRequest, Sampling
from kiln.streams.client import KilnClient
from kiln.streams.codec import decode_request, request_payload
from kiln.streams.processes import WorkerProcess, free_port
from kiln.streams.settings import KilnSettings
from kiln.workers.inference.model import TOKENIZER, ModelConfig, TinyLM
from tests.stages import worker_env
from tests.streams.harness import read_all
from tests.workers.exec.conftest import exec_worker

pytestmark = pytest.mark.docker

SCRIPTED = Path(__file__).resolve().parents[2] / "fakes" / "scripted_policy.py"
TEST_NEG = ("--- /dev/null\n+++ b/tests/test_neg.py\n@@ -0,0 +1,5 @@\n+from calc import neg\n+\n+\n"
            "+def test_neg():\n+    assert neg(2) == -2\n")


@pytest.fixture
def scripted_policy() -> Iterator[str]:
    port = free_port()
    policy = subprocess.Popen([sys.executable, str(SCRIPTED), str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                httpx.get(f"{url}/healthz", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield url
    finally:
        policy.kill()
        policy.wait()


async def test_multi_turn_repository_task_rewarded_by_its_tests(stage_topics: Callable[..., KilnSettings],
                                                                project_image: str, tmp_path: Path,
                                                                scripted_policy: str, unique: str) -> None:
    settings = stage_topics(("rollout.requests", 2), ("rollouts", 1), ("exec.requests", 2))
    tasks = RepositoryTasks("demo/exec", project_image, [Problem(problem_id="neg", statement="Add neg(a) to calc.",
                                                                 test_patch=TEST_NEG)])
    env = worker_env(settings, KILN_ROLLOUT_ENDPOINTS=json.dumps([scripted_policy]))
    with exec_worker(settings, tmp_path / "locks") as ex, \
            WorkerProcess("rollout", settings, "rollout.requests", slots=2, env=env) as worker:
        ex.wait_assigned()
        worker.wait_assigned()
        async with KilnClient(settings, f"trainer-{unique}") as client:
            group: RolloutGroup = await client.call("rollout", RolloutRequest(
                task=tasks.task(tasks.problems[0]), sampling=Sampling(n=4, max_tokens=2000)))
        worker.stop()
    assert [s.reward for s in group.samples] == [1.0, 0.0, 1.0, 0.0]
    for i, sample in enumerate(group.samples):
        assert sample.turns == 3 and sample.verifier["name"] == "swe" and sample.verifier["stage"] == "tests"
        assert (sample.verifier["exit"] == 0) == (i % 2 == 0), sample.verifier
        assert len(sample.tool_mask) == len(sample.token_ids) == len(sample.logprobs) == len(sample.versions)
        policy_text = TOKENIZER.decode([t for t, m in zip(sample.token_ids, sample.tool_mask, strict=True) if not m])
        tool_text = TOKENIZER.decode([t for t, m in zip(sample.token_ids, sample.tool_mask, strict=True) if m])
        assert policy_text.startswith("<run>cat calc/__init__.py</run><run>python -m pytest")
        assert "<patch>" in policy_text and "<output>" not in policy_text
        assert "def mul(a, b):" in tool_text and "2 passed" in tool_text and "<patch>" not in tool_text
    # The trainer learns from the policy's tokens only.
    _inputs, _targets, mask, _old, _adv = PolicyTrainer(TinyLM(ModelConfig())).batch([to_group(group)])
    assert int(mask.sum()) == sum(s.tool_mask.count(0) for s in group.samples)
    ops = [ExecRequest.model_validate(request_payload(decode_request(m.value()), ExecRequest, None)).op
           for m in read_all(settings, settings.topic("exec.requests"))]
    # Four samples' tool sessions (two commands each), all closed, and a one-shot verification call per sample.
    assert ops.count("open") == 4 and ops.count("close") == 4 and ops.count("run") == 8, ops
    assert ops.count("run_once") == 4, ops
