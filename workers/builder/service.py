"""One build end to end: resolve the revision in Saucer, check it out, plan, build the dependency and project
images, run the tests without network, parse results and coverage, and classify any failure."""

from __future__ import annotations

import dataclasses
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.ingest.errors import SaucerError
from kiln.ingest.reader import Repository
from kiln.ingest.store import SaucerStore
from kiln.schemas.builder import BuildEvent, BuildRequest, Decision, FailureClass
from kiln.schemas.images import REPORTS_DIR, ImageContract
from kiln.streams.cancel import in_thread
from kiln.streams.errors import BlobNotFound, InfraError
from kiln.workers.builder import images
from kiln.workers.builder.agent import AgentConfig, agent_image
from kiln.workers.builder.agent import test_command as agent_test_command
from kiln.workers.builder.errors import PlanError, StepFailed
from kiln.workers.builder.rules import RULES_VERSION, Plan, describe, plan
from kiln.workers.builder.sandbox import BuildSandbox
from kiln.workers.common import reports
from kiln.workers.common.containers import Limits, run_sandboxed
from kiln.workers.common.errors import ReportError

CACHE_NAMESPACE = "builds"


def cache_name(repository: str, commit: str) -> str:
    return f"{CACHE_NAMESPACE}/{repository}/{commit}-r{RULES_VERSION}"


def revision_version(repo: Repository, commit: str) -> str:
    """The version git metadata would give ``commit`` (nearest tag, distance), for builds without ``.git``."""
    return describe({c: info.parents for c, info in repo.manifest.commits.items()}, repo.tags(), commit)


def image_tag(repository: str, commit: str) -> str:
    return f"kiln/build/{images.repository_slug(repository, 100)}:{commit[:12]}-r{RULES_VERSION}"


async def build_revision(request: BuildRequest, store: SaucerStore, client: Any, bases: images.BaseImages,
                         work_root: Path, limits: Limits,
                         on_step: Callable[[str], None] = lambda _s: None,
                         agent: AgentConfig | None = None) -> BuildEvent:
    started = time.monotonic()
    deadline = started + request.timeout_s
    event = BuildEvent(repository=request.repository, revision=request.revision, rules_version=RULES_VERSION,
                       status="failed")

    def left() -> float:
        return max(1.0, deadline - time.monotonic())

    def failed(kind: FailureClass, detail: str, **update: Any) -> BuildEvent:
        return event.model_copy(update={"failure": kind, "detail": detail[-4000:], **update})

    try:
        repo = store.repository(request.repository)
        commit = repo.resolve(request.revision)
    except SaucerError as e:
        return failed("infrastructure", f"Saucer: {e}")
    event = event.model_copy(update={"commit": commit})
    if not request.force:
        try:
            cached = BuildEvent.model_validate_json(store.blobs.get_name(cache_name(request.repository, commit)))
            if cached.status == "failed" or (cached.image and images.image_exists(client, cached.image)):
                return cached.model_copy(update={"cached": True, "revision": request.revision})
        except BlobNotFound:
            pass
    durations: dict[str, float] = {}
    await in_thread(work_root.mkdir, parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work_root, prefix="build-") as tmp:
        checkout = Path(tmp) / "src"
        await in_thread(checkout.mkdir)
        await in_thread(repo.checkout, commit, checkout)
        version, excluded, fallbacks = revision_version(repo, commit), set[str](), list[Decision]()
        last_failure: BuildEvent | None = None
        while True:  # the chosen build system, then the next one present when it cannot build
            try:
                the_plan = plan(checkout, version, excluded)
            except PlanError as e:
                rules_failed = last_failure or failed(e.failure, str(e))
                if agent is None:
                    return _remember(store, rules_failed)
                on_step("agent")
                return _remember(store, await _with_agent(rules_failed, request, client, bases, checkout, agent,
                                                          limits, left()))
            the_plan.decisions[:0] = fallbacks
            event = event.model_copy(update={"system": the_plan.system, "recipe": the_plan.recipe,
                                             "decisions": the_plan.decisions, "toolchain": the_plan.toolchain})
            tag = image_tag(request.repository, commit)
            # The exec stage reads how to test and lint a session on this image from its contract.
            contract = ImageContract(test=images.test_command(the_plan), env=the_plan.env, system=the_plan.system,
                                     module=_go_module(checkout), lint=the_plan.lint_script)
            labels = {"kiln.repository": request.repository, "kiln.commit": commit,
                      "kiln.rules": str(RULES_VERSION), **contract.to_labels()}
            try:
                built = await _image(the_plan, request, client, bases, checkout, tag, labels, left, on_step,
                                     durations)
            except InfraError as e:
                return failed("infrastructure", str(e))
            if not isinstance(built, _StepFailure):
                image_id, learned = built
                event = event.model_copy(update=learned)
                break
            last_failure = failed(built.kind, built.log, durations_s=_rounded(durations))
            if built.kind != "timeout" and the_plan.alternatives:
                tried = the_plan.recipe if the_plan.recipe == "dockerfile" else the_plan.system
                excluded.add(tried)
                last_line = built.log.strip().splitlines()[-1][:160] if built.log.strip() else "?"
                fallbacks.append(Decision(topic="fallback", choice=the_plan.alternatives[0],
                                          reason=f"{tried} failed ({built.kind}: {last_line})"))
                continue
            if agent is None or built.kind == "timeout":
                return _remember(store, last_failure)
            return _remember(store, await _with_agent(last_failure, request, client, bases, checkout, agent, limits,
                                                      left()))
        event = event.model_copy(update={"status": "built", "image": tag, "image_id": image_id})
        if request.run_tests:
            on_step("tests")
            t = time.monotonic()
            run = await in_thread(
                run_sandboxed, client, tag, contract.test, role="build-test", collect=contract.reports_dir,
                limits=dataclasses.replace(limits, timeout_s=min(limits.timeout_s, left())),
                env=contract.env, cgroup_parent=BuildSandbox().worker_cgroup())
            durations["tests"] = time.monotonic() - t
            if run.timed_out:
                return _remember(store, failed("timeout", "the test suite ran past its time limit:\n" + run.output,
                                               durations_s=_rounded(durations)))
            try:
                tests = reports.parse_results(contract.system, run.exit_code, run.files, contract.module)
            except ReportError as e:
                tests, run.output = None, f"{e}\n{run.output}"
            problem = reports.unusable_reason(tests) if tests else ("tests_did_not_run", "no test results")
            if problem is not None:
                return _remember(store, failed(problem[0], f"{problem[1]}; exit {run.exit_code}:\n{run.output}",
                                               durations_s=_rounded(durations), tests=tests))
            event = event.model_copy(update={"usable": True, "tests": tests})
        durations["total"] = time.monotonic() - started
        return _remember(store, event.model_copy(update={"durations_s": _rounded(durations)}))


