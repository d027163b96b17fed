"""SWE-ReX's own ``RemoteRuntime`` (``swe-rex`` from PyPI, unmodified) against the gateway: a session on a
builder-built image of a repository revision, shell state carried between commands, a file written, the
repository's tests run, output and files read back, and SWE-ReX's exceptions raised where its server raises them."""

from __future__ import annotations

import pytest
from swerex.exceptions import CommandTimeoutError, NonZeroExitCodeError, SessionDoesNotExistError
from swerex.runtime.abstract import (
    BashAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    WriteFileRequest,
)
from swerex.runtime.remote import RemoteRuntime

from tests.workers.gateway.conftest import Gateway

pytestmark = pytest.mark.docker

NEW_TEST = "from calc import sub\n\n\ndef test_sub():\n    assert sub(5, 3) == 2\n"


async def test_remote_runtime_on_a_built_image(gateway: Gateway, project_image: str) -> None:
    url = gateway(KILN_GATEWAY_API_KEY="secret")
    runtime = RemoteRuntime(host=f"{url}/swerex/agent-1/{project_image}", port=None, auth_token="secret")
    assert (await runtime.is_alive()).is_alive
    await runtime.create_session(CreateBashSessionRequest())
    await runtime.run_in_session(BashAction(command="cd tests && export GREETING=hello"))
    state = await runtime.run_in_session(BashAction(command="echo $GREETING from $(pwd)"))
    assert state.output == "hello from /work/tests" and state.exit_code == 0

    await runtime.write_file(WriteFileRequest(path="/work/tests/test_sub.py", content=NEW_TEST))
    tests = await runtime.run_in_session(BashAction(command="cd /work && python -m pytest -q", timeout=120))
    assert "3 passed" in tests.output, tests.output
    read = await runtime.read_file(ReadFileRequest(path="/work/tests/test_sub.py"))
    assert read.content == NEW_TEST

    with pytest.raises(NonZeroExitCodeError):
        await runtime.run_in_session(BashAction(command="false"))
    tolerated = await runtime.run_in_session(BashAction(command="echo out; exit 4", check="silent"))
    assert tolerated.exit_code == 4 and tolerated.output == "out"
    with pytest.raises(CommandTimeoutError):
        await runtime.run_in_session(BashAction(command="sleep 30", timeout=1))

    executed = await runtime.execute(Command(command=["python", "-c", "import calc; print(calc.add(2, 2))"],
                                             cwd="/work"))
    assert executed.stdout == "4\n" and executed.exit_code == 0

    # A second runtime id is a second sandbox: it sees neither the file nor the shell.
    other = RemoteRuntime(host=f"{url}/swerex/agent-2/{project_image}", port=None, auth_token="secret")
    with pytest.raises(SessionDoesNotExistError):
        await other.run_in_session(BashAction(command="true"))
    missing = await other.execute(Command(command="test -e /work/tests/test_sub.py", shell=True))
    assert missing.exit_code == 1
    await other.close()

    await runtime.close_session(CloseBashSessionRequest())
    await runtime.close()
