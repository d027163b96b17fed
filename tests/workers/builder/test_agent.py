"""The agent fallback on real Docker: a repository no rule can build, whose README states the commands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from kiln.ingest.service import ingest
from kiln.ingest.store import SaucerStore
from kiln.schemas.builder import BuildRequest
from kiln.schemas.images import ImageContract
from kiln.schemas.ingest import IngestRequest
from kiln.streams.blobstore import FileBlobStore
from kiln.workers.builder.agent import AgentConfig, ModelClient, classify
from kiln.workers.builder.images import BaseImages
from kiln.workers.builder.service import build_revision
from kiln.workers.common.containers import Limits
from tests.ingest.gitrepos import Builder, write
from tests.loopback import serving

pytestmark = pytest.mark.docker
README = """# widget

Nothing standard here. Build it with:

```sh
./build.sh
```

and run the tests:

```sh
sh run-tests.sh
```
"""


def readme_project(path: Path) -> None:
    b = Builder(path)
    write(path, "README.md", README)
    write(path, "build.sh", "mkdir -p out && cp src/widget.txt out/widget && echo built\n")  # not executable
    write(path, "run-tests.sh", "test -f out/widget && grep -q widget out/widget && echo 'ok 1 - widget built'\n")
    write(path, "src/widget.txt", "a widget\n")
    b.commit("a repository only its README explains")


async def build(tmp: Path, docker: Any, agent: AgentConfig | None) -> Any:
    store = SaucerStore(FileBlobStore(tmp / "blobs"), tmp / "cache")
    if not (tmp / "src").exists():
        readme_project(tmp / "src")
    await ingest(IngestRequest(name="demo/readme", location=str(tmp / "src")), "r", store, tmp / "w")
    return await build_revision(BuildRequest(repository="demo/readme", force=True), store, docker,
                                BaseImages("kiln/base:latest", "kiln/toolchain:latest"), tmp / "w",
                                Limits(timeout_s=120), agent=agent)


def test_readme_commands_are_classified(tmp_path: Path) -> None:
    readme_project(tmp_path / "repo")
    plan = classify(tmp_path / "repo")
    assert (plan.build, plan.test) == (["./build.sh"], ["sh run-tests.sh"])


async def test_rules_fail_and_the_readme_agent_builds(docker_engine: Any, tmp_path: Path) -> None:
    without = await build(tmp_path, docker_engine, None)
    assert (without.status, without.failure) == ("failed", "no_rule_matched")
    event = await build(tmp_path, docker_engine, AgentConfig(budget=6))
    assert event.status == "built" and event.usable and event.recipe == "agent", event.detail
    assert any(d.topic == "agent repair" and d.choice == "sh build.sh" for d in event.decisions)
    assert event.tests is not None and event.tests.passed == 1
    assert ImageContract.from_labels(docker_engine.images.get(event.image).labels).system == "agent"


async def test_an_openai_compatible_model_drives_the_agent(docker_engine: Any, tmp_path: Path) -> None:
    script = [{"phase": "build", "command": "sh build.sh"}, {"phase": "test", "command": "sh run-tests.sh"}]
    asked: list[str] = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    def complete(body: dict[str, Any]) -> dict[str, Any]:
        asked.append(body["messages"][-1]["content"])
        step = script[min(len(asked) - 1, len(script) - 1)]
        return {"choices": [{"message": {"role": "assistant", "content": f"Sure.\n{json.dumps(step)}"}}]}

    with serving(app) as url:
        model = ModelClient(url, "test-model")
        event = await build(tmp_path, docker_engine, AgentConfig(budget=4, model=model))
    assert event.usable and event.recipe == "agent", event.detail
    assert [d.reason.split(",")[0] for d in event.decisions if d.topic.startswith("agent ")][-2:] == ["model", "model"]
    assert "README and CI commands" in asked[0] and len(asked) == 2


async def test_when_no_rule_fits_the_agents_attempt_is_in_the_event(docker_engine: Any, tmp_path: Path) -> None:
    b = Builder(tmp_path / "src")
    write(tmp_path / "src", "README.md", "# widget\n\nA widget.\n")
    write(tmp_path / "src", "widget.txt", "a widget\n")
    b.commit("nothing to build and nothing said")
    event = await build(tmp_path, docker_engine, AgentConfig(budget=4))
    assert (event.status, event.failure, event.usable) == ("failed", "no_rule_matched", False)
    assert "--- agent fallback failed too:\nthe agent found no command to try" in (event.detail or ""), event.detail
