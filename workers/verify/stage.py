"""``verify``: a task and a batch of completions in, one verdict per completion out, from the same verifiers as the
rollout stage (``kiln.workers.verifiers``: ``exact_match``, ``exec``, ``swe``, ``lean``, ``kiln.verifiers`` entry
points). Completions are checked in as few sandboxes as their isolation allows: an ``exec`` checker gets the whole
batch in one ``run_once`` call, and batches of concurrent requests with the same checker share calls (up to
``KILN_VERIFY_EXEC_BATCH_GROUPS``; a lone request goes at once, a flood's batch gathers while requests keep coming);
``swe`` is a call per completion (each patches its own tree); ``lean`` one
elaboration and a tactic run per completion.

A failure is a verdict, never an exception a trainer must handle. The completion's own (its program past its time,
crashed, flooding its output, wrong) is a real verdict of 0 (``policy_failure``); kiln's (a check past its time, a
sandbox that could not run it, an unreadable task, a checker that failed) gives every completion it concerns a
``failure`` and no reward, which the client retries within its budget. What fails the request itself (a bug, a
worker lost for good) reaches the client, whose facade turns it into ``unavailable`` verdicts. Settings
``KILN_VERIFY_*`` (``VerifySettings``).
"""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import time

from prometheus_client import CollectorRegistry, Counter, Histogram

from kiln.schemas.verify import GroupVerdicts, SentTogether, VerifyGroup, VerifyRequest, VerifyResult
from kiln.streams.blobstore import open_blob_store
from kiln.streams.client import KilnClient
from kiln.streams.settings import get_settings
from kiln.streams.stage import JobContext, Stage
from kiln.workers.verifiers import SENT_TOGETHER, Verdict, VerifierContext, Verifiers
from kiln.workers.verify import spec
from kiln.workers.verify.client import VerifySettings

registry = CollectorRegistry()
COMPLETIONS = Counter("kiln_verify_completions_total", "Completions verified, by verifier and failure (none: a "
                      "real verdict).", ["verifier", "failure"], registry=registry)
SECONDS = Histogram("kiln_verify_seconds", "Time to verify one request's batch (a step's request: each group's, from "
                    "the request's start).", ["verifier"], registry=registry)

_verifiers: list[Verifiers] = []


async def setup(slots: int) -> None:
    settings = VerifySettings()
    # Its own client id: results of its exec/Lean requests come back to this process only. The deployment's blob
    # store: a result above KILN_CLAIM_CHECK_BYTES (a checker's or a program's output) comes back as a claim check.
    blobs = await asyncio.to_thread(open_blob_store, get_settings())
    kiln = KilnClient(get_settings(), f"verify.{socket.gethostname()}.{os.getpid()}", blob_store=blobs)
    _verifiers[:] = [Verifiers(VerifierContext(kiln, exec_calls=settings.exec_calls,
                                               exec_batch_groups=settings.exec_batch_groups,
                                               exec_batch_window_s=settings.exec_batch_window_s,
                                               exec_batch_quiet_s=settings.exec_batch_quiet_s,
                                               failures_as_verdicts=True))]


async def teardown() -> None:
    for verifiers in _verifiers:
        await verifiers.close()


def _count(details: dict[str, object], key: str) -> int | None:
    value = details.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def answered(verdict: Verdict, seconds: float) -> dict[str, object]:
    """What the stage sets on a verifier's verdict (``Verifiers.stamped`` applies it with the stamp, in one copy):
    reward 0 with either failure, the failure's reason and the test counts read from its details, the time it
    took."""
    details = verdict.details
    failed = verdict.failure or verdict.policy_failure
    reason = str(details.get("error") or details.get("stage") or "") if failed else ""
    return {"reward": 0.0 if failed else verdict.reward, "reason": reason[:2000], "passed": _count(details, "passed"),
            "failed": _count(details, "failed"), "seconds": seconds}


async def verified(verifiers: Verifiers, request: VerifyRequest, request_id: str) -> VerifyResult:
    """The request's result from ``verifiers``: what a worker answers, and what ``kiln verify rescore`` re-computes
    in process with the verifiers installed where it runs. A step's groups are judged at once, each as a request of
    its own would be (they were sent together: an exec checker's batches take them whole)."""
    groups, started = request.each(), time.perf_counter()
    together = request.sent_together
    if together is None and len(groups) > 1:
        together = SentTogether(id=request_id[:64] or "step", requests=len(groups))

    async def judged(group: VerifyGroup) -> list[Verdict]:
        task = group.task
        verdicts = await verifiers.judge(task, group.completions, request_id)
        elapsed = time.perf_counter() - started
        SECONDS.labels(task.verifier).observe(elapsed)
        out = verifiers.stamped(task, verdicts, [answered(v, elapsed) for v in verdicts])
        for failure, n in collections.Counter(v.failure or "none" for v in out).items():
            COMPLETIONS.labels(task.verifier, failure).inc(n)
        return out

    token = SENT_TOGETHER.set(together)
    try:
        answers = await asyncio.gather(*(judged(g) for g in groups))
    finally:
        SENT_TOGETHER.reset(token)
    elapsed = time.perf_counter() - started
    if request.groups is None:
        task = groups[0].task
        return VerifyResult(task_id=task.task_id, verifier=task.verifier, verdicts=answers[0], verify_s=elapsed)
    return VerifyResult(task_id="", verifier="+".join(sorted({g.task.verifier for g in groups})),
                        verdicts=[v for verdicts in answers for v in verdicts], verify_s=elapsed,
                        groups=[GroupVerdicts(task_id=g.task.task_id, verifier=g.task.verifier, count=len(verdicts))
                                for g, verdicts in zip(groups, answers, strict=True)])


async def handle(request: VerifyRequest, ctx: JobContext) -> VerifyResult:
    return await verified(_verifiers[0], request, ctx.envelope.request_id)


# Waiting on other stages, not computing: many requests per CPU (their sandboxes' CPU is the exec workers').
stage = Stage(spec.verify, handle, job_timeout_s=900, registry=registry, setup=setup, teardown=teardown,
              slots_per_cpu=16)
