"""A Hugging Face ``transformers`` causal LM as the engine runs it (``engine.Decoder``).

The engine decodes every running sequence together, each at its own length, and sequences join and leave between
two steps. transformers' own caches hold one length for a whole batch, so the decoder keeps its own: per layer a
``[slots, kv_heads, capacity, head_dim]`` tensor, one slot per sequence (as ``model.KVCache`` does for TinyLM),
grown by doubling. Each forward call passes it as the model's ``cache`` (the model calls only ``update`` on it), with
explicit position ids and a ready 4D boolean mask — transformers returns a 4D mask as is and the ``sdpa`` attention
takes it — so every row attends to exactly its own positions. A weight update swaps parameters between two steps;
the cached keys and values of a running sequence stay (PipelineRL's in-flight update).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn

from kiln.streams.errors import ConfigError

Dtype = Literal["float32", "bfloat16", "float16"]
TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                        "float16": torch.float16}


def load_causal_lm(path: str, dtype: Dtype = "float32", device: str = "cpu") -> nn.Module:
    """The model in ``path`` (a directory ``save_pretrained`` wrote) on ``device`` in ``dtype``, for inference, with
    the ``sdpa`` attention (the one whose masks ``HFDecoder`` builds)."""
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r}: this machine has no CUDA device")
    if dtype == "bfloat16" and target.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"dtype bfloat16: the device {device!r} has no bfloat16; use float16 or float32")
    from transformers import AutoModelForCausalLM  # the rl extra; only HF models need it

    model: nn.Module = AutoModelForCausalLM.from_pretrained(path, dtype=TORCH_DTYPES[dtype],
                                                            attn_implementation="sdpa")
    return model.to(target).eval()


class SlotCache:
    """Keys and values of up to ``slots`` sequences, in the shape transformers' attention calls ``update`` on.
    ``rows`` and ``starts`` say, for the call in progress, which slot each batch row is and at which position its
    new tokens go."""

    def __init__(self, slots: int, capacity: int) -> None:
        self.slots = slots
        self.capacity = capacity
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.rows = torch.zeros(0, dtype=torch.long)
        self.starts = torch.zeros(0, dtype=torch.long)
        self.contiguous: slice | None = None  # rows as a slice when consecutive: read as a view, not gathered
        self.span = 0

    def grow(self, needed: int) -> None:
        """Room for ``needed`` positions per slot (doubling; existing entries kept)."""
        if needed <= self.capacity:
            return
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        for store in (self.keys, self.values):
            for layer, tensor in enumerate(store):
                grown = tensor.new_zeros((*tensor.shape[:2], capacity, tensor.shape[3]))
                grown[:, :, :self.capacity] = tensor
                store[layer] = grown
        self.capacity = capacity

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, kwargs: Any = None,
               **_: Any) -> tuple[Tensor, Tensor]:
        """Write the new positions (``[batch, kv_heads, new, head_dim]``) into each row's slot; return each row's
        keys and values up to the longest row's end (the mask hides the rest)."""
        if layer_idx == len(self.keys):  # first call for this layer: allocate in the model's dtype and device
            shape = (self.slots, key_states.shape[1], self.capacity, key_states.shape[3])
            self.keys.append(key_states.new_zeros(shape))
            self.values.append(value_states.new_zeros(shape))
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        new = key_states.shape[2]
        positions = self.starts.unsqueeze(1) + torch.arange(new, device=self.starts.device)  # [batch, new]
        rows = self.rows.unsqueeze(1)
        keys[rows, :, positions] = key_states.transpose(1, 2)
        values[rows, :, positions] = value_states.transpose(1, 2)
        if self.contiguous is not None:
            return keys[self.contiguous, :, :self.span], values[self.contiguous, :, :self.span]
        return keys[self.rows, :, :self.span], values[self.rows, :, :self.span]


class HFDecoder:
    """``engine.Decoder`` over a transformers causal LM (Llama, Qwen2 and the like: models whose attention calls
    ``cache.update`` and takes a 4D mask)."""

    def __init__(self, model: nn.Module, slots: int, max_len: int | None = None, capacity: int = 256) -> None:
        self.model = model.eval()
        config: Any = getattr(model, "config")  # noqa: B009 (untyped in transformers)
        context = int(getattr(config, "max_position_embeddings", 0) or 0) or 2048
        self.max_len = min(max_len, context) if max_len else context
        self.device = next(model.parameters()).device
        bos = getattr(config, "bos_token_id", None)
        self.start = [bos] if isinstance(bos, int) else [0]
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)  # an id, a list or None
        self.eos_ids = frozenset(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
        layer_types = list(getattr(config, "layer_types", None) or [])
        # Models with sliding-window layers take one mask per layer type; the others one mask.
        self.window: int | None = (int(config.sliding_window) if "sliding_attention" in layer_types
                                   and getattr(config, "sliding_window", None) else None)
        self.cache = SlotCache(slots, min(capacity, self.max_len))
        self.lengths = torch.zeros(slots, dtype=torch.long)

    def prefill(self, slot: int, prompt: list[int]) -> Tensor:
        logits = self._forward([slot], torch.tensor([prompt]), torch.zeros(1, dtype=torch.long))
        self.lengths[slot] = len(prompt)
        return logits[0]

    def copy(self, source: int, slots: list[int]) -> None:
        length = int(self.lengths[source])
        for store in (self.cache.keys, self.cache.values):
            for tensor in store:
                tensor[slots, :, :length] = tensor[source:source + 1, :, :length]
        self.lengths[slots] = length

    def decode(self, slots: list[int], tokens: list[int]) -> Tensor:
        index = torch.tensor(slots)
        starts = self.lengths[index]
        logits = self._forward(slots, torch.tensor(tokens).unsqueeze(1), starts)
        self.lengths[index] += 1
        return logits

    def _forward(self, slots: list[int], tokens: Tensor, starts: Tensor) -> Tensor:
        """The model on ``tokens`` [batch, new], row ``i`` continuing slot ``slots[i]`` at position ``starts[i]``;
        the logits after each row's last token [batch, vocab]."""
        device = self.device
        new = tokens.shape[1]
        span = int(starts.max()) + new
        self.cache.grow(span)
        cache = self.cache
        cache.rows = torch.tensor(slots, device=device)
        cache.starts = starts.to(device)
        cache.span = span
        first = slots[0]
        cache.contiguous = slice(first, first + len(slots)) if slots == list(range(first, first + len(slots))) \
            else None
        positions = cache.starts.unsqueeze(1) + torch.arange(new, device=device)  # [batch, new]
        keys = torch.arange(span, device=device)
        visible = keys.view(1, 1, -1) <= positions.unsqueeze(2)  # [batch, new, span]
        mask: Tensor | dict[str, Tensor] = visible.unsqueeze(1)
        if self.window is not None:
            sliding = visible & (keys.view(1, 1, -1) > positions.unsqueeze(2) - self.window)
            mask = {"full_attention": visible.unsqueeze(1), "sliding_attention": sliding.unsqueeze(1)}
        out = self.model(input_ids=tokens.to(device), position_ids=positions, attention_mask=mask, cache=cache,
                         use_cache=True, logits_to_keep=1)
        logits: Tensor = out.logits[:, -1]
        return logits
