"""``verify``: ``verify.requests`` -> one verdict per completion. Unordered: a request is a task and a batch of
completions, checked by the verifiers the rollout stage uses (``kiln.workers.verifiers``), and any worker serves
it."""

from __future__ import annotations

from kiln.schemas.verify import VerifyRequest, VerifyResult
from kiln.streams.stage import WEEK, StageSpec, TopicSpec


def _facets(result: VerifyResult) -> dict[str, str | float]:
    failed = sum(1 for v in result.verdicts if v.failure)
    rewards = [v.reward for v in result.verdicts]
    return {"verifier": result.verifier, "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "failed_fraction": failed / len(rewards) if rewards else 0.0}


RESCORED_TOPIC = "verify.rescored"
"""Where ``kiln verify rescore`` publishes re-computed verdicts (``RescoredRequest``), keyed by the request id."""

verify = StageSpec("verify", "verify.requests", VerifyRequest, VerifyResult,
                   handler="kiln.workers.verify.stage:stage", partitions=16, facets=_facets,
                   extra_topics=(TopicSpec(RESCORED_TOPIC, 4, WEEK),))
