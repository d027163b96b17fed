"""A scripted policy behind kiln's completions API, for multi-turn rollouts where a tiny model cannot write patches:
it reads the repository's module with a tool call, runs the tests with another, then answers with a patch built from
what it read — adding ``neg(a)`` correctly for even-numbered samples (``user`` = ``<request>/<i>``) and wrongly for
odd ones. Tokens come from kiln's tokenizer, every log-prob is -0.1, every version 0.

Usage: python scripted_policy.py PORT
"""

from __future__ import annotations

import difflib
import json
import re
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kiln.workers.inference.model import TOKENIZER

MODULE = "calc/__init__.py"


def act(prompt: str, sample: int) -> str:
    outputs = re.findall(r"<output>\n(.*?)</output>", prompt, re.DOTALL)
    if len(outputs) == 0:
        return f"<run>cat {MODULE}</run>"
    if len(outputs) == 1:
        return "<run>python -m pytest -q -p no:cacheprovider 2>&1 | tail -1</run>"
    source = outputs[0].rsplit("[exit ", 1)[0]
    body = "    return -a\n" if sample % 2 == 0 else "    return a\n"
    patched = source + "\n\ndef neg(a):\n" + body
    diff = "".join(difflib.unified_diff(source.splitlines(True), patched.splitlines(True), f"a/{MODULE}",
                                        f"b/{MODULE}"))
    return f"<patch>\n{diff}</patch>"


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self._send({"status": "ok"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        sample = int(str(body.get("user", "x/0")).rsplit("/", 1)[-1])
        prompt = body["prompt"]  # token ids, as the rollout stage sends them (the transcript so far)
        text = act(TOKENIZER.decode(prompt) if isinstance(prompt, list) else prompt, sample)
        ids = TOKENIZER.encode(text)
        self._send({"choices": [{"index": 0, "text": text, "finish_reason": "stop",
                                 "logprobs": {"token_logprobs": [-0.1] * len(ids)},
                                 "kiln": {"token_ids": ids, "token_versions": [0] * len(ids)}}],
                    "kiln": {"version_start": 0, "version_end": 0}})

    def _send(self, answer: dict[str, object]) -> None:
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
