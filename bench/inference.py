"""The inference server under load, and what an in-flight weight update costs it.

1. Decode throughput over HTTP: ``B`` concurrent ``/v1/completions`` of 128 tokens each (B = 1, 16, 64), tokens
   counted from the responses' usage ÷ wall-clock: ``inference_tokens_per_s_b<B>``.
2. Pause per update while 32 sequences are generating, at 0.1M, 10M and 100M parameters (the server measures the
   time decoding stood still and answers it per update): ``weight_update_pause_ms_p50_<size>`` / ``_p99_<size>``,
   with the staging buffer (the default) and, at 10M, without it (``..._direct``: decoding stops while the tensors
   arrive), plus the transfer time ``weight_update_transfer_ms_p50_<size>``.
3. A trainer-driven run: a real trainer (Adam on next-character prediction over this repository's README) updates the
   server after every step while 32 sequences keep generating; ``inference_paused_fraction`` = pause time the server
   measured ÷ wall-clock, and ``decode_tokens_per_s_during_update`` ÷ ``decode_tokens_per_s_outside_updates``
   (tokens the server sampled while weights arrived into the staging buffer, per second of arriving, against the
   rest) as ``decode_rate_ratio_during_update``.
The pause and rate figures above are the server's own account. The client side measures them too, with a probe: a
client process of its own sending one-token completions back to back next to the load (which then keeps 31
sequences generating, so the probe has the 32nd place in the batch). A probe in flight during an update waits out
any stall of decoding: ``weight_update_stall_ms_client_p50_<size>`` / ``_p99_<size>`` is, per update, the longest
probe wait overlapping it beyond the probes' median wait outside updates, and ``inference_stalled_fraction_client``
is their sum over the trainer run ÷ wall-clock. ``decode_tokens_per_s_client`` is the tokens of the load's
completions that came back during the trainer run, counted by the client, ÷ its wall-clock, against
``decode_tokens_per_s_client_no_updates`` (the same load for the same time just before, with no update):
``decode_rate_ratio_with_updates_client``. (Tokens count when their completion comes back: give the run more
seconds than a completion takes.)
4. The same throughput with a Hugging Face causal LM (``kiln rl serve --model``): a tiny Llama built here
   (``hf.build_tiny_model``: hidden 64, 2 layers, like the 0.1M character model), or ``--model DIR`` with
   ``--device``/``--dtype`` (e.g. a real model on a GPU): ``inference_tokens_per_s_b<B>_hf``, and
   ``inference_hf_vs_char_tokens_per_s_b64`` against the character model's figure of the same run.
Usage: python -m bench.inference [--quick] [--throughput-only] [--model DIR --device cuda --dtype bfloat16]
(--quick: 0.1M and 10M only, shorter run; --throughput-only: parts 1 and 4)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import console, median, percentile, report

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.nn.functional as F

from kiln.workers.inference.model import TOKENIZER, ModelConfig, TinyLM
from kiln.workers.inference.process import ServerProcess
from kiln.workers.inference.weights import WeightBroadcaster

torch.set_num_threads(1)
SIZES = {"0.1M": ModelConfig(d_model=64, n_layers=2, n_heads=4, max_len=512),
         "10M": ModelConfig(d_model=256, n_layers=12, n_heads=8, max_len=512),
         "100M": ModelConfig(d_model=768, n_layers=14, n_heads=12, max_len=256)}


class Load:
    """Keeps ``n`` long generations in flight until stopped."""

    def __init__(self, url: str, n: int, max_tokens: int) -> None:
        self.url, self.n, self.max_tokens = url, n, max_tokens
        self.stopping = False
        self.tokens = 0

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=600) as client:
            async def one() -> None:
                while not self.stopping:
                    body = {"prompt": "def f(x):", "max_tokens": self.max_tokens, "ignore_eos": True}
                    answer = (await client.post("/v1/completions", json=body)).json()
                    self.tokens += answer["usage"]["completion_tokens"]
            await asyncio.gather(*(one() for _ in range(self.n)))

    async def running(self, served: ServerProcess, patience_s: float = 120.0) -> None:
        """Wait until all ``n`` sequences are in the running batch (the server's gauge says so)."""
        for _ in range(int(patience_s / 0.05)):
            if served.metric("kiln_inference_running_sequences") >= self.n:
                return
            await asyncio.sleep(0.05)
        raise TimeoutError(f"{self.n} sequences never ran together")


_PROBE = """
import signal, sys, time
import httpx
url, out = sys.argv[1], sys.argv[2]
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
with httpx.Client(base_url=url, timeout=600) as client, open(out, "w") as spans:
    while not stop:
        sent = time.monotonic()
        client.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 1}).raise_for_status()
        spans.write(f"{sent} {time.monotonic()}\\n")
        spans.flush()
"""


class Probe:
    """A client process of its own (so the trainer's work in this one cannot slow it) sending one-token completions
    back to back: when each was sent and answered, on the system's monotonic clock (the one ``time.monotonic``
    reads here too)."""

    def __init__(self, url: str, log_dir: Path) -> None:
        self.out = log_dir / f"probe-{time.monotonic_ns()}.txt"
        self.proc = subprocess.Popen([sys.executable, "-c", _PROBE, url, str(self.out)])
        self.spans: list[tuple[float, float]] = []

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(60)
        self.spans = [(float(a), float(b)) for a, b in (line.split() for line in self.out.read_text().splitlines())]

    def stalls_ms(self, windows: list[tuple[float, float]]) -> list[float]:
        """Per window (an update, by the trainer's clock): the longest wait of a probe in flight during it, beyond
        the median wait of the probes that overlapped no window."""
        def overlaps(span: tuple[float, float], window: tuple[float, float]) -> bool:
            return span[0] < window[1] and window[0] < span[1]

        quiet = [end - sent for sent, end in self.spans if not any(overlaps((sent, end), w) for w in windows)]
        usual = median(quiet) if quiet else 0.0
        return [max([0.0, *((end - sent - usual) * 1000 for sent, end in self.spans if overlaps((sent, end), w))])
                for w in windows]


async def throughput(served: ServerProcess, suffix: str = "") -> dict[str, float]:
    metrics = {}
    async with httpx.AsyncClient(base_url=served.url, timeout=600) as client:
        for batch in (1, 16, 64):
            body = {"prompt": "def f(x):", "max_tokens": 128, "ignore_eos": True, "temperature": 1.0}
            started = time.perf_counter()
            answers = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(batch)))
            took = time.perf_counter() - started
            tokens = sum(a.json()["usage"]["completion_tokens"] for a in answers)
            metrics[f"inference_tokens_per_s_b{batch}{suffix}"] = tokens / took
    return metrics


