"""Continuous batching on one thread: requests join the running batch between decode steps, finished sequences
leave it, and a weight update swaps the parameters between two steps without restarting anything.

Every sampled token records the policy version of the weights that produced it. A sequence keeps its KV cache
across an update (PipelineRL's in-flight update): positions computed by the old weights stay, new positions come
from the new ones.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch
from prometheus_client import Counter, Gauge, Histogram
from torch import Tensor, nn

from kiln.workers.inference.errors import PromptTooLong
from kiln.workers.inference.model import TOKENIZER, TinyDecoder, TinyLM, token_logprobs
from kiln.workers.inference.tokenizer import PolicyTokenizer

log = logging.getLogger("kiln.inference")
TOKENS = Counter("kiln_inference_generated_tokens_total", "Tokens sampled.")
STEPS = Counter("kiln_inference_decode_steps_total", "Decode steps (one token for every running sequence).")
RUNNING = Gauge("kiln_inference_running_sequences", "Sequences in the running batch.")
WAITING = Gauge("kiln_inference_waiting_sequences", "Sequences waiting for a batch slot.")
VERSION = Gauge("kiln_inference_policy_version", "Policy version of the weights decoding now.")
RECEIVING = Counter("kiln_inference_receiving_seconds_total", "Time weights arrived into a staging buffer while "
                    "decoding went on.")
TOKENS_RECEIVING = Counter("kiln_inference_tokens_while_receiving_total", "Tokens sampled while weights arrived.")
PAUSES = Histogram("kiln_inference_pause_seconds", "Time decoding stood still for one weight update.",
                   buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0
    ignore_eos: bool = False


@dataclass
class Generation:
    """One sequence: its prompt, what was sampled, and with which policy versions."""

    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    version_start: int = -1
    version_end: int = -1
    finish_reason: str = ""
    text: str = ""
    slot: int = -1
    done: Future[Generation] = field(default_factory=Future)
    shares: object | None = None  # generations submitted together on one prompt (``submit_many``) share a token


def sample_token(logits: Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[int, Tensor]:
    """The next token from one sequence's logits, and the log-probs of the distribution it was drawn from."""
    logprobs = token_logprobs(logits, params.temperature)
    if params.temperature <= 0:
        return int(torch.argmax(logprobs)), logprobs
    probs = logprobs.exp()
    if params.top_p < 1.0:
        ordered, order = probs.sort(descending=True)
        outside = ordered.cumsum(0) - ordered > params.top_p  # keep the smallest prefix reaching top_p
        probs = probs.clone()
        probs[order[outside]] = 0.0
    return int(torch.multinomial(probs, 1, generator=generator)), logprobs


class Decoder(Protocol):
    """A model as the engine runs it, with a KV cache of one slot per running sequence (``model.TinyDecoder``,
    ``hf_engine.HFDecoder``). Called from the engine's thread only."""

    model: nn.Module  # whose parameters a weight update replaces
    max_len: int  # prompt and completion together, at most
    start: list[int]  # what an empty prompt becomes
    eos_ids: frozenset[int]  # the model's own end tokens, besides its tokenizer's EOS (a chat model may have more)
    device: torch.device

    def prefill(self, slot: int, prompt: list[int]) -> Tensor:
        """Fill ``slot``'s cache with ``prompt``; the logits of the token after it [vocab]."""
        ...

    def decode(self, slots: list[int], tokens: list[int]) -> Tensor:
        """Append each slot's newest token to its cache; the logits of the next one [len(slots), vocab]."""
        ...

    def copy(self, source: int, slots: list[int]) -> None:
        """Give each of ``slots`` ``source``'s cache (its positions and their count): a prompt prefilled once."""
        ...


