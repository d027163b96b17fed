"""The exec stage's operations: ``run_once`` on a warm runner, and the operations on an open session as a table
by op name (``SessionOps.table``). ``open`` (and ``fork``'s new session) is the service's: it takes the warm pool."""

from __future__ import annotations

import asyncio
import logging
import shlex
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from docker.errors import APIError, DockerException, NotFound
from pydantic import ValidationError

from kiln.schemas.exec import CommandOutput, ExecRequest, ExecResult, FileContent, RunStep, file_content
from kiln.schemas.images import ImageContract
from kiln.schemas.reports import TestReport
from kiln.streams.stage import JobContext
from kiln.workers.common import reports
from kiln.workers.common.image_cache import ImageCache
from kiln.workers.exec import protocol
from kiln.workers.exec.errors import ImageUnavailable, SessionError
from kiln.workers.exec.metrics import RUNNERS_DISCARDED, TIMEOUTS
from kiln.workers.exec.runners import RunnerPool
from kiln.workers.exec.sessions import Session, SessionManager, safe_path

log = logging.getLogger(__name__)

OpenSession = Callable[[ExecRequest, JobContext, str], Awaitable[ExecResult]]
"""Opens a new session for a request on an image (``ExecService.open_session``)."""
SessionOp = Callable[[ExecRequest, JobContext, Session, ExecResult], Awaitable[ExecResult]]
"""One operation on an open session: the request, its context, the session and the result so far (its op, session,
partition and image filled in)."""


class SessionOps:
    """What each op does to an open session (``table``, by op name)."""

    def __init__(self, manager: SessionManager, open_session: OpenSession) -> None:
        self.manager = manager
        self.open_session = open_session
        self.table: dict[str, SessionOp] = {
            "close": self.close, "fork": self.fork, "snapshot": self.snapshot, "write_files": self.write_files,
            "read_files": self.read_files, "delete_files": self.delete_files, "apply_patch": self.apply_patch,
            "run": self.run, "run_tests": self.run_tests, "lint": self.lint,
        }

    async def execute(self, request: ExecRequest, ctx: JobContext, session: Session) -> ExecResult:
        op = self.table.get(request.op)
        if op is None:
            raise SessionError(f"op {request.op!r} is no operation on a session")
        return await op(request, ctx, session, ExecResult(op=request.op, session_id=session.id,
                                                          partition=ctx.partition, image=session.image))

    async def close(self, request: ExecRequest, ctx: JobContext, session: Session, result: ExecResult) -> ExecResult:
        await ctx.cancel.run(self.manager.close, session)
        return result

    async def fork(self, request: ExecRequest, ctx: JobContext, session: Session, result: ExecResult) -> ExecResult:
        digest, size = await ctx.cancel.run(self.manager.snapshot, session)
        fork = request.model_copy(update={"snapshot": digest, "limits": session.limits})
        forked = await self.open_session(fork, ctx, session.image)
        return forked.model_copy(update={"op": "fork", "snapshot": digest, "snapshot_bytes": size})

    async def snapshot(self, request: ExecRequest, ctx: JobContext, session: Session,
                       result: ExecResult) -> ExecResult:
        digest, size = await ctx.cancel.run(self.manager.snapshot, session)
        return result.model_copy(update={"snapshot": digest, "snapshot_bytes": size})

    async def write_files(self, request: ExecRequest, ctx: JobContext, session: Session,
                          result: ExecResult) -> ExecResult:
        await ctx.cancel.run(self.manager.write_files, session, request.files)
        return result

    async def read_files(self, request: ExecRequest, ctx: JobContext, session: Session,
                         result: ExecResult) -> ExecResult:
        return result.model_copy(update={"files": await ctx.cancel.run(self.manager.read_files, session,
                                                                           request.paths)})

    async def delete_files(self, request: ExecRequest, ctx: JobContext, session: Session,
                           result: ExecResult) -> ExecResult:
        paths = " ".join(_quote(p) for p in request.paths)
        output = await self._run(session, f"rm -rf -- {paths}", request, ctx)
        return result.model_copy(update={"output": output})

    async def apply_patch(self, request: ExecRequest, ctx: JobContext, session: Session,
                          result: ExecResult) -> ExecResult:
        patch = (request.patch or "").encode()
        where = await ctx.cancel.run(self.manager.put_tmp, session, ".kiln-patch.diff", patch)
        output = await self._run(session, f"git apply --whitespace=nowarn {where}", request, ctx)
        return result.model_copy(update={"output": output})

    async def run(self, request: ExecRequest, ctx: JobContext, session: Session, result: ExecResult) -> ExecResult:
        output = await self._run(session, request.command or "", request, ctx)
        return result.model_copy(update={"output": output})

    async def run_tests(self, request: ExecRequest, ctx: JobContext, session: Session,
                        result: ExecResult) -> ExecResult:
        contract = await ctx.cancel.run(session_contract, session)
        command = request.command or contract.test
        if not command:
            raise SessionError(f"image {session.image} records no test command: pass one")
        # The run ends with every session process gone (swept from outside), so the reports read below were
        # written by this run and nothing can rewrite them.
        output = await self._run(session, f"rm -rf {contract.reports_dir}; {command}", request, ctx,
                                 env=contract.env)
        files = await ctx.cancel.run(self.manager.collect, session, contract.reports_dir)
        tests = checked_report(reports.parse_results(contract.system or "custom", output.exit_code, files,
                                                     contract.module), output)
        return result.model_copy(update={"output": output, "tests": tests})

    async def lint(self, request: ExecRequest, ctx: JobContext, session: Session, result: ExecResult) -> ExecResult:
        contract = await ctx.cancel.run(session_contract, session)
        command = request.command or contract.lint
        if not command:
            raise SessionError(f"image {session.image} records no lint command: pass one")
        output = await self._run(session, command, request, ctx, env=contract.env)
        findings = reports.lint_findings(output.stdout)
        return result.model_copy(update={"output": output, "findings": findings})

    async def _run(self, session: Session, command: str, request: ExecRequest, ctx: JobContext,
                   env: dict[str, str] | None = None) -> Any:
        manager = self.manager
        # Given up (timeout, revoke): the session's processes are killed, so the command's thread returns.
        ctx.cancel.on_cancel(lambda: manager.sweep(session))
        output = await ctx.cancel.run(manager.run, session, command, request.timeout_s, request.max_output_bytes,
                                      env)
        if output.timed_out:
            TIMEOUTS.inc()
        return output


