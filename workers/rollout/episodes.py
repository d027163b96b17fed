"""Multi-turn samples: the policy acts, its tool calls run in the sample's own exec session, their output joins the
transcript, until it answers (a turn without a tool call) or ``max_turns`` is spent; the last turn's text is what the
verifier judges.

A tool call is ``<run>command</run>`` in the policy's text; its output is appended as ``<output>…</output>``,
tokenised with kiln's tokenizer and marked in ``tool_mask`` so the trainer never trains on it. Each sample gets a
fresh session (its commands may change the tree), closed when the episode ends.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any

from kiln.workers.exec.client import ExecClient
from kiln.workers.inference.endpoints import KilnEndpoint
from kiln.workers.inference.model import TOKENIZER

TOOL_CALL = re.compile(r"<run>(.*?)</run>", re.DOTALL)
OUTPUT_LIMIT = 2000  # characters of a command's output the transcript keeps (its tail)


@dataclass
class Turn:
    """One completion choice as the sampler produced it."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str

    @classmethod
    def from_choice(cls, choice: dict[str, Any]) -> Turn:
        kiln = choice["kiln"]
        return cls(choice["text"], kiln["token_ids"], choice["logprobs"]["token_logprobs"], kiln["token_versions"],
                   choice["finish_reason"])


@dataclass
class Episode:
    """A whole sample: every turn's tokens and the tools' outputs between them."""

    answer: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    tool_mask: list[int] = field(default_factory=list)
    finish_reason: str = ""
    turns: int = 0
    tool_calls: int = 0

    def policy(self, turn: Turn) -> None:
        self.text += turn.text
        self.token_ids += turn.token_ids
        self.logprobs += turn.logprobs
        self.versions += turn.versions
        self.tool_mask += [0] * len(turn.token_ids)
        self.answer, self.finish_reason = turn.text, turn.finish_reason
        self.turns += 1

    def tool(self, output: str) -> None:
        observed = f"\n<output>\n{output[-OUTPUT_LIMIT:]}</output>\n"
        ids = TOKENIZER.encode(observed)
        self.text += observed
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [self.versions[-1] if self.versions else 0] * len(ids)
        self.tool_mask += [1] * len(ids)
        self.tool_calls += 1


async def run_episode(endpoint: KilnEndpoint, exec_client: ExecClient, image: str, prompt: str, max_turns: int,
                      sampling: dict[str, Any], user: str) -> Episode:
    episode = Episode()
    session = None
    try:
        for turn_number in range(max_turns):
            answer = await endpoint.complete(prompt + episode.text, n=1, logprobs=0, user=user, **sampling)
            turn = Turn.from_choice(answer["choices"][0])
            episode.policy(turn)
            call = TOOL_CALL.search(turn.text)
            if call is None or turn_number == max_turns - 1:
                break
            if session is None:
                session = await exec_client.open_session(image)
            output = await exec_client.run(session, call.group(1), timeout_s=60)
            episode.tool(f"{output.stdout}{output.stderr}[exit {output.exit_code}]\n")
    finally:
        if session is not None:
            await asyncio.shield(exec_client.close_session(session))
    return episode