class Engine:
    """Owns the model and its KV cache; only its thread runs the model (``submit`` and ``paused`` are the ways in).
    ``model`` is kiln's TinyLM (character tokenizer) or a ``Decoder`` with its ``tokenizer``."""

    def __init__(self, model: TinyLM | Decoder, max_batch: int = 64, version: int = 0,
                 tokenizer: PolicyTokenizer = TOKENIZER) -> None:
        self.decoder: Decoder = TinyDecoder(model, max_batch) if isinstance(model, TinyLM) else model
        self.model = self.decoder.model
        self.tokenizer = tokenizer
        self.eos_ids = self.decoder.eos_ids | {tokenizer.eos_id}
        self.max_batch = max_batch
        self.version = version
        self._free = list(range(max_batch - 1, -1, -1))
        self._waiting: list[Generation] = []
        self._running: dict[int, Generation] = {}
        self._wake = threading.Condition()
        self._pause_requests = 0
        self._parked = threading.Event()
        self._stopping = False
        self.paused_s = 0.0
        self.receiving_s = 0.0  # time weights were arriving into a staging buffer while decoding went on
        self.tokens_while_receiving = 0
        self._receiving = 0
        self.decode_steps = 0
        self.prefills = 0  # prompts run through the model (those sharing one, once)
        self.tokens_generated = 0
        VERSION.set(version)
        self._thread = threading.Thread(target=self._main, name="kiln-inference-engine", daemon=True)
        self._thread.start()

    # ---- the ways in --------------------------------------------------------------------------------------

    def submit(self, prompt: list[int], params: SamplingParams) -> Future[Generation]:
        return self.submit_many(prompt, [params])[0]

    def submit_many(self, prompt: list[int], params: list[SamplingParams]) -> list[Future[Generation]]:
        """A sequence per ``params`` on the one ``prompt`` (a group's samples, OpenAI's ``n``): the prompt is
        prefilled once for those admitted together and its cache copied into their slots; each samples with its
        own generator from the same logits, so every sequence is what ``submit`` alone would have sampled."""
        if len(prompt) == 0:
            prompt = list(self.decoder.start)
        if len(prompt) >= self.decoder.max_len:
            raise PromptTooLong(f"prompt of {len(prompt)} tokens; the model's context is {self.decoder.max_len}")
        shared = object() if len(params) > 1 else None
        generations = []
        for p in params:
            generator = torch.Generator(self.decoder.device)
            if p.seed is None:
                generator.seed()
            else:
                generator.manual_seed(p.seed)
            generations.append(Generation(prompt=prompt, params=p, generator=generator, shares=shared))
        with self._wake:
            self._waiting += generations
            WAITING.set(len(self._waiting))
            self._wake.notify()
        return [g.done for g in generations]

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Decoding stands still inside this block (between two steps; sequences keep their state). The time it
        stood still is counted in ``paused_s`` and ``kiln_inference_pause_seconds``."""
        with self._wake:
            self._pause_requests += 1
            self._wake.notify()
        self._parked.wait()
        started = time.perf_counter()
        try:
            yield
        finally:
            stood = time.perf_counter() - started
            self.paused_s += stood
            PAUSES.observe(stood)
            with self._wake:
                self._pause_requests -= 1
                if self._pause_requests == 0:
                    self._parked.clear()
                self._wake.notify_all()

    @contextlib.contextmanager
    def receiving(self) -> Iterator[None]:
        """Weights arrive (into a staging buffer) while decoding goes on: the time and the tokens decoded meanwhile
        are counted, so a slowdown from the transfer shows in ``kiln_inference_tokens_while_receiving_total``."""
        self._receiving += 1
        started = time.perf_counter()
        try:
            yield
        finally:
            took = time.perf_counter() - started
            self.receiving_s += took
            RECEIVING.inc(took)
            self._receiving -= 1

    def load(self, tensors: dict[str, Tensor], version: int) -> list[Tensor]:
        """Swap in received parameters (call inside ``paused``): the staged tensors become the parameters (cast to
        the parameter's dtype and moved to its device where they differ: a trainer may send float32 to a bfloat16
        server). Returns the replaced ones, for the caller to drop after resuming (freeing 400 MB took ~20 ms of
        the pause)."""
        params = dict(self.model.named_parameters())
        replaced = []
        with torch.no_grad():
            for name, tensor in tensors.items():
                param = params[name]
                replaced.append(param.data)
                param.data = tensor.to(device=param.device, dtype=param.dtype)
        self.set_version(version)
        return replaced

    def set_version(self, version: int) -> None:
        self.version = version
        VERSION.set(version)

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        self._thread.join(10)

    @property
    def running(self) -> int:
        return len(self._running)

    # ---- the engine thread ----------------------------------------------------------------------------------

    def _main(self) -> None:
        torch.set_num_threads(1)
        with torch.inference_mode():
            while True:
                with self._wake:
                    while not self._stopping and (self._pause_requests or not (self._waiting or self._running)):
                        if self._pause_requests:
                            self._parked.set()
                        self._wake.wait()
                    if self._stopping:
                        break
                    admitted = [self._waiting.pop(0) for _ in range(min(len(self._waiting), len(self._free)))]
                    WAITING.set(len(self._waiting))
                try:
                    self._prefill(admitted)
                    if self._running:
                        self._step()
                except Exception as e:  # a bug or bad weights must fail these requests, not hang every later one
                    log.exception("decode step failed; failing the %d running sequences", len(self._running))
                    self._fail_running(e, admitted)
        for generation in [*self._waiting, *self._running.values()]:
            generation.done.cancel()

    def _fail_running(self, error: Exception, admitted: list[Generation]) -> None:
        for g in {id(g): g for g in [*admitted, *self._running.values()]}.values():
            if g.slot >= 0:
                self._running.pop(g.slot, None)
                if g.slot not in self._free:
                    self._free.append(g.slot)
            if not g.done.done():
                g.done.set_exception(error)
        RUNNING.set(len(self._running))

    def _prefill(self, admitted: list[Generation]) -> None:
        """Admitted sequences into slots, in order; those sharing a prompt (``submit_many``) that are admitted
        together are prefilled once, the others take a copy of its cache."""
        # id(shares) -> the slot that last took the prompt's cache, and its logits. Those sharing a prompt are
        # admitted one after another, so that slot is intact (or, finished at its first token, the next one's).
        source: dict[int, tuple[int, Tensor]] = {}
        for g in admitted:
            g.slot = self._free.pop()
            g.version_start = self.version
            self._running[g.slot] = g
            RUNNING.set(len(self._running))
            shared = source.get(id(g.shares)) if g.shares is not None else None
            if shared is None:
                logits = self.decoder.prefill(g.slot, g.prompt)
                self.prefills += 1
            else:
                if shared[0] != g.slot:
                    self.decoder.copy(shared[0], [g.slot])
                logits = shared[1]
            if g.shares is not None:
                source[id(g.shares)] = (g.slot, logits)
            self._sample(g, logits)

    def _step(self) -> None:
        slots = sorted(self._running)
        logits = self.decoder.decode(slots, [self._running[s].tokens[-1] for s in slots])
        self.decode_steps += 1
        STEPS.inc()
        for row, slot in enumerate(slots):
            self._sample(self._running[slot], logits[row])

    def _sample(self, g: Generation, logits: Tensor) -> None:
        p = g.params
        token, logprobs = sample_token(logits, p, g.generator)
        g.tokens.append(token)
        g.logprobs.append(float(logprobs[token]))
        g.versions.append(self.version)
        if p.top_logprobs:
            values, ids = logprobs.topk(min(p.top_logprobs, logprobs.shape[0]))
            g.top_logprobs.append([(int(i), float(v)) for i, v in zip(ids, values, strict=True)])
        self.tokens_generated += 1
        TOKENS.inc()
        if self._receiving:
            self.tokens_while_receiving += 1
            TOKENS_RECEIVING.inc()
        self._maybe_finish(g, token)

    def _maybe_finish(self, g: Generation, token: int) -> None:
        reason = ""
        text = ""
        if token in self.eos_ids and not g.params.ignore_eos:
            reason = "stop"
        if g.params.stop:  # decoding every step only when a stop string has to be looked for
            text = self.tokenizer.decode(g.tokens)
            for stop in g.params.stop:
                at = text.find(stop)
                if at >= 0:
                    text, reason = text[:at], "stop"
                    break
        if not reason and (len(g.tokens) >= g.params.max_tokens
                           or len(g.prompt) + len(g.tokens) >= self.decoder.max_len):
            reason = "length"
        if not reason:
            return
        g.text = text if g.params.stop else self.tokenizer.decode(g.tokens)
        g.finish_reason = reason
        g.version_end = self.version
        del self._running[g.slot]
        self._free.append(g.slot)
        RUNNING.set(len(self._running))
        g.done.set_result(g)
