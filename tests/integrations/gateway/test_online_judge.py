"""SandboxFusion's ``/submit`` with a problem of the trainer's own (``CommonOJDataset``, ``provided_data``), through
SandboxFusion's own client (``sandbox-fusion`` from PyPI, unmodified) against the gateway and a real exec worker:
the completion's program found as SandboxFusion finds it, run on every case (compiled once per call of up to 15
cases), compared as SandboxFusion compares; ``run_all_cases`` reports every case, else up to the first failure.
Attacked: a program that forges its verdict or looks for the expected output, ``custom_extract_logic`` (Python the
server would run), caps a request tries to raise, and a flood of output (bounded per submit; a case cut there
fails)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from sandbox_fusion import SubmitRequest, TestConfig, submit
from sandbox_fusion.async_client import submit as async_submit

from kiln.streams.settings import KilnSettings
from tests.integrations.gateway.conftest import Gateway
from tests.integrations.gateway.test_run_code_integrity import FORGE

pytestmark = pytest.mark.docker

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
CPP_ADD = "#include <iostream>\nint main(){long long a,b;std::cin>>a>>b;std::cout<<a+b<<std::endl;}\n"


def case(stdin: str, stdout: str) -> dict[str, dict[str, str]]:
    return {"input": {"stdin": stdin}, "output": {"stdout": stdout}}


def config(cases: list[dict[str, Any]], language: str = "python", **fields: Any) -> TestConfig:
    return TestConfig(dataset_type="CommonOJDataset", language=language,
                      provided_data={"id": 7, "content": "Add two numbers.", "test": cases}, **fields)


def request(completion: str, cases: list[dict[str, Any]], **fields: Any) -> SubmitRequest:
    return SubmitRequest(dataset="my_problems", id=7, completion=completion, config=config(cases, **fields))


def test_a_problem_of_the_trainers_own(gateway: Gateway) -> None:
    url = gateway()
    # Expected outputs as datasets write them: with or without a final newline, a number within 1e-5.
    cases = [case("1 2\n", "3\n"), case("40 2", "42"), case("-5 8\n", "3.0000001\n"), case("2 2\n" + " " * 3000, "4")]
    answer = submit(request(f"Here is my solution:\n```python\n{ADD}```\nIt reads a and b.", cases,
                            extra={"run_all_cases": True}), endpoint=url, max_attempts=1)
    assert answer.accepted and answer.id == 7, answer
    assert answer.extracted_code == ADD.rstrip("\n")
    assert [t.passed for t in answer.tests] == [True] * 4
    first = answer.tests[0].exec_info
    assert first.status == "Success" and first.run_result is not None and first.run_result.stdout == "3\n"
    # As SandboxFusion shows a passed case: its strings shortened past 1000 characters, ends kept.
    shown = answer.tests[3].test_info
    assert shown is not None and len(shown["input"]["stdin"]) == 999 and shown["input"]["stdin"].startswith("2 2")

    # A wrong program: with run_all_cases every case is reported; without, the answer stops at the first failure.
    wrong = "```python\na, b = map(int, input().split())\nprint(a + b if a == b else a * b)\n```"
    cases = [case("1 1", "2"), case("2 3", "5"), case("3 3", "6")]
    every = submit(request(wrong, cases, extra={"run_all_cases": True}), endpoint=url, max_attempts=1)
    assert not every.accepted and [t.passed for t in every.tests] == [True, False, True]
    assert every.tests[1].test_info == case("2 3", "5")
    first_failure = submit(request(wrong, cases), endpoint=url, max_attempts=1)
    assert [t.passed for t in first_failure.tests] == [True, False]

    # A case that crashes or runs past its time fails alone: the next one still runs.
    flaky = ("```python\nimport sys, time\nn = int(input())\nif n == 1: sys.exit(3)\nif n == 2: time.sleep(60)\n"
             "print(n)\n```")
    flaky_cases = [case("1", "1"), case("2", "2"), case("3", "3")]
    mixed = submit(request(flaky, flaky_cases, run_timeout=5, extra={"run_all_cases": True}), endpoint=url,
                   max_attempts=1)
    assert [t.passed for t in mixed.tests] == [False, False, True], mixed.tests
    crashed, slow = (t.exec_info.run_result for t in mixed.tests[:2])
    assert crashed is not None and crashed.return_code == 3
    assert slow is not None and slow.status == "TimeLimitExceeded"


async def test_compiled_once_per_call(gateway: Gateway) -> None:
    """17 cases of a C++ program: two run_once calls (a compile and 15 cases, a compile and 2); a compile error
    fails every case with the compiler's answer and no run."""
    url = gateway()
    cases = [case(f"{n} {n}", str(2 * n)) for n in range(17)]
    answer = await async_submit(request(f"```cpp\n{CPP_ADD}```", cases, language="cpp",
                                        extra={"run_all_cases": True}), endpoint=url, max_attempts=1)
    assert answer.accepted and len(answer.tests) == 17, answer
    for test in answer.tests:
        assert test.exec_info.compile_result is not None and test.exec_info.compile_result.return_code == 0
    broken = await async_submit(request("```cpp\nint main( {\n```", cases[:3], language="cpp",
                                        extra={"run_all_cases": True}), endpoint=url, max_attempts=1)
    assert [t.passed for t in broken.tests] == [False] * 3
    for test in broken.tests:
        assert test.exec_info.run_result is None and test.exec_info.status == "Failed"
        assert test.exec_info.compile_result is not None and "error" in (test.exec_info.compile_result.stderr or "")