async def ensure_image(images: ImageCache, image: str, ctx: JobContext) -> None:
    """Make ``image`` local (pulled from the registry when it is a reference there). An image the engine lacks and
    the registry does not have is the image's failure, not the worker's: ``ImageUnavailable``, answered at once."""
    try:
        await ctx.cancel.run(images.ensure, image)
    except NotFound as e:  # docker's ImageNotFound too; a registry that does not answer is an APIError, retried
        raise ImageUnavailable(f"image {image} is not available: {e}") from None


async def run_once(manager: SessionManager, images: ImageCache, runners: RunnerPool, request: ExecRequest,
                   ctx: JobContext) -> ExecResult:
    """A stateless call on a warm runner: nothing of it outlives it, so a replay just runs it again."""
    image = request.image or ""
    manager.check_image(image)
    if not runners.serves(image):  # a Docker API round trip only for an image no runner has yet
        await ensure_image(images, image, ctx)
    steps = request.steps or ([RunStep(name="run", command=request.command, timeout_s=request.timeout_s)]
                              if request.command else [])
    contract, env, fetch = ImageContract(), dict(request.env), list(request.paths)
    if request.tests:
        contract = await ctx.cancel.run(image_contract, manager, image)
        if not contract.test:
            raise ImageUnavailable(f"image {image} records no test command")
        steps = [*steps, RunStep(name="tests", command=f"rm -rf {contract.reports_dir}; {contract.test}",
                                 timeout_s=request.timeout_s)]
        env = {**contract.env, **env}
        fetch.append(f"{contract.reports_dir}/")
    call = protocol.call_message(request, steps, env, fetch)
    runner = await ctx.cancel.run(runners.take, image, request.limits)
    ctx.cancel.on_cancel(lambda: runners.discard(runner))
    try:
        answer = await ctx.cancel.run(runner.call, call, sum(s.timeout_s for s in steps) + 60.0)
    except BaseException:
        await asyncio.to_thread(runners.give, runner, False)
        raise
    clean = bool(answer.get("clean"))
    if not clean:
        RUNNERS_DISCARDED.inc()
        log.warning("runner %s discarded: %s", runner.container.name, answer.get("residue") or answer.get("error"))
    await asyncio.to_thread(runners.give, runner, clean)
    if answer.get("error"):
        raise SessionError(f"run_once: {answer['error']}")
    outputs = [protocol.step_output(s) for s in answer.get("steps", [])]
    if any(o.timed_out for o in outputs):
        TIMEOUTS.inc()
    fetched = protocol.fetched_files(answer)
    tests = None
    if request.tests:
        found = {p.removeprefix(f"{contract.reports_dir}/"): fetched.pop(p) for p in list(fetched)
                 if p.startswith(f"{contract.reports_dir}/")}
        # A runner that writes reports but left none did not finish its suite (or was ended from inside).
        if outputs and outputs[-1].name == "tests" and (found or contract.reports_dir not in contract.test):
            tests = checked_report(reports.parse_results(contract.system or "custom", outputs[-1].exit_code,
                                                         found, contract.module), outputs[-1])
    files = [_file(p, d) for p, d in fetched.items()]
    return ExecResult(op="run_once", session_id="", partition=ctx.partition, image=image, steps=outputs,
                      output=outputs[-1] if outputs else None, files=files, tests=tests)


def checked_report(report: TestReport | None, output: CommandOutput) -> TestReport | None:
    """A report is the runner's word; the exit status is measured outside the sandbox. A report that shows no
    failure from a run that failed (or timed out) gains an error, so it can never score as a clean pass."""
    if report is None or (output.exit_code == 0 and not output.timed_out) or report.failed + report.errors:
        return report
    return report.model_copy(update={"errors": 1})


def _file(path: str, data: bytes) -> FileContent:
    """Text when it decodes, else base64 (as ``read_files`` answers)."""
    try:
        return FileContent(path=path, text=data.decode())
    except UnicodeDecodeError:
        return file_content(path, data)


def _contract(labels: Mapping[str, str] | None, image: str) -> ImageContract:
    """What the image declares (its labels, written by the build stage); a contract this worker cannot read is the
    request's error, answered, never a retry."""
    try:
        return ImageContract.from_labels(labels)
    except ValidationError as e:
        raise SessionError(f"image {image}: its image contract is unreadable here: {e}") from e


def image_contract(manager: SessionManager, image: str) -> ImageContract:
    try:
        labels = manager.client.images.get(image).labels
    except (APIError, DockerException):
        labels = None
    return _contract(labels, image)


def session_contract(session: Session) -> ImageContract:
    try:
        labels = session.container.image.labels
    except (APIError, DockerException):
        labels = None
    return _contract(labels, session.image)


def _quote(path: str) -> str:
    return shlex.quote(safe_path(path))
