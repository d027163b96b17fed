"""SandboxFusion's own client (``sandbox-fusion`` from PyPI, unmodified) against the gateway: code in six languages
runs in exec sessions on the toolchain image, with stdin, files, a compile error, a timeout, and kiln's limits
refused with a reason; with an API key, carried in the endpoint URL."""

from __future__ import annotations

import base64
from urllib.parse import quote

import httpx
import pytest
from sandbox_fusion import RunCodeRequest, RunStatus, run_code
from sandbox_fusion.async_client import run_code as async_run_code

from tests.integrations.gateway.conftest import Gateway

pytestmark = pytest.mark.docker

HELLO = {
    "python": "import sys\nprint('hello', sys.stdin.read().strip())",
    "bash": "read name; echo hello $name",
    "nodejs": "let s='';process.stdin.on('data',d=>s+=d).on('end',()=>console.log('hello '+s.trim()))",
    "cpp": "#include <iostream>\nint main(){std::string s;std::cin>>s;std::cout<<\"hello \"<<s<<std::endl;}",
    "go": "package main\nimport \"fmt\"\nfunc main(){var s string;fmt.Scan(&s);fmt.Println(\"hello \"+s)}",
    "rust": "use std::io::Read;\nfn main(){let mut s=String::new();std::io::stdin().read_to_string(&mut s)"
            ".unwrap();println!(\"hello {}\",s.trim());}",
}


def test_run_code_through_the_peer_client(gateway: Gateway) -> None:
    url = gateway()
    for language, code in HELLO.items():
        # 120 s: the compile_timeout SandboxFusion's clients usually send, under every compiled language's cap.
        answer = run_code(RunCodeRequest(code=code, language=language, stdin="kiln\n", compile_timeout=120),
                          endpoint=url, max_attempts=1)
        assert answer.status == RunStatus.Success, (language, answer)
        assert answer.run_result is not None and answer.run_result.stdout == "hello kiln\n", (language, answer)
        assert (answer.compile_result is not None) == (language in ("cpp", "go", "rust")), (language, answer)

    broken = run_code(RunCodeRequest(code="int main( { return 0; }", language="cpp"), endpoint=url, max_attempts=1)
    assert broken.status == RunStatus.Failed and broken.run_result is None
    assert broken.compile_result is not None and broken.compile_result.return_code != 0
    assert "error" in (broken.compile_result.stderr or "")

    slow = run_code(RunCodeRequest(code="while True: pass", language="python", run_timeout=1), endpoint=url,
                    max_attempts=1)
    assert slow.status == RunStatus.Failed and slow.run_result is not None
    assert slow.run_result.status == "TimeLimitExceeded" and slow.run_result.return_code is None

    failing = run_code(RunCodeRequest(code="import sys; print('out'); sys.exit(3)", language="python"),
                       endpoint=url, max_attempts=1)
    assert failing.status == RunStatus.Failed and failing.run_result is not None
    assert failing.run_result.return_code == 3 and failing.run_result.stdout == "out\n"

    data = base64.b64encode(b"21\n").decode()
    with_files = run_code(RunCodeRequest(
        code="n = int(open('data/in.txt').read()); open('out.txt', 'w').write(str(2 * n))", language="python",
        files={"data/in.txt": data}, fetch_files=["out.txt"]), endpoint=url, max_attempts=1)
    assert with_files.status == RunStatus.Success, with_files
    assert base64.b64decode(with_files.files["out.txt"]) == b"42"


def test_what_kiln_refuses_is_said(gateway: Gateway) -> None:
    url = gateway(KILN_GATEWAY_MAX_TIMEOUT_S="30")
    cases = [(RunCodeRequest(code="print(1)", language="python", run_timeout=100), "run_timeout=100s"),
             (RunCodeRequest(code="x", language="java"), "language 'java'"),
             (RunCodeRequest(code="print(1)", language="python", files={"/etc/passwd": ""}), "/etc/passwd")]
    for request, reason in cases:
        with pytest.raises(Exception, match="400") as refused:
            run_code(request, endpoint=url, max_attempts=1)
        assert reason in str(refused.value)
    # Bad base64 in a file: refused before any sandbox opens, naming the file (inline and beyond the inline size).
    for code in ("print(1)", "print(1)" + " " * 100_000):
        bad = RunCodeRequest(code=code, language="python", files={"in.txt": "not base64!"})
        with pytest.raises(Exception, match="422") as refused:
            run_code(bad, endpoint=url, max_attempts=1)
        assert "in.txt" in str(refused.value)