def test_the_program_cannot_game_its_cases(gateway: Gateway, kafka: KilnSettings) -> None:
    """The expected outputs never enter the sandbox; a program that forges its verdict onto its reporter's channel
    (and kills it) still fails every case with what it really printed; nothing of kiln's control plane answers it
    (the broker, the gateway, Docker's socket)."""
    url = gateway()
    broker_host, broker_port = kafka.bootstrap_servers.split(",")[0].rsplit(":", 1)
    gateway_port = int(url.rsplit(":")[-1])
    targets = [(broker_host, int(broker_port)), ("127.0.0.1", int(broker_port)), ("127.0.0.1", gateway_port)]
    reach = (f"```python\nimport os, socket\nfor target in {targets!r}:\n    try:\n"
             "        socket.create_connection(target, 2).close()\n        print('reached', target)\n"
             "    except OSError:\n        pass\n"
             "print('docker.sock' if os.path.exists('/var/run/docker.sock') else 'alone')\n```")
    alone = submit(request(reach, [case("", "alone")]), endpoint=url, max_attempts=1)
    assert alone.accepted, alone.tests[0].exec_info
    secret = f"kiln-expected-{uuid.uuid4().hex}"
    search = ("```python\nimport os\nfound = []\nfor root in ('/work', '/tmp'):\n"
              "    for d, _, names in os.walk(root):\n        for n in names:\n"
              "            try: found.append(open(os.path.join(d, n), errors='replace').read())\n"
              "            except OSError: pass\n"
              "found.append(str(dict(os.environ)))\nfound.append(open(0).read())\n"
              "print('\\n'.join(found))\n```")
    looked = submit(request(search, [case("hello", secret), case("again", secret)], extra={"run_all_cases": True}),
                    endpoint=url, max_attempts=1)
    assert not looked.accepted
    for test in looked.tests:
        assert test.exec_info.run_result is not None and secret not in (test.exec_info.run_result.stdout or "")
    forged = submit(request(f"```python\n{FORGE}```", [case("", "honest")] * 3, extra={"run_all_cases": True}),
                    endpoint=url, max_attempts=1)
    assert [t.passed for t in forged.tests] == [False] * 3
    for test in forged.tests:
        ran = test.exec_info.run_result
        assert ran is not None and ran.return_code == 1 and ran.stdout == "honest\n", test


