"""``InferenceEndpoint``: the one way actors and trainers reach an inference server, whatever serves it.

Completions go through the OpenAI routes every engine has; the weight-update contract maps onto each engine's own
routes: ``KilnEndpoint`` (``kiln rl serve``), ``SGLangEndpoint``, ``VLLMEndpoint``. The request shapes of the last two
are checked against the engines' own wheels (tests/workers/inference/test_adapters.py).
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


class HttpEndpoint:
    """What every engine shares: OpenAI completions, a health route, JSON admin calls with a bearer token."""

    packs = False
    health_path = "/health"

    def __init__(self, url: str, admin_token: str = "", admin_url: str | None = None, timeout_s: float = 120.0,
                 model: str = "") -> None:
        self.url = url.rstrip("/")
        self.admin_url = (admin_url or url).rstrip("/")
        self.model = model
        self._headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._timeout = timeout_s
        self._async: httpx.AsyncClient | None = None
        self._sync: httpx.Client | None = None

    def _admin(self, route: str, body: dict[str, Any] | None) -> dict[str, Any]:
        if self._sync is None:  # one per endpoint: a client per call built an SSL context each step (py-spy)
            self._sync = httpx.Client(timeout=self._timeout)
        try:
            answer = self._sync.post(f"{self.admin_url}{route}", json=body, headers=self._headers)
        except httpx.HTTPError as e:
            raise WeightUpdateError(f"{self.admin_url}{route}: {type(e).__name__}: {e}") from None
        if answer.status_code == 400:
            raise WeightUpdateRejected(f"{self.admin_url}{route}: {answer.text}")
        if answer.status_code != 200:
            raise WeightUpdateError(f"{self.admin_url}{route}: HTTP {answer.status_code}: {answer.text}")
        result: dict[str, Any] = answer.json() if answer.content else {}
        if result.get("success") is False:  # SGLang answers 200 with success: false for some refusals
            raise WeightUpdateRejected(f"{self.admin_url}{route}: {result.get('message')}")
        return result

    async def complete(self, prompt: str, **sampling: Any) -> dict[str, Any]:
        """One ``/v1/completions`` call; ``sampling`` holds OpenAI's fields (max_tokens, temperature, n, ...)."""
        if self._async is None:
            # Every request in flight keeps its connection: past httpx's default 20 kept alive, each completion
            # beyond them opened and closed a connection.
            self._async = httpx.AsyncClient(timeout=self._timeout, limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=None))
        answer = await self._async.post(f"{self.url}/v1/completions",
                                        json={"model": self.model, "prompt": prompt, **sampling})
        answer.raise_for_status()
        result: dict[str, Any] = answer.json()
        return result

    def health(self) -> dict[str, Any]:
        answer = httpx.get(f"{self.url}{self.health_path}", timeout=10)
        answer.raise_for_status()
        result: dict[str, Any] = answer.json() if answer.content else {}
        return result


class KilnEndpoint(HttpEndpoint):
    """kiln's server (``kiln rl serve``). ``admin_url`` when the weight-update routes are on a separate (private)
    address."""

    packs = True
    health_path = "/healthz"

    def __init__(self, url: str, admin_token: str = "", admin_url: str | None = None, timeout_s: float = 120.0,
                 model: str = "kiln-tiny") -> None:
        super().__init__(url, admin_token, admin_url, timeout_s, model)

    def init_process_group(self, request: InitProcessGroupRequest) -> None:
        self._admin("/init_process_group", request.model_dump())

    def request_weight_update(self, request: WeightUpdateRequest) -> UpdateTimings:
        return UpdateTimings.model_validate(self._admin("/request_weight_update", request.model_dump()))


class SGLangEndpoint(HttpEndpoint):
    """SGLang's distributed weight update (checked against sglang 0.5.23's ``io_struct``): the group joins through
    ``/init_weights_update_group``, each update is one ``/update_weights_from_distributed`` that blocks while the
    trainer broadcasts in the announced order. SGLang builds its group with torch's rendezvous (``tcp://`` on the
    trainer's store, prefix ``<group_name>/``) — the layout ``WeightBroadcaster`` uses."""

    @staticmethod
    def init_body(request: InitProcessGroupRequest) -> dict[str, Any]:
        return {"master_address": request.master_address, "master_port": request.master_port,
                "rank_offset": request.rank, "world_size": request.world_size, "group_name": request.group_name,
                "backend": request.backend}

    def __init__(self, url: str, admin_token: str = "", admin_url: str | None = None, timeout_s: float = 300.0,
                 model: str = "", group_name: str = "weight_update_group") -> None:
        super().__init__(url, admin_token, admin_url, timeout_s, model)
        self._group_name = group_name

    def update_body(self, request: WeightUpdateRequest) -> dict[str, Any]:
        infos = request.parameters_info
        return {"names": [i.name for i in infos], "dtypes": [i.dtype for i in infos],
                "shapes": [i.shape for i in infos], "group_name": self._group_name,
                "weight_version": str(request.version)}

    def init_process_group(self, request: InitProcessGroupRequest) -> None:
        self._group_name = request.group_name
        self._admin("/init_weights_update_group", self.init_body(request))

    def request_weight_update(self, request: WeightUpdateRequest) -> None:
        self._admin("/update_weights_from_distributed", self.update_body(request))


class VLLMEndpoint(HttpEndpoint):
    """vLLM's native weight transfer (checked against vllm 0.33.0: ``vllm/entrypoints/rl/online/api_router.py``,
    server started with ``--weight-transfer-config '{"backend": "nccl"}'``): ``/init_weight_transfer_engine`` once,
    then per update ``/start_weight_update``, ``/update_weights`` (blocks while the trainer broadcasts) and
    ``/finish_weight_update`` with the version. vLLM's transfer is NCCL only, and its workers rendezvous through
    vLLM's ``StatelessProcessGroup`` (or an NCCL unique id): the trainer's side of that needs a GPU and is not part of
    ``WeightBroadcaster`` — this adapter carries the control plane."""

    @staticmethod
    def init_body(request: InitProcessGroupRequest) -> dict[str, Any]:
        if request.backend != "nccl":
            raise WeightUpdateRejected("vLLM's weight transfer is NCCL only")
        return {"init_info": {"master_address": request.master_address, "master_port": request.master_port,
                              "rank_offset": request.rank, "world_size": request.world_size}}

    @staticmethod
    def update_calls(request: WeightUpdateRequest) -> list[tuple[str, dict[str, Any] | None]]:
        infos = request.parameters_info
        update = {"names": [i.name for i in infos], "dtype_names": [i.dtype for i in infos],
                  "shapes": [i.shape for i in infos]}
        return [("/start_weight_update", None), ("/update_weights", {"update_info": update}),
                ("/finish_weight_update", {"weight_version": str(request.version)})]

    def init_process_group(self, request: InitProcessGroupRequest) -> None:
        self._admin("/init_weight_transfer_engine", self.init_body(request))

    def request_weight_update(self, request: WeightUpdateRequest) -> None:
        for route, body in self.update_calls(request):
            self._admin(route, body)
