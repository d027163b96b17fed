"""Weight transfer: process groups made only for it, the server's receiving side, and the trainer's
``WeightBroadcaster``.

The contract (PipelineRL's in-flight weight update; docs/rl.md): a server joins a group with the trainer as
rank 0 (``/init_process_group``); per update the trainer announces the version and the ordered list of tensor
names, shapes and dtypes (``/request_weight_update``) and broadcasts the tensors in exactly that order. The groups
are built on a ``TCPStore`` directly (not ``torch.distributed.init_process_group``), so they never touch a
trainer's own default group, and a group can be rebuilt when a server comes back.

The broadcaster gives each server a group of its own: the trainer and the engine's ranks (1 + k for an engine with
tensor parallelism k, which joins with ranks 1..k: the ``rank_offset``/``world_size`` of vLLM's and SGLang's init
bodies). A server that dies mid-broadcast breaks only its own transfer, the others finish, and it rejoins with a
fresh group the next time it answers. The cost is the trainer sending the weights once per server (one group for
all sends them once; on GPUs with NCCL that matters more than on loopback).

With NCCL the tensors arrive straight into buffers on the model's device; with gloo into CPU buffers (moved to the
model's device, if it has another, when loaded).
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from datetime import timedelta
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from pydantic import BaseModel, Field
from torch import Tensor

from kiln.workers.inference.engine import Engine
from kiln.workers.inference.errors import WeightUpdateError, WeightUpdateRejected

log = logging.getLogger("kiln.inference.weights")

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16,
                                  "bfloat16": torch.bfloat16, "float64": torch.float64}


class InitProcessGroupRequest(BaseModel):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank: int = Field(ge=1, description="the engine's first rank (vLLM's and SGLang's rank_offset): an engine of "
                      "k ranks takes rank .. rank + k - 1; the trainer is rank 0")
    world_size: int = Field(ge=2, description="the trainer and every engine rank in the group")
    backend: Literal["gloo", "nccl"] = "gloo"
    group_name: str = "kiln-weights"
    timeout_s: float = Field(default=60.0, gt=0, le=3600)


class ParameterInfo(BaseModel):
    name: str
    shape: list[int]
    dtype: str


class WeightUpdateRequest(BaseModel):
    version: int = Field(ge=0)
    parameters_info: list[ParameterInfo]
    packed: bool = Field(False, description="kiln's extension: the tensors arrive as one flat buffer per dtype "
                         "(dtypes in order of first appearance, tensors in list order) - one collective instead of "
                         "one per tensor, which costs ~1 ms each")


def packed_buffers(tensors: list[tuple[str, Tensor]]) -> list[Tensor]:
    """The trainer's side of ``packed``: one flat buffer per dtype, in order of first appearance."""
    groups: dict[torch.dtype, list[Tensor]] = {}
    for _name, tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor.reshape(-1))
    return [torch.cat(parts) for parts in groups.values()]


def receive(group: TransferGroup, request: WeightUpdateRequest,
            device: torch.device | None = None) -> dict[str, Tensor]:
    """The announced tensors, as they arrive (fresh buffers on ``device``, the CPU by default; with ``packed``,
    views into one buffer per dtype)."""
    received: dict[str, Tensor] = {}
    if not request.packed:
        for info in request.parameters_info:
            buffer = torch.empty(info.shape, dtype=DTYPES[info.dtype], device=device)
            group.broadcast(buffer)
            received[info.name] = buffer
        return received
    by_dtype: dict[str, list[ParameterInfo]] = {}
    for info in request.parameters_info:
        by_dtype.setdefault(info.dtype, []).append(info)
    for dtype, infos in by_dtype.items():
        sizes = [math.prod(info.shape) for info in infos]
        flat = torch.empty(sum(sizes), dtype=DTYPES[dtype], device=device)
        group.broadcast(flat)
        for info, chunk in zip(infos, torch.split(flat, sizes), strict=True):
            received[info.name] = chunk.view(info.shape)
    return received


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _local_address_towards(host: str) -> str:
    """The address of the interface this machine would use to reach ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))
        return str(probe.getsockname()[0])


class TransferGroup:
    """One member's handle on a weight-transfer group; rank 0 (the trainer) is the source of every broadcast."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, backend: str, timeout_s: float,
                 address: str) -> None:
        self.backend = backend
        timeout = timedelta(seconds=timeout_s)
        self.pg: Any
        if backend == "nccl":
            nccl_options = dist.ProcessGroupNCCL.Options()
            nccl_options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, nccl_options)
        else:
            options = getattr(dist.ProcessGroupGloo, "_Options")()  # noqa: B009 (private in the stubs)
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
            options._timeout = timeout
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, options)
        self.rank = rank

    def broadcast(self, tensor: Tensor) -> None:
        self.pg.broadcast(tensor, 0).wait()