def test_compile_caps_are_per_language(gateway: Gateway) -> None:
    """Each compiled language's own cap on compile_timeout (a deployment's KILN_GATEWAY_MAX_COMPILE_S replaces the
    defaults of the languages it names only); above it, refused, naming it — whatever else the request says."""
    url = gateway(exec=False, KILN_GATEWAY_MAX_COMPILE_S='{"rust": 150}')
    for language, cap in (("cpp", 120), ("go", 300), ("rust", 150)):
        with pytest.raises(Exception, match="400") as refused:
            run_code(RunCodeRequest(code=HELLO[language], language=language, compile_timeout=cap + 1), endpoint=url,
                     max_attempts=1)
        assert f"compile_timeout={cap + 1}s is outside kiln's limit for {language} (0, {cap}]" in str(refused.value)
        assert "KILN_GATEWAY_MAX_COMPILE_S" in str(refused.value)
    raised = {**RunCodeRequest(code=HELLO["go"], language="go", compile_timeout=301).dict(),
              "max_compile_s": {"go": 1000}, "compile_cap_s": 1000, "KILN_GATEWAY_MAX_COMPILE_S": '{"go": 1000}'}
    answer = httpx.post(f"{url}/run_code", json=raised, timeout=60)
    assert answer.status_code == 400 and "compile_timeout=301s" in answer.text


async def test_what_the_peer_client_hit(gateway: Gateway) -> None:
    """SandboxFusion's client sets no headers, so with an API key it carries the key the one way it can: in the
    endpoint URL's credentials (percent-encoded), which requests and aiohttp send as HTTP Basic. Through it: an
    output above the claim-check threshold (KILN_CLAIM_CHECK_BYTES, 256 KiB) comes back whole, and a language with no
    compile step takes any compile_timeout while one with a compile step is still held to the cap."""
    key = "s3cr@t/k:y"
    url = gateway(KILN_GATEWAY_API_KEY=key)
    host = url.removeprefix("http://")
    with_key = f"http://kiln:{quote(key, safe='')}@{host}"

    for endpoint in (url, f"http://kiln:wrong@{host}"):
        with pytest.raises(Exception, match="401"):
            run_code(RunCodeRequest(code="print(1)", language="python"), endpoint=endpoint, max_attempts=1)
        with pytest.raises(Exception, match="401"):
            await async_run_code(RunCodeRequest(code="print(1)", language="python"), endpoint=endpoint,
                                 max_attempts=1)

    big = run_code(RunCodeRequest(code="print('x' * 200_000)", language="python"), endpoint=with_key,
                   max_attempts=1)
    assert big.status == RunStatus.Success, big.message
    assert big.run_result is not None and big.run_result.stdout == "x" * 200_000 + "\n"

    for language in ("python", "nodejs"):
        code = "print('ok')" if language == "python" else "console.log('ok')"
        # SandboxFusion's async client (aiohttp) this time.
        answer = await async_run_code(RunCodeRequest(code=code, language=language, compile_timeout=1000),
                                      endpoint=with_key, max_attempts=1)
        assert answer.status == RunStatus.Success, (language, answer)
        assert answer.run_result is not None and answer.run_result.stdout == "ok\n"
    with pytest.raises(Exception, match="400") as refused:
        run_code(RunCodeRequest(code=HELLO["cpp"], language="cpp", compile_timeout=1000), endpoint=with_key,
                 max_attempts=1)
    assert "compile_timeout=1000s" in str(refused.value)
