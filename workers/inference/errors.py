"""The errors of ``kiln.workers.inference``, under kiln's root ``KilnError``."""

from __future__ import annotations

from kiln.streams.errors import KilnError


class TokenizerError(KilnError):
    """A model directory without a usable tokenizer (no EOS token, not a directory)."""


class PromptTooLong(KilnError):
    """The prompt leaves no room to generate within the model's context."""


class WeightUpdateError(KilnError):
    """A weight transfer did not complete (a server died, timed out or refused); the server keeps its weights."""


class WeightUpdateRejected(WeightUpdateError):
    """The announced tensors do not match the server's parameters (names, shapes, dtypes)."""


class EndpointAnswerError(KilnError):
    """An engine's answer lacks what a rollout needs (token ids, log-probs) or contradicts itself: the server is
    not configured for RL (or not the engine named), and asking again gives the same answer."""