def join_group(request: InitProcessGroupRequest, local_rank: int = 0) -> TransferGroup:
    """The server's side of ``/init_process_group`` for its rank ``local_rank`` (0 for a one-rank engine; each rank
    of a k-rank engine joins with its own, at once): blocks until every member joined (or the timeout)."""
    if not 0 <= local_rank < request.world_size - request.rank:
        raise WeightUpdateRejected(f"local rank {local_rank} from rank {request.rank} is outside a world of "
                                   f"{request.world_size}")
    timeout = timedelta(seconds=request.timeout_s)
    store = dist.TCPStore(request.master_address, request.master_port, is_master=False, timeout=timeout,
                          wait_for_workers=False)
    return TransferGroup(dist.PrefixStore(f"{request.group_name}/", store), request.rank + local_rank,
                         request.world_size, request.backend, request.timeout_s,
                         _local_address_towards(request.master_address))


class WeightReceiver:
    """The server's side of ``/request_weight_update``. With ``staging`` the tensors arrive into fresh buffers while
    decoding goes on, and decoding stops only for the swap; without it, decoding stops while they arrive straight
    into the parameters."""

    def __init__(self, engine: Engine, staging: bool = True) -> None:
        self.engine = engine
        self.staging = staging
        self.group: TransferGroup | None = None
        self._lock = threading.Lock()

    def join(self, request: InitProcessGroupRequest) -> None:
        if request.world_size != request.rank + 1:  # else the rendezvous waits for ranks that never come
            raise WeightUpdateRejected(f"this server is one rank; rank {request.rank} of {request.world_size} "
                                       "leaves ranks nobody joins")
        with self._lock:
            self.group = None
            self.group = join_group(request)

    def update(self, request: WeightUpdateRequest) -> UpdateTimings:
        """Receive and load one update; returns how long decoding stood still and how long the transfer took."""
        with self._lock:
            group = self.group
            if group is None:
                raise WeightUpdateError("no weight-transfer group: POST /init_process_group first")
            problem = self._mismatch(request.parameters_info)
            try:
                if problem:
                    receive(group, request)  # drained, so the trainer's broadcast completes and it hears why
                    raise WeightUpdateRejected(problem)
                started, paused_before = time.perf_counter(), self.engine.paused_s
                # NCCL receives on the model's device; gloo only into CPU memory
                device = self.engine.decoder.device if group.backend == "nccl" else None
                if self.staging:
                    with self.engine.receiving():
                        staged = receive(group, request, device)
                    with self.engine.paused():
                        replaced = self.engine.load(staged, request.version)
                else:
                    with self.engine.paused():
                        replaced = self.engine.load(receive(group, request, device), request.version)
                del replaced  # the old weights are freed here, with decoding running
                return UpdateTimings(version=request.version,
                                     paused_ms=(self.engine.paused_s - paused_before) * 1000,
                                     transfer_ms=(time.perf_counter() - started) * 1000)
            except RuntimeError as e:  # a member died or the timeout passed: this group is unusable now
                self.group = None
                raise WeightUpdateError(f"weight transfer for version {request.version} failed: {e}") from None

    def _mismatch(self, infos: list[ParameterInfo]) -> str:
        params = dict(self.engine.model.named_parameters())
        for info in infos:
            param = params.get(info.name)
            if param is None:
                return f"unknown parameter {info.name!r}"
            if info.dtype not in DTYPES:
                return f"{info.name}: unsupported dtype {info.dtype!r} (one of {sorted(DTYPES)})"
            if list(param.shape) != info.shape:  # a dtype may differ: ``Engine.load`` casts
                return f"{info.name}: announced {info.shape}, the server has {list(param.shape)}"
        return ""


class UpdateTimings(BaseModel):
    """A server's answer to ``/request_weight_update`` (kiln's server; other engines answer less)."""

    version: int
    paused_ms: float = Field(description="how long decoding stood still for this update")
    transfer_ms: float = Field(description="from the first tensor awaited to the new weights in use")


class UpdateReport(BaseModel):
    version: int
    updated: list[str]
    failed: dict[str, str]
    timings: dict[str, UpdateTimings] = Field(default_factory=dict, description="per server, where it says")