@dataclass
class _StepFailure:
    kind: FailureClass
    log: str


async def _image(the_plan: Plan, request: BuildRequest, client: Any, bases: images.BaseImages, checkout: Path,
                 tag: str, labels: dict[str, str], left: Callable[[], float], on_step: Callable[[str], None],
                 durations: dict[str, float]) -> tuple[str, dict[str, Any]] | _StepFailure:
    """The project image (its id, and what the event learns about the dependency layer), or the step that failed."""
    failing: FailureClass = "compile_failed"
    try:
        if the_plan.recipe == "dockerfile":
            on_step("build (Dockerfile)")
            t = time.monotonic()
            image_id = await in_thread(images.dockerfile_image, client, the_plan, checkout, bases, tag, labels, left(),
                                       request.force)
            durations["build"] = time.monotonic() - t
            return image_id, {}
        on_step("dependencies")
        t, failing = time.monotonic(), "dependency_install_failed"
        deps, deps_cached = await in_thread(images.dependency_image, client, the_plan, checkout, bases, left(),
                                            request.force)
        durations["dependencies"] = time.monotonic() - t
        on_step("build")
        t, failing = time.monotonic(), "compile_failed"
        image_id = await in_thread(images.project_image, client, the_plan, checkout, deps, tag, labels, left(),
                                   request.force)
        durations["build"] = time.monotonic() - t
    except StepFailed as e:
        return _StepFailure("timeout" if e.timed_out else failing, e.log)
    return image_id, {"dependency_image": deps, "dependency_layer_cached": deps_cached}


async def _with_agent(rules_failed: BuildEvent, request: BuildRequest, client: Any, bases: images.BaseImages,
                      checkout: Path, agent: AgentConfig, limits: Limits, budget_s: float) -> BuildEvent:
    """The fallback: README/CI commands (or a model) in a container; the rules' failure stands if it fails too."""
    assert rules_failed.commit is not None
    tag = image_tag(request.repository, rules_failed.commit)
    labels = {"kiln.repository": request.repository, "kiln.commit": rules_failed.commit,
              "kiln.rules": str(RULES_VERSION)}  # and the contract, once the agent knows the test command
    started = time.monotonic()
    built, test, decisions, output = await in_thread(
        agent_image, client, bases.toolchain, checkout, tag, labels, agent.budget, agent.model, min(600.0, budget_s))
    decisions = [*rules_failed.decisions, *decisions]
    if not built or test is None:
        return rules_failed.model_copy(update={"decisions": decisions, "detail": (
            f"{rules_failed.detail}\n--- agent fallback failed too:\n{output[-2000:]}")[-4000:]})
    event = rules_failed.model_copy(update={
        "status": "built", "failure": None, "detail": None, "system": "agent", "recipe": "agent",
        "decisions": decisions, "image": tag, "image_id": str(client.images.get(tag).id)})
    if request.run_tests:
        run = await in_thread(run_sandboxed, client, tag, agent_test_command(test), role="build-test",
                              collect=REPORTS_DIR, limits=limits, cgroup_parent=BuildSandbox().worker_cgroup())
        tests = reports.parse_results("agent", run.exit_code, run.files)
        problem = reports.unusable_reason(tests) if tests else ("tests_did_not_run", "no test results")
        if problem is not None:
            return event.model_copy(update={"usable": False, "failure": problem[0], "tests": tests,
                                            "detail": f"{problem[1]}:\n{run.output}"[-4000:]})
        event = event.model_copy(update={"usable": True, "tests": tests})
    return event.model_copy(update={"durations_s": {"agent": round(time.monotonic() - started, 3)}})


def _rounded(durations: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in durations.items()}


def _go_module(checkout: Path) -> str:
    go_mod = checkout / "go.mod"
    if go_mod.is_file():
        m = re.search(r"^module\s+(\S+)", go_mod.read_text(errors="replace"), re.MULTILINE)
        if m:
            return m.group(1)
    return ""


# Failures that may pass on their own (a registry hiccup, a loaded machine): asked again, the build is redone.
NOT_CACHED = {"timeout", "dependency_install_failed", "infrastructure"}


def _remember(store: SaucerStore, event: BuildEvent) -> BuildEvent:
    """Record the outcome under (repository, commit, rules version): it is not built again unless forced (outcomes
    in ``NOT_CACHED`` are not recorded)."""
    if event.commit and event.failure not in NOT_CACHED:
        store.blobs.set_name(cache_name(event.repository, event.commit), event.model_dump_json().encode())
    return event
