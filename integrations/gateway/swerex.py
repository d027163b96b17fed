"""SWE-ReX's remote runtime API (what ``swerex.runtime.remote.RemoteRuntime`` calls) over kiln's exec stage.

The URL names the sandbox: ``RemoteRuntime(host="http://GATEWAY/swerex/<runtime id>/<image>")`` — one exec session
on ``<image>`` (a kiln build) per runtime id, opened on first use and closed by ``close``. Named bash sessions keep
their working directory and exported variables from command to command: each command runs in a fresh shell that
restores them and saves them again on exit. Background processes do not outlive a command (kiln's exec policy), and
interactive commands are refused. Errors travel the way SWE-ReX's server sends them (HTTP 511 with the exception's
class path), so the client raises ``NonZeroExitCodeError``, ``CommandTimeoutError``, ``BashIncorrectSyntaxError``,
``SessionExistsError``, ``SessionDoesNotExistError``, …"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import shlex
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from kiln.integrations.gateway.errors import PeerError
from kiln.integrations.gateway.settings import GatewaySettings
from kiln.schemas.exec import CommandOutput, SessionLimits
from kiln.streams.errors import KilnError
from kiln.workers.exec.client import ExecClient, ExecSession

router = APIRouter(tags=["SWE-ReX"])
_STATE = "/tmp/.kiln-swerex"  # per bash session: cwd and exported variables, inside the sandbox
_FILE_INLINE = 60_000  # bytes a write carries inside its command; larger ones go through write_files first
_SYNTAX = "kiln-swerex-syntax:"  # starts the wrapper's stderr when ``bash -n`` refused the command


class _Peer(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CreateSession(_Peer):
    session: str = "default"
    startup_source: list[str] = []
    session_type: str = "bash"


class BashAction(_Peer):
    command: str
    session: str = "default"
    timeout: float | None = None
    is_interactive_command: bool = False
    is_interactive_quit: bool = False
    check: str = "raise"
    error_msg: str = ""
    action_type: str = "bash"


class BashInterruptAction(_Peer):
    session: str = "default"
    timeout: float = 0.2
    n_retry: int = 3
    expect: list[str] = []
    action_type: str = "bash_interrupt"


class CloseSession(_Peer):
    session: str = "default"


class Command(_Peer):
    command: str | list[str]
    timeout: float | None = None
    shell: bool = False
    check: bool = False
    error_msg: str = ""
    env: dict[str, str] | None = None
    cwd: str | None = None
    merge_output_streams: bool = False


class ReadFile(_Peer):
    path: str
    encoding: str | None = None
    errors: str | None = None


class WriteFile(_Peer):
    content: str
    path: str


@dataclass
class Runtime:
    image: str
    session: ExecSession | None = None
    opening: asyncio.Task[ExecSession] | None = None
    shells: set[str] = field(default_factory=set)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Runtimes:
    """The gateway's SWE-ReX runtimes, by (runtime id, image)."""

    def __init__(self, exec_client: ExecClient, settings: GatewaySettings) -> None:
        self.exec_client, self.settings = exec_client, settings
        self._runtimes: dict[tuple[str, str], Runtime] = {}

    def get(self, runtime_id: str, image: str) -> Runtime:
        return self._runtimes.setdefault((runtime_id, image), Runtime(image))

    async def session(self, runtime: Runtime) -> ExecSession:
        """The runtime's exec session, opened on first use. One open per runtime at a time, shared by every caller
        and shielded from their cancellation: ``is_alive`` polls with a 0.1 s client timeout (SWE-ReX's
        ``wait_until_alive``), shorter than an open, so an open outlives the request that started it."""
        if runtime.session is not None:
            return runtime.session
        if runtime.opening is None:
            runtime.opening = asyncio.get_running_loop().create_task(self.exec_client.open_session(
                runtime.image, limits=SessionLimits(idle_timeout_s=self.settings.swerex_idle_s)))
            # Retrieved here too: every caller may have given up before it failed.
            runtime.opening.add_done_callback(lambda t: t.cancelled() or t.exception())
        opening = runtime.opening
        try:
            runtime.session = await asyncio.shield(opening)
        except KilnError:
            if runtime.opening is opening:  # a later call tries again
                runtime.opening = None
            raise
        return runtime.session

    def forget(self, runtime_id: str, image: str) -> None:
        """Drop a runtime that holds no session (one whose image could not be opened)."""
        runtime = self._runtimes.get((runtime_id, image))
        if runtime is not None and runtime.session is None and runtime.opening is None:
            del self._runtimes[(runtime_id, image)]

    async def close(self, runtime_id: str, image: str) -> None:
        runtime = self._runtimes.pop((runtime_id, image), None)
        if runtime is None:
            return
        if runtime.session is None and runtime.opening is not None:  # closed while is_alive's open is in flight
            with contextlib.suppress(KilnError):
                runtime.session = await asyncio.shield(runtime.opening)
        if runtime.session is not None:
            await self.exec_client.close_session(runtime.session)

    async def run(self, runtime: Runtime, command: str, requested_s: float | None) -> CommandOutput:
        limit = self.settings.max_command_s
        if requested_s is not None and requested_s > limit:
            raise PeerError("builtins.ValueError", f"timeout={requested_s:g}s is over kiln's limit {limit:g}s "
                                                   "(KILN_GATEWAY_MAX_COMMAND_S)")
        timeout_s = requested_s if requested_s is not None and requested_s > 0 else limit
        output = await self.exec_client.run(await self.session(runtime), command, timeout_s=timeout_s,
                                            max_output_bytes=self.settings.exec_output_bytes)
        if output.timed_out:
            raise PeerError("swerex.exceptions.CommandTimeoutError",
                            f"timeout after {timeout_s:g} seconds while running command {command[-200:]!r}")
        return output


