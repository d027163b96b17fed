"""OpenRLHF's remote reward model (``--remote_rm_url http://GATEWAY:8500/openrlhf/reward``) served by kiln's
``verify`` stage: every query of a request is checked against its label's task, the groups (one per distinct task)
in one verify request; a query kiln could not judge gets its group's mean of real verdicts
(``kiln.integrations.trainers.openrlhf``: OpenRLHF has no per-sample "no reward"), flagged in
``extra_logs.kiln_failed``."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request

from kiln.integrations.trainers.openrlhf import RewardRequest, RewardResponse, rewards
from kiln.workers.verify.client import VerifyClient

router = APIRouter(tags=["openrlhf"])


@router.post("/openrlhf/reward")
async def reward(body: RewardRequest, request: Request) -> RewardResponse:
    try:
        return await rewards(VerifyClient(request.app.state.kiln), body, request.app.state.groups)
    except ValueError as e:  # mismatched lists, a label that is no task
        raise HTTPException(400, str(e)) from None
