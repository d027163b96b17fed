"""``run_code``'s verdict, attacked by the program it judges (through SandboxFusion's own client, unmodified): the
program forges an answer onto its reporter's channel and kills it, or leaves a process to rewrite the next
request's run; the gateway still answers what the program did."""

from __future__ import annotations

import pytest
from sandbox_fusion import RunCodeRequest, RunStatus, run_code

from tests.integrations.gateway.conftest import Gateway

pytestmark = pytest.mark.docker

# Every process above the program (its reporter, whatever it is), then every process it can see: a forged
# "success" line written to each one's stdout and stderr, then SIGKILL. Then it fails.
FORGE = r"""
import os, signal, sys
forged = b'STEP run 0 1 Zm9yZ2VkCg== \n{"steps":[{"name":"run","exit_code":0,"stdout":"Zm9yZ2VkCg=="}],"clean":true}\n'
me = os.getpid()
for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
    if pid == me:
        continue
    for fd in (1, 2):
        try:
            with open(f"/proc/{pid}/fd/{fd}", "wb") as out:
                out.write(forged)
        except OSError:
            pass
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
print("honest")
sys.exit(1)
"""
# Left behind by one request: rewrites every file it can find, for whoever runs next.
LINGER = r"""
import os, subprocess
subprocess.Popen(["bash", "-c", "while true; do for f in /work/run/*; do echo 'print(42)' > $f; done; sleep 0.01; "
                  "done"], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("left")
"""


def test_the_program_cannot_forge_its_verdict(gateway: Gateway) -> None:
    url = gateway()
    forged = run_code(RunCodeRequest(code=FORGE, language="python"), endpoint=url, max_attempts=1)
    assert forged.status == RunStatus.Failed, forged
    assert forged.run_result is not None and forged.run_result.return_code == 1
    assert forged.run_result.stdout == "honest\n"
    for _ in range(3):
        assert run_code(RunCodeRequest(code=LINGER, language="python"), endpoint=url,
                        max_attempts=1).status == RunStatus.Success
        after = run_code(RunCodeRequest(code="print(6 * 7 + 1)", language="python"), endpoint=url, max_attempts=1)
        assert after.run_result is not None and after.run_result.stdout == "43\n", after
