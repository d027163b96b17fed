"""``kiln tasks validate``: a repository task (revision, test patch, gold patch) made into FAIL_TO_PASS /
PASS_TO_PASS on top of the builder (the revision's image and its test command, with kiln's reporters) and exec
(each run a ``run_once`` call: the patches applied to a fresh copy of the image's tree, the image's test command,
its per-test results parsed outside the sandbox). See ``kiln.workers.common.swe`` for the contract. ``kiln tasks
health``, ``quarantine``, ``release`` and ``board`` keep validated tasks healthy (``workers/builder/health.py``)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.console import Console

from kiln.schemas.builder import BuildRequest
from kiln.schemas.exec import ExecResult, RunStep
from kiln.streams.settings import get_settings
from kiln.workers.builder.errors import TaskPatchFailed
from kiln.workers.common.swe import SWETask, TaskValidation, split
from kiln.workers.exec.client import ExecClient

app = typer.Typer(help="Repository tasks for SWE-style training: validate FAIL_TO_PASS / PASS_TO_PASS, keep tasks "
                       "healthy (health, quarantine, release, board).",
                  no_args_is_help=True)
out = Console()


async def run_tests(execs: ExecClient, image: str, patches: dict[str, str], timeout_s: float,
                    deadline_s: float | None = None) -> ExecResult:
    """The image's test command after ``patches`` (step name -> unified diff, applied in order) in a fresh sandbox
    (exec ``run_once``); ``TaskPatchFailed`` when one does not apply."""
    steps = [RunStep(name=name, command=f"git apply --whitespace=nowarn .kiln-task/{name}.diff", timeout_s=60)
             for name, patch in patches.items() if patch.strip()]
    steps.append(RunStep(name="clean", command="rm -rf .kiln-task", timeout_s=60))
    result = await execs.run_once(image, steps=steps, tests=True, timeout_s=timeout_s, deadline_s=deadline_s,
                                  files={f".kiln-task/{name}.diff": patch for name, patch in patches.items()})
    failed = next((s for s in result.steps if s.name != "tests" and s.exit_code != 0), None)
    if failed is not None:
        raise TaskPatchFailed(f"the {failed.name.replace('-', ' ')} does not apply: "
                              f"{(failed.stdout + failed.stderr)[-300:]}")
    return result


async def validate(execs: ExecClient, image: str, test_patch: str, gold_patch: str, runs: int = 2,
                   timeout_s: float = 600.0) -> TaskValidation:
    """Run the image's tests ``runs`` times with the test patch alone and ``runs`` times with the test and gold
    patches (all at once, each in its own sandbox), and split the tests (``swe.split``)."""
    started = time.monotonic()
    sides = ({"test-patch": test_patch}, {"test-patch": test_patch, "gold-patch": gold_patch})
    try:
        before, after = await asyncio.gather(*(asyncio.gather(*(run_tests(execs, image, side, timeout_s)
                                                                for _ in range(runs))) for side in sides))
    except TaskPatchFailed as e:
        return TaskValidation(valid=False, failure="patch_does_not_apply", reason=str(e), runs=runs,
                              seconds=round(time.monotonic() - started, 3))
    split_runs = split([r.tests for r in before], [r.tests for r in after])
    return split_runs.model_copy(update={"seconds": round(time.monotonic() - started, 3)})


@app.command("validate")
def validate_command(repository: str, test_patch: Path, gold_patch: Path, revision: str = "HEAD", runs: int = 2,
                     image: str = "", timeout_s: float = 600.0,
                     save: Annotated[Path | None, typer.Option(help="Append the valid task to this task file (for "
                                                                    "`kiln tasks health`).")] = None,
                     problem_id: Annotated[str, typer.Option(help="The task's id in its source (with --save).")] = "",
                     ) -> None:
    """Build REPOSITORY at --revision (or take --image, a kiln image of it), run its tests --runs times with
    TEST_PATCH alone and with TEST_PATCH and GOLD_PATCH (a test whose outcome changes is flaky, dropped), and print
    FAIL_TO_PASS / PASS_TO_PASS; exits 1 when the task is not valid. With --save and --problem-id a valid task is
    appended to that task file."""
    from kiln.streams.client import KilnClient
    from kiln.workers.builder.client import BuilderClient

    if save is not None and not problem_id:
        raise typer.BadParameter("--save needs --problem-id")
    patches = test_patch.read_text(), gold_patch.read_text()
    built = image

    async def go() -> TaskValidation:
        nonlocal built
        async with KilnClient(get_settings()) as client:
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
    if save is not None:
        task = SWETask(source=repository, problem_id=problem_id, image=built, test_patch=patches[0],
                       gold_patch=patches[1], fail_to_pass=result.fail_to_pass, pass_to_pass=result.pass_to_pass)
        with save.open("a") as f:
            f.write(task.model_dump_json() + "\n")


@app.command("health")
def health_command(tasks_file: Path,
                   runs: Annotated[int, typer.Option(help="Runs with the gold patch per task (0: "
                                                          "KILN_BUILD_HEALTH_RUNS).")] = 0,
                   every: Annotated[float, typer.Option(help="Check again every this many seconds, forever (0: "
                                                             "once).")] = 0.0) -> None:
    """Re-check the tasks of TASKS_FILE (JSON lines, as `validate --save` writes them) on their images: tests re-run
    with the gold patch and without it; a task whose image does not start, whose gold patch no longer passes or whose
    tests flake is quarantined on kiln.tasks.health (RepositoryTasks stops serving it). Prints the run's report;
    exits 1 when kiln's own failures left a task unjudged. Settings: KILN_BUILD_HEALTH_*."""
    from prometheus_client import start_http_server

    from kiln.streams.client import KilnClient
    from kiln.workers.builder.health import HealthReport, TaskHealthSettings, health_run, load_tasks, registry

    health = TaskHealthSettings()
    if runs:
        health = health.model_copy(update={"health_runs": runs})

    async def go() -> HealthReport:
        async with KilnClient(get_settings()) as client:
            return await health_run(client, load_tasks(tasks_file), health)

    if every <= 0:
        report = asyncio.run(go())
        out.print_json(report.model_dump_json())
        if report.unjudged:
            raise typer.Exit(1)
        return
    if health.health_metrics_port:
        start_http_server(health.health_metrics_port, registry=registry)
    while True:
        began = time.monotonic()
        out.print_json(asyncio.run(go()).model_dump_json())
        time.sleep(max(0.0, every - (time.monotonic() - began)))