def _in_shell(name: str, command: str, *, fresh: bool = False) -> str:
    """``command`` in bash session ``name``: its directory and exported variables restored, and saved on exit
    (``fresh``: a new session, whatever an earlier one of that name left). First ``bash -n`` checks it, as SWE-ReX's
    server does: a syntax error ends the wrapper with exit 2 and ``_SYNTAX`` then bash's message on stderr, before
    anything runs (the command's own stderr goes to stdout)."""
    state = f"{_STATE}/{base64.b32encode(name.encode()).decode().rstrip('=')}"
    body = base64.b64encode(command.encode()).decode()
    # eval's argument is expanded before it runs, so the command can unset its own copy before it starts.
    return (f"__kiln_cmd=\"$(echo {body} | base64 -d)\"; "
            f"__kiln_syntax=\"$(printf '%s\\n' \"$__kiln_cmd\" | bash -n 2>&1)\" || "
            f"{{ printf '{_SYNTAX}%s' \"$__kiln_syntax\" >&2; exit 2; }}; unset __kiln_syntax; "
            f"S={state}; {'rm -rf $S; ' if fresh else ''}mkdir -p $S; [ -f $S/env ] && . $S/env; "
            "cd \"$(cat $S/cwd 2>/dev/null || echo /work)\"; "
            "trap 'rc=$?; pwd > $S/cwd; export -p | grep -vE \"^declare -x (PWD|OLDPWD|SHLVL|_)=\" > $S/env; "
            "exit $rc' EXIT; exec 2>&1; eval \"unset __kiln_cmd; $__kiln_cmd\"")


def _refuse_bad_syntax(command: str, output: CommandOutput) -> None:
    """SWE-ReX's ``BashIncorrectSyntaxError``, with its message and ``extra_info``, when ``bash -n`` refused."""
    if output.exit_code == 2 and output.stderr.startswith(_SYNTAX):
        stderr = output.stderr.removeprefix(_SYNTAX)
        raise PeerError("swerex.exceptions.BashIncorrectSyntaxError",
                        f"Error (exit code 2) while checking bash command \n{command!r}\n"
                        f"---- Stderr ----\n{stderr}\n---- Stdout ----\n",
                        {"bash_stdout": "", "bash_stderr": stderr})


