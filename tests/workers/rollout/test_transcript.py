"""A multi-turn sample's transcript, read directly (workers/rollout/episodes.py): what the policy wrote is trained
on, what the tools printed is masked out, a long output keeps its tail, and the answer is the last turn."""

from __future__ import annotations

from kiln.workers.inference.endpoints import Turn
from kiln.workers.inference.tokenizer import TOKENIZER
from kiln.workers.rollout.episodes import OUTPUT_LIMIT, TOOL_CALL, Episode


def _turn(text: str, version: int, finish: str = "stop") -> Turn:
    ids = TOKENIZER.encode(text)
    return Turn(text, ids, [-0.5] * len(ids), [version] * len(ids), finish)


def test_policy_tokens_are_trained_on_and_tool_output_is_masked() -> None:
    episode = Episode()
    first = _turn("let me look <run>ls</run>", version=3)
    episode.policy(first)
    episode.tool("a.py\nb.py\n[exit 0]\n", TOKENIZER)
    last = _turn("the answer is 7", version=4)
    episode.policy(last)
    lengths = {len(episode.token_ids), len(episode.logprobs), len(episode.versions), len(episode.tool_mask)}
    assert len(lengths) == 1  # one entry per token in every column
    observed = TOKENIZER.encode("\n<output>\na.py\nb.py\n[exit 0]\n</output>\n")
    assert episode.tool_mask == [0] * len(first.token_ids) + [1] * len(observed) + [0] * len(last.token_ids)
    masked = [t for t, m in zip(episode.token_ids, episode.tool_mask, strict=True) if m]
    assert masked == observed and set(episode.logprobs[len(first.token_ids):-len(last.token_ids)]) == {0.0}
    # Tool tokens carry the version of the policy turn before them.
    assert episode.versions == [3] * (len(first.token_ids) + len(observed)) + [4] * len(last.token_ids)
    assert (episode.answer, episode.finish_reason, episode.turns, episode.tool_calls) == ("the answer is 7", "stop",
                                                                                           2, 1)
    assert TOKENIZER.decode(episode.token_ids) == episode.text


def test_a_long_output_keeps_its_tail_and_a_tool_call_is_found_in_the_text() -> None:
    episode = Episode()
    episode.tool("x" * 5000 + "END", TOKENIZER)
    kept = episode.text.removeprefix("\n<output>\n").removesuffix("</output>\n")
    assert len(kept) == OUTPUT_LIMIT and kept.endswith("END")
    assert episode.versions == [0] * len(episode.token_ids)  # before any policy turn
    call = TOOL_CALL.search("first <run>pytest -q\ntests/</run> then <run>ls</run>")
    assert call is not None and call.group(1) == "pytest -q\ntests/"