def tiny_llama(out: Path) -> str:
    """A Llama the size of the 0.1M character model, its tokenizer trained on this repository's README."""
    from kiln.workers.inference.hf import build_tiny_model

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    corpus = [text[i:i + 2000] for i in range(0, len(text), 2000)]
    return str(build_tiny_model(out, corpus, arch="llama", vocab_size=512))


async def hf_throughput(args: argparse.Namespace, log_dir: Path) -> dict[str, float]:
    """Part 4: a Hugging Face model served by ``kiln rl serve --model``."""
    model = args.model or tiny_llama(log_dir / "tiny-llama")
    served = ServerProcess(SIZES["0.1M"], log_dir / "serve-hf.log",
                           {"KILN_RL_MODEL": model, "KILN_RL_DEVICE": args.device, "KILN_RL_DTYPE": args.dtype})
    served.start()
    try:
        return await throughput(served, "_hf")
    finally:
        served.stop()


async def pauses(size: str, config: ModelConfig, updates: int, log_dir: Path, staging: bool) -> dict[str, float]:
    served = ServerProcess(config, log_dir / f"serve-{size}-{staging}.log",
                           {"KILN_RL_MAX_BATCH": "32", "KILN_RL_STAGING": str(staging).lower()})
    served.start()
    trainer = TinyLM(config)
    broadcaster = WeightBroadcaster([served.endpoint(timeout_s=300)], timeout_s=300)
    load, probe = Load(served.url, 31, config.max_len - 16), None
    try:
        assert broadcaster.connect() == {}
        task = asyncio.create_task(load.run())
        await load.running(served)
        probe = Probe(served.url, log_dir)
        await asyncio.sleep(1.0)  # probes with no update in flight: the usual wait
        paused, transfer, windows = [], [], []
        for version in range(1, updates + 1):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(0.001)
            began = time.monotonic()
            update = await asyncio.to_thread(broadcaster.update, trainer.named_parameters(), version)
            windows.append((began, time.monotonic()))
            timing = update.timings[served.url]
            paused.append(timing.paused_ms)
            transfer.append(timing.transfer_ms)
            await asyncio.sleep(0.2)  # quiet probes between updates
        probe.stop()
        load.stopping = True
        await task
    finally:
        if probe is not None:
            probe.stop()
        broadcaster.close()
        served.stop()
    suffix = size if staging else f"{size}_direct"
    params = sum(p.numel() for p in trainer.parameters())
    console.print(f"{size}: {params / 1e6:.1f}M parameters, {updates} updates, staging={staging}")
    stalls = probe.stalls_ms(windows)
    return {f"weight_update_pause_ms_p50_{suffix}": median(paused),
            f"weight_update_pause_ms_p99_{suffix}": percentile(paused, 0.99),
            f"weight_update_stall_ms_client_p50_{suffix}": median(stalls),
            f"weight_update_stall_ms_client_p99_{suffix}": percentile(stalls, 0.99),
            f"weight_update_transfer_ms_p50_{suffix}": median(transfer)}


def corpus_batches(length: int, batch: int) -> torch.Tensor:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    ids = torch.tensor(TOKENIZER.encode(text))
    starts = torch.randint(0, len(ids) - length - 1, (batch,))
    return torch.stack([ids[s:s + length + 1] for s in starts])


