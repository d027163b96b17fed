"""Models of the RL loop: a rollout request (one prompt group), the rollout group it becomes on ``rollouts``, the
update a trainer step publishes on ``policy.updates``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class RolloutTask(BaseModel):
    """A prompt and what its verifier needs: ``verifier`` names one (built in: ``exact_match`` — the number a
    completion starts with equals ``answer``; ``exec``; ``lean``; or a ``kiln.verifiers`` entry point), ``check``
    is what that verifier reads (see ``kiln.workers.verifiers``)."""

    model_config = ConfigDict(extra="forbid")

    task_id: str = Field(min_length=1, max_length=256)
    prompt: str = Field(max_length=100_000)
    answer: str = Field("", max_length=100_000)
    verifier: str = Field("exact_match", pattern=r"^[a-z][a-z0-9_.-]{0,63}$")
    check: dict[str, Any] = Field(default_factory=dict)
    max_turns: int = Field(1, ge=1, le=64, description="model turns per sample; between turns, a ``<run>command"
                                                         "</run>`` in the model's text runs in the sample's own exec "
                                                         "session on ``check['image']`` and its output is appended")


class Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n: int = Field(8, ge=1, le=64, description="samples in the group")
    max_tokens: int = Field(16, ge=1, le=32_768)
    temperature: float = Field(1.0, ge=0, le=10)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, description="seeds the group's sampling (the same seed, prompt and "
                                                      "weights on one engine give the same samples); None: unseeded")


class RolloutRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: RolloutTask
    sampling: Sampling = Field(default_factory=Sampling)
    actor_version: int = Field(0, ge=0, description="the trainer's latest version the actor had seen")


class RolloutSample(BaseModel):
    """One completion: what the sampler produced, token by token, and what the verifier said. ``token_ids`` are the
    completion's ids after the group's ``prompt_ids``: every turn's sampled tokens and, between turns, the tools'
    output tokens (marked in ``tool_mask``)."""

    model_config = ConfigDict(extra="forbid")

    text: str
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int] = Field(description="policy version that produced each token")
    finish_reason: str
    reward: float
    verifier: dict[str, Any] = Field(default_factory=dict)
    turns: int = 1
    tool_mask: list[int] = Field(default_factory=list, description="1 where a token is a tool's output (not the "
                                                                   "policy's, so not trained on); empty: none")


class RolloutGroup(BaseModel):
    """The samples of one prompt, as the trainer reads them from ``rollouts``."""

    model_config = ConfigDict(extra="forbid")

    task_id: str
    prompt: str
    prompt_ids: list[int] = Field(default_factory=list, description="the prompt as the sampler saw it: tokenised "
                                                                   "once with the model's tokenizer (and chat "
                                                                   "template); empty only in groups written before "
                                                                   "it was carried")
    samples: list[RolloutSample]
    version_start: int
    version_end: int
    actor_version: int
    endpoint: str
    generate_s: float
    verify_s: float


class PolicyUpdate(BaseModel):
    """One event on ``policy.updates``: a trainer step done (its version, checkpoint and figures) and the weights
    it sent to the inference servers."""

    version: int
    checkpoint: str
    groups: int
    groups_total: int = Field(description="groups trained on since the first step (carried in the checkpoint)")
    samples: int
    reward_mean: float
    loss: float
    entropy: float
    step_s: float
    lag_mean: float = Field(description="versions between the one a sample started with and this step's")
    lag_max: int
    lag_histogram: dict[int, int] = Field(default_factory=dict, description="samples per lag in versions")
    servers_updated: int
    servers_failed: dict[str, str]
    paused_ms: float = Field(0.0, description="the longest pause of decoding on a server for this update")
    parent: str = Field("", description="the checkpoint this step started from")
    ranges: dict[int, tuple[int, int]] = Field(default_factory=dict,
                                               description="rollouts partition -> [first, end) offsets trained on")
