"""kimina-lean-server's own client (``kimina-client`` from PyPI, unmodified, in its own Python 3.12) against the
gateway, served by kiln's Lean stage on the fake REPL: a proof that succeeds, one that fails, one with ``sorry``;
the client's own analysis classifies each from the peer's response fields; with ``debug``, each answer carries
kimina's diagnostics (the REPL process, its CPU and memory), measured by the Lean worker."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import httpx

from tests.integrations.gateway.conftest import Gateway

CLIENT = """
import json, sys
from kimina_client import KiminaClient, Snippet
client = KiminaClient(api_url=sys.argv[1], api_key=sys.argv[2], n_retries=1)
snippets = [Snippet(id=i, code=c) for i, c in json.loads(sys.argv[3]).items()]
answer = client.check(snippets, timeout=60, show_progress=False, debug=len(sys.argv) > 4)
print(json.dumps({r.id: {"status": r.analyze().status.value, "error": r.error, "response": r.response,
                         "diagnostics": r.diagnostics} for r in answer.results}))
"""


def test_the_peer_client_checks_proofs(gateway: Gateway, kimina_python: Path) -> None:
    url = gateway(exec=False, lean=True, KILN_GATEWAY_API_KEY="secret")
    proofs = {"good": "theorem good : p \u2192 p := by intro h; exact h",
              "bad": "theorem bad : p \u2192 q := by intro h; exact h",
              "gap": "theorem gap : p \u2192 p \u2227 True := by sorry"}
    run = subprocess.run([str(kimina_python), "-c", CLIENT, url, "secret", json.dumps(proofs)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert {k: v["status"] for k, v in results.items()} == {"good": "valid", "bad": "lean_error", "gap": "sorry"}
    assert all(v["diagnostics"] is None for v in results.values())  # as kimina: only when asked for
    assert "messages" not in results["good"]["response"]
    bad = results["bad"]["response"]["messages"]
    assert bad[0]["severity"] == "error" and bad[0]["pos"] == {"line": 1, "column": 0}
    gap = results["gap"]["response"]
    assert gap["sorries"][0]["goal"] == "\u22a2 p \u2192 p \u2227 True"
    assert gap["messages"][0]["severity"] == "warning" and gap["messages"][0]["data"] == "declaration uses 'sorry'"

    # A wrong key: the gateway answers 401, which the client reports per snippet as a server error.
    wrong_key = subprocess.run([str(kimina_python), "-c", CLIENT, url, "wrong", json.dumps(proofs)],
                               capture_output=True, text=True, timeout=300)
    refused = json.loads(wrong_key.stdout.strip().splitlines()[-1])
    assert {v["status"] for v in refused.values()} == {"server_error"}
    assert httpx.post(f"{url}/api/check", json={"snippets": [{"id": "x", "code": "#check Nat"}]},
                      headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_debug_says_which_repl_and_what_it_spent(gateway: Gateway, kimina_python: Path) -> None:
    url = gateway(exec=False, lean=True)
    proofs = {"good": "theorem good : p \u2192 p := by intro h; exact h",
              "gap": "theorem gap : p \u2192 p \u2227 True := by sorry"}
    run = subprocess.run([str(kimina_python), "-c", CLIENT, url, "", json.dumps(proofs), "debug"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert {k: v["status"] for k, v in results.items()} == {"good": "valid", "gap": "sorry"}
    for answer in results.values():
        diagnostics = answer["diagnostics"]
        assert set(diagnostics) == {"repl_uuid", "cpu_max", "memory_max"}, diagnostics
        assert str(uuid.UUID(diagnostics["repl_uuid"])) == diagnostics["repl_uuid"]
        # The fake REPL is a Python process: megabytes resident, under the worker's bound; CPU within what one core
        # (plus the fence's process, if any) can give.
        assert 1 << 20 < diagnostics["memory_max"] < 8 << 30
        assert 0 <= diagnostics["cpu_max"] <= 200
