"""``kiln tasks validate``: a repository task (revision, test patch, gold patch) made into FAIL_TO_PASS /
PASS_TO_PASS on top of the builder (the revision's image and its test command, with kiln's reporters) and exec
(each run a ``run_once`` call: the patches applied to a fresh copy of the image's tree, the image's test command,
its per-test results parsed outside the sandbox). See ``kiln.workers.common.swe`` for the contract."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import typer
from rich.console import Console

from kiln.schemas.builder import BuildRequest
from kiln.schemas.exec import RunStep
from kiln.schemas.reports import TestReport
from kiln.streams.settings import get_settings
from kiln.workers.builder.errors import TaskPatchFailed
from kiln.workers.common.swe import TaskValidation, split
from kiln.workers.exec.client import ExecClient

app = typer.Typer(help="Repository tasks for SWE-style training: validate FAIL_TO_PASS / PASS_TO_PASS.",
                  no_args_is_help=True)
out = Console()


async def _run(execs: ExecClient, image: str, patches: dict[str, str], timeout_s: float) -> TestReport | None:
    steps = [RunStep(name=name, command=f"git apply --whitespace=nowarn .kiln-task/{name}.diff", timeout_s=60)
             for name, patch in patches.items() if patch.strip()]
    steps.append(RunStep(name="clean", command="rm -rf .kiln-task", timeout_s=60))
    result = await execs.run_once(image, steps=steps, tests=True, timeout_s=timeout_s,
                                  files={f".kiln-task/{name}.diff": patch for name, patch in patches.items()})
    failed = next((s for s in result.steps if s.name != "tests" and s.exit_code != 0), None)
    if failed is not None:
        raise TaskPatchFailed(f"the {failed.name.replace('-', ' ')} does not apply: "
                              f"{(failed.stdout + failed.stderr)[-300:]}")
    return result.tests


async def validate(execs: ExecClient, image: str, test_patch: str, gold_patch: str, runs: int = 2,
                   timeout_s: float = 600.0) -> TaskValidation:
    """Run the image's tests ``runs`` times with the test patch alone and ``runs`` times with the test and gold
    patches (all at once, each in its own sandbox), and split the tests (``swe.split``)."""
    started = time.monotonic()
    sides = ({"test-patch": test_patch}, {"test-patch": test_patch, "gold-patch": gold_patch})
    try:
        before, after = await asyncio.gather(*(asyncio.gather(*(_run(execs, image, side, timeout_s)
                                                                for _ in range(runs))) for side in sides))
    except TaskPatchFailed as e:
        return TaskValidation(valid=False, failure="patch_does_not_apply", reason=str(e), runs=runs,
                              seconds=round(time.monotonic() - started, 3))
    return split(list(before), list(after)).model_copy(update={"seconds": round(time.monotonic() - started, 3)})


@app.command("validate")
def validate_command(repository: str, test_patch: Path, gold_patch: Path, revision: str = "HEAD", runs: int = 2,
                     image: str = "", timeout_s: float = 600.0) -> None:
    """Build REPOSITORY at --revision (or take --image, a kiln image of it), run its tests --runs times with
    TEST_PATCH alone and with TEST_PATCH and GOLD_PATCH (a test whose outcome changes is flaky, dropped), and print
    FAIL_TO_PASS / PASS_TO_PASS; exits 1 when the task is not valid."""
    from kiln.streams.client import KilnClient
    from kiln.workers.builder.client import BuilderClient

    patches = test_patch.read_text(), gold_patch.read_text()

    async def go() -> TaskValidation:
        async with KilnClient(get_settings()) as client:
            built = image
            if not built:
                event = await BuilderClient(client).build(BuildRequest(repository=repository, revision=revision))
                if not event.usable or not event.image:
                    return TaskValidation(valid=False, failure="build_failed",
                                          reason=f"the revision's build is not usable: {event.failure}: "
                                                 f"{(event.detail or '')[-500:]}")
                built = event.image
            return await validate(ExecClient(client), built, *patches, max(1, runs), timeout_s)

    result = asyncio.run(go())
    out.print_json(result.model_dump_json())
    if not result.valid:
        raise typer.Exit(1)