async def _create_session(runtimes: Runtimes, runtime: Runtime, body: CreateSession) -> dict[str, Any]:
    if body.session in runtime.shells:
        raise PeerError("swerex.exceptions.SessionExistsError", f"session {body.session!r} already exists")
    sources = "; ".join(f"source {shlex.quote(s)}" for s in body.startup_source) or "true"
    output = await runtimes.run(runtime, _in_shell(body.session, sources, fresh=True), None)
    runtime.shells.add(body.session)
    return {"output": output.stdout, "session_type": "bash"}


async def _run_in_session(runtimes: Runtimes, runtime: Runtime, body: BashAction) -> dict[str, Any]:
    if body.action_type != "bash" or body.is_interactive_command or body.is_interactive_quit:
        raise PeerError("builtins.NotImplementedError", "interactive commands and interrupts are not served by "
                                                        "kiln: every command runs to completion in the sandbox")
    if body.session not in runtime.shells:
        raise PeerError("swerex.exceptions.SessionDoesNotExistError", f"session {body.session!r} does not exist")
    output = await runtimes.run(runtime, _in_shell(body.session, body.command), body.timeout)
    _refuse_bad_syntax(body.command, output)
    text = output.stdout.rstrip("\n")
    if body.check == "raise" and output.exit_code != 0:
        message = f"Command {body.command!r} failed with exit code {output.exit_code}. Here is the output:\n{text!r}"
        raise PeerError("swerex.exceptions.NonZeroExitCodeError",
                        f"{body.error_msg}: {message}" if body.error_msg else message)
    return {"output": text, "exit_code": None if body.check == "ignore" else output.exit_code,
            "failure_reason": "", "expect_string": "", "session_type": "bash"}


async def _interrupt(runtimes: Runtimes, runtime: Runtime, body: BashInterruptAction) -> dict[str, Any]:
    """Nothing is left to interrupt: a command ran to its end or was killed at its timeout with every process of
    the sandbox (the exec stage's sweep), and commands of a runtime run one at a time. So an interrupt — what
    SWE-agent sends after ``CommandTimeoutError`` — answers as SWE-ReX's does once its shell is back at the prompt."""
    if body.session not in runtime.shells:
        raise PeerError("swerex.exceptions.SessionDoesNotExistError", f"session {body.session!r} does not exist")
    return {"output": "", "exit_code": 0, "failure_reason": "", "expect_string": "", "session_type": "bash"}


async def _close_session(runtimes: Runtimes, runtime: Runtime, body: CloseSession) -> dict[str, Any]:
    if body.session not in runtime.shells:
        raise PeerError("swerex.exceptions.SessionDoesNotExistError", f"session {body.session!r} does not exist")
    runtime.shells.discard(body.session)
    return {"session_type": "bash"}


async def _execute(runtimes: Runtimes, runtime: Runtime, body: Command) -> dict[str, Any]:
    command = body.command if isinstance(body.command, str) else shlex.join(body.command)
    prefix = f"cd {shlex.quote(body.cwd)} && " if body.cwd else ""
    exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in (body.env or {}).items() if k.isidentifier())
    merge = " 2>&1" if body.merge_output_streams else ""
    output = await runtimes.run(runtime, f"{exports}{prefix}{{ {command}\n}}{merge}", body.timeout)
    if body.check and output.exit_code != 0:
        raise PeerError("swerex.exceptions.NonZeroExitCodeError",
                        f"Command {body.command!r} failed with exit code {output.exit_code}. "
                        f"Stdout:\n{output.stdout!r}\nStderr:\n{output.stderr!r}")
    return {"stdout": output.stdout, "stderr": output.stderr, "exit_code": output.exit_code}


async def _read_file(runtimes: Runtimes, runtime: Runtime, body: ReadFile) -> dict[str, Any]:
    output = await runtimes.run(runtime, f"base64 -w0 < {shlex.quote(body.path)}", None)
    if output.exit_code != 0:
        raise PeerError("builtins.FileNotFoundError", f"{body.path}: {output.stderr.strip()}")
    raw = base64.b64decode(output.stdout)
    return {"content": raw.decode(body.encoding or "utf-8", body.errors or "strict")}