def _operator(task_ids: list[str], action: Literal["quarantine", "release"], note: str) -> None:
    from kiln.workers.builder.health import operator_record
    from kiln.workers.common.task_health import TaskHealthBoard, publish_health

    settings = get_settings()
    previous = TaskHealthBoard(settings).refresh()
    records = [operator_record(previous.get(t), t, action, note, time.time()) for t in task_ids]
    publish_health(settings, records)
    for record in records:
        out.print(f"{record.task_id}: {record.status}", markup=False, highlight=False)


@app.command("quarantine")
def quarantine_command(task_ids: list[str], note: Annotated[str, typer.Option(help="Why (kept in the record).")]
                       ) -> None:
    """Quarantine TASK_IDS (<source>:<problem id>) by hand: no task source serves them, whatever later checks find,
    until `kiln tasks release`."""
    _operator(task_ids, "quarantine", note)


@app.command("release")
def release_command(task_ids: list[str], note: Annotated[str, typer.Option(help="Why (kept in the record).")] = ""
                    ) -> None:
    """Lift the quarantine of TASK_IDS (a check's or an operator's): served again until a check finds otherwise."""
    _operator(task_ids, "release", note)


@app.command("board")
def board_command(every_task: Annotated[bool, typer.Option("--all", help="Every task, not only the quarantined.")]
                  = False,
                  as_json: Annotated[bool, typer.Option("--json", help="The records as JSON lines.")] = False) -> None:
    """The tasks on kiln.tasks.health: the quarantined ones (or --all) with their reason and evidence."""
    from rich.table import Table
    from rich.text import Text

    from kiln.workers.common.task_health import TaskHealthBoard

    records = sorted(TaskHealthBoard(get_settings()).refresh().values(), key=lambda r: r.task_id)
    shown = [r for r in records if every_task or r.status == "quarantined"]
    if as_json:
        for record in shown:
            print(record.model_dump_json())
        return
    table = Table("task", "status", "reason", "gold runs passed", "kiln failures", "detail",
                  title=f"task health: {sum(r.status == 'quarantined' for r in records)} of {len(records)} "
                        "quarantined")
    for r in shown:
        table.add_row(Text(r.task_id), r.status, r.reason or "-", f"{r.gold_passed_runs}/{r.runs}",
                      str(r.infra_failures), Text((r.detail or r.infra_detail)[:120]))  # Text: no markup read
    out.print(table)
