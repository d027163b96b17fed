"""Adapters: kiln's ``verify`` stage in the shapes the trainers teams already run expect (a library, no stage).

- ``verl``: ``KilnRewardManager`` (``verl_manager``: verl's reward-loop manager) and the per-sample
  ``compute_score`` / ``compute_score_batch``.
- ``areal``: ``KilnRLVRWorkflow`` (``areal_workflow``: AReaL's ``RLVRWorkflow`` with kiln's verdict), ``reward_fn``
  (AReaL's signature; its ``AsyncRewardWrapper`` runs it in a process pool) and ``async_reward_fn``.
- ``prime``: a ``verifiers`` task (prime-rl's environments) whose reward is kiln's verdict.
- ``openrlhf``: the request/response models of OpenRLHF's ``--remote_rm_url``; the gateway serves them.
- TRL: ``kiln.integrations.trainers.trl.Verified``.

Every adapter reads the task the same way (``task_of``): a dataset's label/ground truth is a kiln task — a
``RolloutTask``, its dict or JSON (``verifier``, ``check``, ``answer``) — or a plain answer (``exact_match``).

A completion that failed by itself (its program past its time, crashed, flooded its output, printed the wrong thing)
scores 0. One kiln could not judge — its sandbox, checker, worker or a stage failed it, retried first within the
``KILN_VERIFY_RETRY_*`` budget — gets no reward, in its trainer's own form, never a 0 (a 0 would be a wrong
advantage for every sample of its group under GRPO): TRL ``None`` (left out of its group); verl its group's mean of
real verdicts (``KilnRewardManager``; advantage 0); OpenRLHF the same, imputed by the gateway (``groups``); AReaL a
rejected group (``NoReward`` from ``KilnRLVRWorkflow``); prime-rl/``verifiers`` an errored trace (``vf.SandboxError``).
Each module cites the trainer's code that makes it so.

Every verdict names its verifier and version (``CompletionVerdict.verifier``/``version``); each adapter passes them
to the trainer's logs as far as that trainer takes them: verl's reward dict (``kiln_verifier``, ``kiln_version``),
OpenRLHF's ``extra_logs`` (numbers only: ``kiln_version_id``, the version's first 24 bits), and for those whose
reward functions return a bare float (TRL, AReaL, prime-rl) a line on the ``kiln.rewards`` logger the first time a
process sees a verifier version (``note_versions``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
from collections.abc import Iterable
from typing import Any

from kiln.schemas.rl import RolloutTask
from kiln.schemas.verify import CompletionVerdict
from kiln.streams.settings import KilnSettings
from kiln.workers.verify.client import BlockingVerifyClient

_lock = threading.Lock()
_shared: dict[int, BlockingVerifyClient] = {}
_settings: list[KilnSettings] = []
log = logging.getLogger("kiln.rewards")
_seen_versions: set[tuple[str, str]] = set()


def note_versions(verdicts: Iterable[CompletionVerdict]) -> None:
    """Log (``kiln.rewards``, INFO) each verifier version this process has not seen before: a trainer whose reward
    functions return bare floats still records in its log which verifier versions scored its rewards."""
    for v in verdicts:
        if v.version and (v.verifier, v.version) not in _seen_versions:  # an unavailable verdict has none
            with _lock:
                _seen_versions.add((v.verifier, v.version))
            log.info("rewards scored by verifier %s version %s", v.verifier, v.version)


def version_id(version: str) -> float:
    """A verifier version as a number (its first 24 bits; exact in a float32), for loggers that take numbers only;
    0 for none."""
    try:
        return float(int(version[:6], 16)) if version else 0.0
    except ValueError:
        return 0.0


def configure(settings: KilnSettings | None) -> None:
    """The settings the adapters' clients use in this process and its forks (default: ``KILN_*`` variables);
    closes this process's client, the next call makes one with them."""
    with _lock:
        _settings[:] = [settings] if settings is not None else []
        client = _shared.pop(os.getpid(), None)
        _shared.clear()
    if client is not None:
        client.close()


def shared_client() -> BlockingVerifyClient:
    """This process's client (settings from ``KILN_*``), made on first use; a forked child (AReaL's reward process
    pool) makes its own."""
    pid = os.getpid()
    with _lock:
        if pid not in _shared:
            _shared.clear()  # a parent's client is not usable in a fork
            _shared[pid] = BlockingVerifyClient(_settings[0] if _settings else None)
        return _shared[pid]


def task_of(label: Any, prompt: str = "") -> RolloutTask:
    """A kiln task from a dataset's label: a ``RolloutTask``, a dict or a JSON object of one (``task_id`` and
    ``prompt`` may be left out), or anything else as the expected answer of ``exact_match``."""
    if isinstance(label, RolloutTask):
        return label
    if isinstance(label, str) and label.lstrip().startswith("{"):
        with contextlib.suppress(ValueError):
            label = json.loads(label)
    if isinstance(label, dict):
        fields = {"prompt": prompt[:100_000], **label}
        fields.setdefault("task_id", "kiln-" + hashlib.sha256(
            json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16])
        return RolloutTask.model_validate(fields)
    answer = "" if label is None else str(label)
    return RolloutTask(task_id="answer-" + hashlib.sha256(answer.encode()).hexdigest()[:16], prompt=prompt[:100_000],
                       answer=answer)