async def write_bytes(runtimes: Runtimes, runtime: Runtime, path: str, content: bytes, unzip: bool = False) -> None:
    target = shlex.quote(path)
    if len(content) > _FILE_INLINE:
        staged = f"/work/.kiln-upload-{id(content)}"
        await runtimes.exec_client.write_files(await runtimes.session(runtime), {staged[len("/work/"):]: content})
        source = f"cat {staged}; rm -f {staged}"
    else:
        source = f"echo {base64.b64encode(content).decode()} | base64 -d"
    if unzip:
        # The archive lands next to its target, then unpacks into it (python3: images need not ship unzip).
        place = (f"mkdir -p {target} && ({source}) > {target}.zip && python3 -m zipfile -e {target}.zip {target} "
                 f"&& rm -f {target}.zip")
    else:
        place = f"mkdir -p \"$(dirname {target})\" && ({source}) > {target}"
    output = await runtimes.run(runtime, place, None)
    if output.exit_code != 0:
        raise PeerError("builtins.OSError", f"writing {path}: {output.stderr.strip()}")


async def _write_file(runtimes: Runtimes, runtime: Runtime, body: WriteFile) -> dict[str, Any]:
    await write_bytes(runtimes, runtime, body.path, body.content.encode())
    return {}


_HANDLERS: dict[str, tuple[type[_Peer], Any]] = {
    "create_session": (CreateSession, _create_session), "run_in_session": (BashAction, _run_in_session),
    "execute": (Command, _execute), "read_file": (ReadFile, _read_file), "write_file": (WriteFile, _write_file),
    "close_session": (CloseSession, _close_session),
}


def _error(e: PeerError) -> JSONResponse:
    return JSONResponse(status_code=511, content={"swerexception": {
        "message": str(e), "class_path": e.class_path, "traceback": "", "extra_info": e.extra_info}})


def _target(path: str) -> tuple[str, str, str]:
    """``<runtime id>/<image…>/<endpoint>`` → its three parts."""
    runtime_id, _, rest = path.partition("/")
    image, _, endpoint = rest.rpartition("/")
    return runtime_id, image, endpoint


@router.api_route("/swerex/{path:path}", methods=["GET", "POST"])
async def swerex(path: str, request: Request) -> Any:
    runtimes: Runtimes = request.app.state.runtimes
    runtime_id, image, endpoint = _target(path)
    if not runtime_id or not image:
        return JSONResponse(status_code=404, content={"detail": "use /swerex/<runtime id>/<image>/<endpoint>"})
    if endpoint == "is_alive":
        # Alive once the sandbox is: the first call opens the runtime's session (an image that does not exist
        # or is not a kiln build answers False, saying why).
        try:
            await runtimes.session(runtimes.get(runtime_id, image))
        except KilnError as e:
            runtimes.forget(runtime_id, image)
            return {"is_alive": False, "message": f"kiln cannot open a sandbox on {image!r}: {e}"}
        return {"is_alive": True, "message": ""}
    if endpoint == "close":
        try:
            await runtimes.close(runtime_id, image)
        except KilnError as e:
            return _error(PeerError("swerex.exceptions.SwerexException", str(e)))
        return {}
    runtime = runtimes.get(runtime_id, image)
    try:
        async with runtime.lock:
            if endpoint == "upload":
                form = await request.form()
                upload = form["file"]
                if isinstance(upload, str):
                    raise PeerError("builtins.ValueError", "upload needs a file part")
                await write_bytes(runtimes, runtime, str(form["target_path"]), await upload.read(),
                                  unzip=str(form.get("unzip", "false")).lower() == "true")
                return {}
            if endpoint not in _HANDLERS:
                return JSONResponse(status_code=404, content={"detail": f"no SWE-ReX endpoint {endpoint!r}"})
            body = await request.json()
            model, handler = _HANDLERS[endpoint]
            if endpoint == "run_in_session" and isinstance(body, dict) and body.get("action_type") == "bash_interrupt":
                model, handler = BashInterruptAction, _interrupt
            return await handler(runtimes, runtime, model.model_validate(body))
    except ValidationError as e:
        return JSONResponse(status_code=422, content={"detail": e.errors(include_url=False)})
    except PeerError as e:
        return _error(e)
    except KilnError as e:
        return _error(PeerError("swerex.exceptions.SwerexException", f"kiln: {e}"))
