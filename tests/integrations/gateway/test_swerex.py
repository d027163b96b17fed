"""SWE-ReX's own ``RemoteRuntime`` (``swe-rex`` from PyPI, unmodified) against the gateway: a session on a
builder-built image of a repository revision, shell state carried between commands, a file written, the
repository's tests run, output and files read back, and SWE-ReX's exceptions raised where its server raises them
(a syntax error, a timeout and the interrupt that follows it, a closed session, an image that does not exist)."""

from __future__ import annotations

import pytest
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
)
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    WriteFileRequest,
)
from swerex.runtime.remote import RemoteRuntime

from tests.integrations.gateway.conftest import Gateway

pytestmark = pytest.mark.docker

NEW_TEST = "from calc import sub\n\n\ndef test_sub():\n    assert sub(5, 3) == 2\n"


async def test_remote_runtime_on_a_built_image(gateway: Gateway, project_image: str) -> None:
    url = gateway(KILN_GATEWAY_API_KEY="secret")
    runtime = RemoteRuntime(host=f"{url}/swerex/agent-1/{project_image}", port=None, auth_token="secret")
    # What SWE-agent's RemoteDeployment does: poll is_alive (0.1 s each) until the sandbox is open.
    await runtime.wait_until_alive(timeout=120)
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


async def test_what_swerex_clients_hit(gateway: Gateway) -> None:
    """On the toolchain image (any kiln image serves; no repository needed): what SWE-ReX's client and SWE-agent
    rely on beyond the happy path."""
    url = gateway(KILN_GATEWAY_API_KEY="secret")
    runtime = RemoteRuntime(host=f"{url}/swerex/agent-3/kiln/toolchain:latest", port=None, auth_token="secret")
    await runtime.wait_until_alive(timeout=120)

    # 300 KB of output: above the claim-check threshold (KILN_CLAIM_CHECK_BYTES, 256 KiB), it comes back whole.
    big = await runtime.execute(Command(command=["python3", "-c", "print('x' * 300_000)"]))
    assert big.exit_code == 0 and big.stdout == "x" * 300_000 + "\n"

    await runtime.create_session(CreateBashSessionRequest())
    await runtime.run_in_session(BashAction(command="mkdir -p tests && cd tests && export MARK=kept"))
    # Checked with bash -n before it runs, as SWE-ReX's server does: nothing of it ran.
    with pytest.raises(BashIncorrectSyntaxError) as syntax:
        await runtime.run_in_session(BashAction(command="touch /work/ran; if then fi"))
    assert "syntax error" in syntax.value.extra_info["bash_stderr"]
    assert (await runtime.execute(Command(command="test -e /work/ran", shell=True))).exit_code == 1

    # SWE-agent's answer to a timeout: interrupt the session, then go on in it, its state intact.
    with pytest.raises(CommandTimeoutError):
        await runtime.run_in_session(BashAction(command="sleep 30", timeout=1))
    interrupted = await runtime.run_in_session(BashInterruptAction())
    assert interrupted.exit_code == 0
    after = await runtime.run_in_session(BashAction(command="echo $MARK from $(pwd)"))
    assert after.output == "kept from /work/tests"
    with pytest.raises(SessionDoesNotExistError):
        await runtime.run_in_session(BashInterruptAction(session="other"))

    await runtime.close_session(CloseBashSessionRequest())
    with pytest.raises(SessionDoesNotExistError):
        await runtime.close_session(CloseBashSessionRequest())
    # A session created again under the same name starts afresh.
    await runtime.create_session(CreateBashSessionRequest())
    fresh = await runtime.run_in_session(BashAction(command="echo ${MARK:-unset} from $(pwd)"))
    assert fresh.output == "unset from /work"
    await runtime.close()

    missing = RemoteRuntime(host=f"{url}/swerex/agent-4/kiln/no-such-image:latest", port=None, auth_token="secret")
    alive = await missing.is_alive(timeout=120)
    assert not alive.is_alive and "no-such-image" in alive.message
