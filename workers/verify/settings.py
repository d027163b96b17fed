"""Settings of the ``verify`` stage and of its clients, ``KILN_VERIFY_*``: what a worker's verifiers keep in flight,
how long a client retries what kiln failed to judge before it reports "no reward", and how long an adapter that
imputes a group's mean waits for the group."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class VerifySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KILN_VERIFY_", extra="ignore")

    exec_calls: int = Field(8, ge=1, description="Exec run_once calls a worker's verifiers keep in flight.")
    exec_batch_groups: int = Field(32, ge=1, description="Requests one exec checker call may verify together.")
    exec_batch_window_s: float = Field(0.02, ge=0, description="How long a request waits for others to share its "
                                                                "checker call.")
    retry_attempts: int = Field(3, ge=1, description="Checks a client makes of a completion kiln failed to judge "
                                                     "(sandbox, checker, worker or stage failed), each a new request "
                                                     "(another verify worker, exec worker and runner), before it "
                                                     "reports it without a reward; 1: no retry.")
    retry_budget_s: float = Field(60.0, gt=0, description="How long after its first answer a client may still "
                                                          "retry: keep it under the trainer's own reward timeout "
                                                          "(OpenRLHF's remote reward model: 180 s).")
    retry_backoff_s: float = Field(1.0, ge=0, description="The wait before the first retry; it doubles after each.")
    group_wait_s: float = Field(30.0, gt=0, description="Where a trainer has no per-sample \"no reward\" (verl, "
                                                        "OpenRLHF) and kiln gives an unjudged completion its group's "
                                                        "mean: how long it waits for the rest of its group.")