def test_what_a_program_prints_is_bounded(gateway: Gateway) -> None:
    """A submit's output budget (1 MiB here) shared by its cases, each stream of a case at least its expected output
    and 4 KiB: printing past it is cut there, and a case whose stdout was cut fails — the answer followed by a flood
    must not pass on its first part, as SandboxFusion (which cuts nothing) would compare the rest; stderr is cut
    without failing the case (it is never compared)."""
    url = gateway(KILN_GATEWAY_MAX_SUBMIT_OUTPUT_BYTES=str(1 << 20))
    program = ("```python\nimport sys\nn = input()\nprint('y' * 100_000 if n == 'big' else n)\n"
               "if n == 'flood': sys.stdout.write(' ' * 70_000 + 'X\\n')\n"
               "if n == 'spaces': sys.stdout.write(' ' * 50_000 + '\\n')\n"
               "if n == 'loud': sys.stderr.write('w' * 300_000)\n```")
    # 8 cases: 1 MiB / 16 streams = 64 KiB a stream.
    names = ["ok", "flood", "spaces", "loud", "ok", "ok", "ok", "ok"]
    shared = submit(request(program, [case(n, n) for n in names], extra={"run_all_cases": True}), endpoint=url,
                    max_attempts=1)
    assert [t.passed for t in shared.tests] == [True, False, True, True, True, True, True, True], shared.tests
    flood, loud = shared.tests[1].exec_info.run_result, shared.tests[3].exec_info.run_result
    assert flood is not None and flood.stdout is not None and flood.stdout.startswith("flood\n")
    assert len(flood.stdout) <= 64 << 10 and "X" not in flood.stdout  # cut: stripped, it reads "flood"
    assert loud is not None and loud.stderr is not None and 60 << 10 < len(loud.stderr) <= 64 << 10
    # An expected output above the share: its call's cases may print it (and 4 KiB more).
    big = submit(request(program, [case("big", "y" * 100_000), *[case("ok", "ok")] * 7]), endpoint=url,
                 max_attempts=1)
    assert big.accepted, big.tests[0].exec_info


def test_what_submit_refuses_is_said(gateway: Gateway, tmp_path: Path) -> None:
    url = gateway(exec=False)  # each is refused before any sandbox is asked for
    one = [case("1 2", "3")]
    planted = tmp_path / "executed-on-the-gateway"
    refusals = [
        (request(ADD, one, custom_extract_logic=f"open({str(planted)!r}, 'w').write('x')"), "custom_extract_logic"),
        (request(ADD, []), "has no cases"),
        (request(ADD, [case("1 2", "3")] * 513), "513 test cases is over kiln's limit 512"),
        (request(ADD, one, language="java"), "language 'java'"),
        (request(ADD, one, run_timeout=61), "run_timeout=61s"),
        (request(ADD, one, language="go", compile_timeout=301), "compile_timeout=301s is outside kiln's limit for go"),
        (SubmitRequest(dataset="code_contests", id=1, completion=ADD, config=TestConfig(language="python")),
         "kiln serves /submit for CommonOJDataset"),
        (SubmitRequest(dataset="x", id=1, completion=ADD, config=TestConfig(dataset_type="CommonOJDataset",
                                                                            language="python")), "provided_data"),
        (SubmitRequest(dataset="x", id=1, completion=ADD, config=TestConfig(
            dataset_type="CommonOJDataset", provided_data={"test": one})), "config.language field must exist"),
        (request(ADD, [{"input": {"file.txt": "1 2"}, "output": {"stdout": "3"}}]), "input.stdin"),
    ]
    for body, reason in refusals:
        with pytest.raises(Exception, match="400") as refused:
            submit(body, endpoint=url, max_attempts=1)
        assert reason in str(refused.value), (reason, refused.value)
    assert not planted.exists()
    # A client cannot raise a cap by asking: fields kiln does not read change nothing.
    raised = request(ADD, [case("1 2", "3")] * 513).dict()
    raised["config"]["extra"] = {"max_submit_cases": 10_000}
    raised["max_submit_cases"] = 10_000
    answer = httpx.post(f"{url}/submit", json=raised, timeout=60)
    assert answer.status_code == 400 and "KILN_GATEWAY_MAX_SUBMIT_CASES" in answer.text