async def trainer_run(seconds: float, log_dir: Path) -> tuple[dict[str, float], dict[str, str]]:
    config = SIZES["0.1M"]
    served = ServerProcess(config, log_dir / "serve-run.log", {"KILN_RL_MAX_BATCH": "32"})
    served.start()
    model = TinyLM(config)
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    broadcaster = WeightBroadcaster([served.endpoint(timeout_s=120)], timeout_s=120)
    load, probe = Load(served.url, 31, 256), None
    losses: list[float] = []
    paused_ms = 0.0
    windows: list[tuple[float, float]] = []
    try:
        assert broadcaster.connect() == {}
        task = asyncio.create_task(load.run())
        await load.running(served)
        probe = Probe(served.url, log_dir)
        # The same load for the same time with no update: the client's baseline rate.
        quiet_tokens, quiet_started = load.tokens, time.perf_counter()
        await asyncio.sleep(seconds)
        quiet_rate = (load.tokens - quiet_tokens) / (time.perf_counter() - quiet_started)
        client_tokens = load.tokens
        before = {name: served.metric(name) for name in (
            "kiln_inference_generated_tokens_total", "kiln_inference_tokens_while_receiving_total",
            "kiln_inference_receiving_seconds_total")}
        started = time.perf_counter()
        version = 0
        while time.perf_counter() - started < seconds:
            def step() -> float:
                batch = corpus_batches(128, 16)
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
                return float(loss)
            losses.append(await asyncio.to_thread(step))
            version += 1
            began = time.monotonic()
            update = await asyncio.to_thread(broadcaster.update, model.named_parameters(), version)
            windows.append((began, time.monotonic()))
            paused_ms += update.timings[served.url].paused_ms
        wall = time.perf_counter() - started
        after = {name: served.metric(name) for name in before}
        client_rate = (load.tokens - client_tokens) / wall
        probe.stop()
        load.stopping = True
        await task
    finally:
        if probe is not None:
            probe.stop()
        broadcaster.close()
        served.stop()
    tokens = after["kiln_inference_generated_tokens_total"] - before["kiln_inference_generated_tokens_total"]
    during = (after["kiln_inference_tokens_while_receiving_total"]
              - before["kiln_inference_tokens_while_receiving_total"])
    receiving_s = (after["kiln_inference_receiving_seconds_total"]
                   - before["kiln_inference_receiving_seconds_total"])
    rate_during = during / receiving_s if receiving_s else float("nan")
    rate_outside = (tokens - during) / (wall - receiving_s - paused_ms / 1000)
    metrics = {"inference_paused_fraction": paused_ms / 1000 / wall,
               "decode_tokens_per_s_during_update": rate_during,
               "decode_tokens_per_s_outside_updates": rate_outside,
               "decode_rate_ratio_during_update": rate_during / rate_outside,
               "trainer_steps": float(version),
               "inference_stalled_fraction_client": sum(probe.stalls_ms(windows)) / 1000 / wall,
               "decode_tokens_per_s_client": client_rate, "decode_tokens_per_s_client_no_updates": quiet_rate,
               "decode_rate_ratio_with_updates_client": client_rate / quiet_rate if quiet_rate else float("nan")}
    notes = {"trainer loss (first → last step)": f"{losses[0]:.3f} → {losses[-1]:.3f}",
             "time receiving weights": f"{receiving_s / wall:.1%} of the run"}
    return metrics, notes


async def run(args: argparse.Namespace) -> tuple[dict[str, float], dict[str, str]]:
    log_dir = Path(tempfile.mkdtemp(prefix="kiln-bench-inference-"))
    metrics: dict[str, float] = {}
    served = ServerProcess(SIZES["0.1M"], log_dir / "serve-throughput.log")
    served.start()
    try:
        metrics.update(await throughput(served))
    finally:
        served.stop()
    metrics.update(await hf_throughput(args, log_dir))
    metrics["inference_hf_vs_char_tokens_per_s_b64"] = (metrics["inference_tokens_per_s_b64_hf"]
                                                        / metrics["inference_tokens_per_s_b64"])
    if args.throughput_only:
        return metrics, {}
    sizes = ["0.1M", "10M"] if args.quick else ["0.1M", "10M", "100M"]
    for size in sizes:
        updates = {"0.1M": 20, "10M": 10, "100M": 5}[size] // (2 if args.quick else 1)
        metrics.update(await pauses(size, SIZES[size], updates, log_dir, staging=True))
    metrics.update(await pauses("10M", SIZES["10M"], 5 if args.quick else 10, log_dir, staging=False))
    run_metrics, notes = await trainer_run(10 if args.quick else 60, log_dir)
    metrics.update(run_metrics)
    return metrics, notes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="0.1M and 10M only, a 10 s trainer run")
    parser.add_argument("--throughput-only", action="store_true", help="only the throughput parts (1 and 4)")
    parser.add_argument("--model", default="", help="a Hugging Face model's directory for part 4 (default: a tiny "
                        "Llama built here)")
    parser.add_argument("--device", default="cpu", help="where part 4's model runs (KILN_RL_DEVICE)")
    parser.add_argument("--dtype", default="float32", help="part 4's model dtype (KILN_RL_DTYPE)")
    args = parser.parse_args()
    metrics, notes = asyncio.run(run(args))
    report("inference server", metrics, notes)


if __name__ == "__main__":
    main()
