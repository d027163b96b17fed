"""The policy: a small decoder-only transformer over characters, its tokenizer, the trainer's log-probs, and
checkpoints as safetensors in the blob store.

The same module runs in two shapes: the sampler feeds it one new token per sequence against a KV cache
(``decode``), the trainer feeds whole sequences (``forward``); ``sequence_logprobs`` is the trainer's view, and the
engine's per-token log-probs agree with it within float tolerance (tests/workers/inference/test_model.py).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import cast

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import Tensor, nn

from kiln.streams.blobstore import BlobStore

# The character tokenizer lives in tokenizer.py; its old import path stays.
from kiln.workers.inference.tokenizer import TOKENIZER as TOKENIZER
from kiln.workers.inference.tokenizer import CharTokenizer as CharTokenizer


class ModelShape(BaseModel):
    """The fields that shape a fresh policy; process settings that build one (server, trainer) inherit them."""

    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_len: int = 512
    seed: int = 0

    def shape(self) -> ModelConfig:
        return ModelConfig(**{name: getattr(self, name) for name in ModelShape.model_fields})


class ModelConfig(ModelShape):
    """Shape of the policy. The defaults give ~0.1M parameters; d_model=768, n_layers=14 gives ~100M."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class KVCache:
    """Keys and values of up to ``slots`` sequences, preallocated: slot ``s`` holds its sequence's first
    ``lengths[s]`` positions in every layer."""

    def __init__(self, config: ModelConfig, slots: int, dtype: torch.dtype = torch.float32) -> None:
        head = config.d_model // config.n_heads
        shape = (config.n_layers, slots, config.n_heads, config.max_len, head)
        self.keys = torch.zeros(shape, dtype=dtype)
        self.values = torch.zeros(shape, dtype=dtype)
        self.lengths = torch.zeros(slots, dtype=torch.long)


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.ln1 = nn.LayerNorm(config.d_model)
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.up = nn.Linear(config.d_model, 4 * config.d_model)
        self.down = nn.Linear(4 * config.d_model, config.d_model)

    def _split(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
        heads = [t.view(batch, length, self.n_heads, width // self.n_heads).transpose(1, 2) for t in (q, k, v)]
        return heads[0], heads[1], heads[2]

    def _finish(self, x: Tensor, attended: Tensor) -> Tensor:
        batch, _heads, length, _head = attended.shape
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, -1))
        out: Tensor = x + self.down(F.gelu(self.up(self.ln2(x))))
        return out

    def forward(self, x: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Whole sequences, causal (or ``mask``: [batch, 1, length, length], True where attending is allowed); also
        returns their keys and values (for prefill)."""
        q, k, v = self._split(x)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=mask is None, attn_mask=mask)
        return self._finish(x, attended), k, v

    def step(self, x: Tensor, layer: int, cache: KVCache, rows: slice | Tensor, positions: Tensor) -> Tensor:
        """One new position per sequence (x: [batch, 1, d]) in cache ``rows``, attending to its cached prefix."""
        q, k, v = self._split(x)
        batch = torch.arange(x.shape[0])
        keys_all, values_all = cache.keys[layer][rows], cache.values[layer][rows]
        keys_all[batch, :, positions] = k[:, :, 0]
        values_all[batch, :, positions] = v[:, :, 0]
        if isinstance(rows, Tensor):  # a gathered copy: write the new position back
            cache.keys[layer, rows, :, positions] = k[:, :, 0]
            cache.values[layer, rows, :, positions] = v[:, :, 0]
        span = int(positions.max()) + 1
        keys = keys_all[:, :, :span]
        values = values_all[:, :, :span]
        mask = torch.arange(span).unsqueeze(0) <= positions.unsqueeze(1)  # [batch, span]
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None, None, :])
        return self._finish(x, attended)


class TinyLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.d_model % config.n_heads:
            raise ValueError("d_model must be a multiple of n_heads")
        self.config = config
        self.embed = nn.Embedding(TOKENIZER.vocab_size, config.d_model)
        self.position = nn.Embedding(config.max_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, TOKENIZER.vocab_size)
        generator = torch.Generator().manual_seed(config.seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif p.dim() > 1:
                    p.normal_(0.0, 0.02 if "embed" in name or "position" in name
                              else 1 / math.sqrt(p.shape[1]), generator=generator)

    def forward(self, tokens: Tensor, segments: Tensor | None = None) -> Tensor:
        """Logits for every position of ``tokens`` [batch, length]. ``segments`` [batch, length] packs several
        sequences into a row: positions restart and attention stays within each segment id (the trainer's packing)."""
        logits, _keys, _values = self.prefill(tokens, segments)
        return logits

    def prefill(self, tokens: Tensor, segments: Tensor | None = None) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        mask = None
        if segments is None:
            positions = torch.arange(tokens.shape[1]).unsqueeze(0)
        else:
            starts = torch.ones_like(segments, dtype=torch.bool)
            starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
            index = torch.arange(tokens.shape[1]).expand_as(segments)
            positions = index - torch.cummax(torch.where(starts, index, 0), dim=1).values
            causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).tril()
            mask = (causal & (segments.unsqueeze(2) == segments.unsqueeze(1))).unsqueeze(1)
        x = self.embed(tokens) + self.position(positions)
        keys, values = [], []
        for block in self.blocks:
            x, k, v = block(x, mask)
            keys.append(k)
            values.append(v)
        return self.head(self.ln(x)), keys, values

    def decode(self, tokens: Tensor, cache: KVCache, slots: Tensor) -> Tensor:
        """Logits of the next token for each sequence in ``slots``, given its newest token ``tokens`` [batch]."""
        positions = cache.lengths[slots]
        x = (self.embed(tokens) + self.position(positions)).unsqueeze(1)
        first = int(slots[0])
        # Consecutive slots (the usual case: the engine hands out the lowest free slot) are read as a view.
        rows: slice | Tensor = slots
        if torch.equal(slots, torch.arange(first, first + len(slots))):
            rows = slice(first, first + len(slots))
        for layer, block in enumerate(self.blocks):
            x = cast(Block, block).step(x, layer, cache, rows, positions)
        cache.lengths[slots] += 1
        logits: Tensor = self.head(self.ln(x))[:, 0]
        return logits

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())


class TinyDecoder:
    """TinyLM as the engine runs it (``engine.Decoder``): one preallocated KV cache slot per running sequence."""

    def __init__(self, model: TinyLM, slots: int) -> None:
        self.tiny = model.eval()
        self.model: nn.Module = model
        self.max_len = model.config.max_len
        self.start = [TOKENIZER.BOS]  # what an empty prompt becomes
        self.eos_ids = frozenset({TOKENIZER.EOS})
        self.device = torch.device("cpu")
        self.cache = KVCache(model.config, slots)

    def prefill(self, slot: int, prompt: list[int]) -> Tensor:
        logits, keys, values = self.tiny.prefill(torch.tensor([prompt]))
        length = len(prompt)
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            self.cache.keys[layer, slot, :, :length] = k[0]
            self.cache.values[layer, slot, :, :length] = v[0]
        self.cache.lengths[slot] = length
        row: Tensor = logits[0, -1]
        return row

    def decode(self, slots: list[int], tokens: list[int]) -> Tensor:
        return self.tiny.decode(torch.tensor(tokens), self.cache, torch.tensor(slots))

    def copy(self, source: int, slots: list[int]) -> None:
        length = int(self.cache.lengths[source])
        for store in (self.cache.keys, self.cache.values):
            store[:, slots, :, :length] = store[:, source:source + 1, :, :length]
        self.cache.lengths[slots] = length


def token_logprobs(logits: Tensor, temperature: float) -> Tensor:
    """Log-probabilities of the distribution sampled from: softmax(logits / T) (T = 1 for greedy decoding)."""
    scale = temperature if temperature > 0 else 1.0
    return F.log_softmax(logits.float() / scale, dim=-1)


def sequence_logprobs(model: TinyLM, tokens: Tensor, prompt_lengths: list[int], temperature: float = 1.0) -> Tensor:
    """The trainer's view: log-prob of every token after its prompt, by one full forward pass.

    ``tokens`` [batch, length] (padded on the right); returns [batch, length - 1] where position ``i`` is the
    log-prob of ``tokens[:, i + 1]``; positions inside the prompt are zero.
    """
    logprobs = token_logprobs(model(tokens)[:, :-1], temperature)
    picked = logprobs.gather(2, tokens[:, 1:].unsqueeze(2)).squeeze(2)
    mask = torch.arange(tokens.shape[1] - 1).unsqueeze(0) >= (torch.tensor(prompt_lengths) - 1).unsqueeze(1)
    return picked * mask


# ---- checkpoints --------------------------------------------------------------------------------------------

def weights_digest(model: nn.Module) -> str:
    """SHA-256 over every parameter's name, dtype, shape and bytes, in name order: equal digests, equal weights
    bit for bit."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
        digest.update(tensor.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def save_checkpoint(model: TinyLM, store: BlobStore, version: int) -> str:
    """The weights as safetensors in the blob store (content-addressed); returns the digest. The config and the
    policy version travel in the safetensors metadata."""
    data = save_safetensors({k: v.detach().contiguous() for k, v in model.state_dict().items()},
                            metadata={"kiln.config": model.config.model_dump_json(), "kiln.version": str(version)})
    return store.put(data).digest


def load_checkpoint(store: BlobStore, digest: str) -> tuple[TinyLM, int]:
    data = store.get(digest)
    metadata = _metadata(data)
    model = TinyLM(ModelConfig.model_validate_json(metadata["kiln.config"]))
    model.load_state_dict(load_safetensors(data))
    return model, int(metadata.get("kiln.version", "0"))


def _metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file: an 8-byte little-endian header length, then the JSON header."""
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    return dict(header.get("__metadata__", {}))
