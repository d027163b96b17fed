"""Multi-turn samples: the policy acts, its tool calls run in the sample's own exec session, their output joins the
transcript, until it answers (a turn without a tool call) or ``max_turns`` is spent; the last turn's text is what the
verifier judges.

Token in, token out: the transcript is a token sequence, never re-tokenised text. Each turn's prompt is the group's
prompt ids followed by every token so far — the turns' sampled ids as the engine returned them, and between turns a
tool call's output, ``<output>…</output>``, tokenised once with the model's tokenizer and marked in ``tool_mask`` so
the trainer never trains on it. The trainer sees exactly these ids. Each sample gets a fresh session (its commands
may change the tree), closed when the episode ends.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any

from kiln.workers.exec.client import ExecClient
from kiln.workers.inference.endpoints import InferenceEndpoint, Turn
from kiln.workers.inference.tokenizer import PolicyTokenizer

TOOL_CALL = re.compile(r"<run>(.*?)</run>", re.DOTALL)
OUTPUT_LIMIT = 2000  # characters of a command's output the transcript keeps (its tail)

__all__ = ["OUTPUT_LIMIT", "TOOL_CALL", "Episode", "Turn", "run_episode"]


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

    def tool(self, output: str, tokenizer: PolicyTokenizer) -> None:
        observed = f"\n<output>\n{output[-OUTPUT_LIMIT:]}</output>\n"
        ids = tokenizer.encode(observed)
        self.text += observed
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [self.versions[-1] if self.versions else 0] * len(ids)
        self.tool_mask += [1] * len(ids)
        self.tool_calls += 1


async def run_episode(endpoint: InferenceEndpoint, exec_client: ExecClient, tokenizer: PolicyTokenizer, image: str,
                      prompt_ids: list[int], max_turns: int, sampling: dict[str, Any], user: str) -> Episode:
    """``sampling``: ``generate``'s max_tokens, temperature, top_p (and seed)."""
    episode = Episode()
    session = None
    try:
        for turn_number in range(max_turns):
            [turn] = await endpoint.generate(prompt_ids + episode.token_ids, n=1, user=user, **sampling)
            episode.policy(turn)
            call = TOOL_CALL.search(turn.text)
            if call is None or turn_number == max_turns - 1:
                break
            if session is None:
                session = await exec_client.open_session(image)
            output = await exec_client.run(session, call.group(1), timeout_s=60)
            episode.tool(f"{output.stdout}{output.stderr}[exit {output.exit_code}]\n", tokenizer)
    finally:
        if session is not None:
            await asyncio.shield(exec_client.close_session(session))
    return episode