class WeightBroadcaster:
    """The trainer's side: ``connect()`` makes a group with every endpoint, ``update(model, version)`` announces
    and broadcasts to all of them at once. An endpoint that fails is reported in the ``UpdateReport`` and left out
    until it answers again; it then gets a fresh group and the full weights with the next update. ``ranks`` gives,
    per endpoint url, how many ranks its engine joins with (its tensor parallelism; 1 where not named)."""

    def __init__(self, endpoints: Iterable[WeightEndpoint], master_address: str = "127.0.0.1",
                 master_port: int = 0, backend: Literal["gloo", "nccl"] = "gloo", timeout_s: float = 60.0,
                 ranks: Mapping[str, int] | None = None) -> None:
        self.endpoints = list(endpoints)
        self.ranks = dict(ranks or {})
        self.master_address = master_address
        self.backend = backend
        self.timeout_s = timeout_s
        self.store = dist.TCPStore(master_address, master_port, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout_s))
        self.master_port = self.store.port
        self._groups: dict[str, TransferGroup] = {}
        self._pool = ThreadPoolExecutor(max_workers=3 * max(1, len(self.endpoints)),
                                        thread_name_prefix="kiln-weights")

    def connect(self) -> dict[str, str]:
        """Join every endpoint not in a group yet; returns the ones that could not join, with why."""
        failures: dict[str, str] = {}
        futures = {e.url: self._pool.submit(self._join, e) for e in self.endpoints if e.url not in self._groups}
        for url, fut in futures.items():
            try:
                self._groups[url] = fut.result()
            except Exception as e:
                failures[url] = f"{type(e).__name__}: {e}"
        return failures

    def _join(self, endpoint: WeightEndpoint) -> TransferGroup:
        endpoint.health()  # a server that is down fails here, before any rendezvous waits for it
        name = f"kiln-weights/{uuid.uuid4().hex[:12]}"
        world = 1 + self.ranks.get(endpoint.url, 1)
        request = InitProcessGroupRequest(master_address=self.master_address, master_port=self.master_port,
                                          rank=1, world_size=world, backend=self.backend, group_name=name,
                                          timeout_s=self.timeout_s)
        answer = self._pool.submit(endpoint.init_process_group, request)
        group = self._pool.submit(TransferGroup, dist.PrefixStore(f"{name}/", self.store), 0, world, self.backend,
                                  self.timeout_s, self.master_address)
        pending: list[Future[Any]] = [answer, group]
        wait(pending, timeout=self.timeout_s + 5, return_when=FIRST_EXCEPTION)
        if answer.done() and answer.exception() is not None:
            raise WeightUpdateError(f"{endpoint.url} refused to join: {answer.exception()}")
        try:
            joined = group.result(0)
        except Exception as e:
            raise WeightUpdateError(f"{endpoint.url} did not join the weight group: {e}") from None
        answer.result(self.timeout_s)
        return joined

    def update(self, named: Iterable[tuple[str, Tensor]], version: int) -> UpdateReport:
        tensors = [(name, t.detach().contiguous()) for name, t in named]
        infos = [ParameterInfo(name=n, shape=list(t.shape), dtype=dtype_name(t.dtype)) for n, t in tensors]
        packed = packed_buffers(tensors) if any(e.packs for e in self.endpoints) else []
        failed = self.connect()
        sends = {}
        for url, group in list(self._groups.items()):
            packs = self._endpoint(url).packs
            request = WeightUpdateRequest(version=version, parameters_info=infos, packed=packs)
            sends[url] = self._pool.submit(self._send, url, group, request, packed if packs else
                                           [t for _n, t in tensors])
        updated, timings = [], {}
        for url, fut in sends.items():
            try:
                answer = fut.result()
                updated.append(url)
                if answer is not None:
                    timings[url] = answer
            except Exception as e:
                self._groups.pop(url, None)
                failed[url] = f"{type(e).__name__}: {e}"
                log.warning("weight update %d to %s failed: %s", version, url, e)
        return UpdateReport(version=version, updated=updated, failed=failed, timings=timings)

    def _endpoint(self, url: str) -> WeightEndpoint:
        return next(e for e in self.endpoints if e.url == url)

    def _send(self, url: str, group: TransferGroup, request: WeightUpdateRequest,
              tensors: list[Tensor]) -> UpdateTimings | None:
        answer: Future[UpdateTimings | None] = self._pool.submit(self._endpoint(url).request_weight_update, request)
        try:
            for tensor in tensors:
                if answer.done():  # refused before the transfer finished: the server drains, we stop
                    break
                group.broadcast(tensor)
        except RuntimeError as e:
            raise WeightUpdateError(f"broadcast to {url} failed: {e}") from None
        return answer.result(self.timeout_s)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._groups.clear()


class WeightEndpoint(Protocol):
    """What the broadcaster needs of a server (``kiln.workers.inference.endpoints`` implements it per engine).
    Both calls block until the server's side is done."""

    url: str
    packs: bool  # takes kiln's ``packed`` transfer (one flat buffer per dtype)

    def init_process_group(self, request: InitProcessGroupRequest) -> None: ...

    def request_weight_update(self, request: WeightUpdateRequest) -> UpdateTimings | None: ...

    def health(self) -> dict[str, Any]: ...
