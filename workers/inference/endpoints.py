"""``InferenceEndpoint``: the one way actors and trainers reach an inference server, whatever serves it.

Completions go through the OpenAI routes every engine has; the weight-update contract maps onto each engine's own
routes. ``KilnEndpoint`` speaks kiln's server (``kiln rl serve``).
"""

from __future__ import annotations

from typing import Any, Protocol

import httpx

from kiln.workers.inference.weights import (
    InitProcessGroupRequest,
    UpdateTimings,
    WeightUpdateError,
    WeightUpdateRejected,
    WeightUpdateRequest,
)


class InferenceEndpoint(Protocol):
    url: str
    packs: bool

    def init_process_group(self, request: InitProcessGroupRequest) -> None: ...

    def request_weight_update(self, request: WeightUpdateRequest) -> UpdateTimings | None: ...

    async def complete(self, prompt: str, **sampling: Any) -> dict[str, Any]: ...

    def health(self) -> dict[str, Any]: ...


class KilnEndpoint:
    """kiln's server. ``admin_url`` when the weight-update routes are on a separate (private) address."""

    packs = True

    def __init__(self, url: str, admin_token: str = "", admin_url: str | None = None, timeout_s: float = 120.0,
                 model: str = "kiln-tiny") -> None:
        self.url = url.rstrip("/")
        self.admin_url = (admin_url or url).rstrip("/")
        self.model = model
        self._headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._timeout = timeout_s
        self._async: httpx.AsyncClient | None = None

    def _admin(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            answer = httpx.post(f"{self.admin_url}{route}", json=body, headers=self._headers, timeout=self._timeout)
        except httpx.HTTPError as e:
            raise WeightUpdateError(f"{self.admin_url}{route}: {type(e).__name__}: {e}") from None
        if answer.status_code == 400:
            raise WeightUpdateRejected(f"{self.admin_url}{route}: {answer.text}")
        if answer.status_code != 200:
            raise WeightUpdateError(f"{self.admin_url}{route}: HTTP {answer.status_code}: {answer.text}")
        result: dict[str, Any] = answer.json()
        return result

    def init_process_group(self, request: InitProcessGroupRequest) -> None:
        self._admin("/init_process_group", request.model_dump())

    def request_weight_update(self, request: WeightUpdateRequest) -> UpdateTimings:
        return UpdateTimings.model_validate(self._admin("/request_weight_update", request.model_dump()))

    async def complete(self, prompt: str, **sampling: Any) -> dict[str, Any]:
        """One ``/v1/completions`` call; ``sampling`` holds OpenAI's fields (max_tokens, temperature, n, ...)."""
        if self._async is None:
            self._async = httpx.AsyncClient(timeout=self._timeout)
        answer = await self._async.post(f"{self.url}/v1/completions",
                                        json={"model": self.model, "prompt": prompt, **sampling})
        answer.raise_for_status()
        result: dict[str, Any] = answer.json()
        return result

    def health(self) -> dict[str, Any]:
        answer = httpx.get(f"{self.url}/healthz", timeout=10)
        answer.raise_for_status()
        result: dict[str, Any] = answer.json()
        return result
