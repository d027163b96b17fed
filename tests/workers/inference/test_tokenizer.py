"""The policy's tokenizer behind one protocol (workers/inference/tokenizer.py) and the small Hugging Face model built
for tests (workers/inference/hf.py): kiln's character tokenizer is today's behaviour; a model directory's tokenizer
encodes without specials, decodes without them, and renders its chat template with the generation prompt; the
model is a real Llama/Qwen2 checkpoint, the same files for the same seed."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln.workers.inference.errors import TokenizerError
from kiln.workers.inference.hf import build_tiny_model
from kiln.workers.inference.model import TOKENIZER as MODEL_TOKENIZER
from kiln.workers.inference.tokenizer import TOKENIZER, HFTokenizer, load_tokenizer, tokenize_prompt

CORPUS = [f"add {a}+{b}={a + b}\n" for a in range(30) for b in range(30)]


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_char_is_kilns_character_tokenizer() -> None:
    assert load_tokenizer("char") is TOKENIZER is MODEL_TOKENIZER  # model.py's old import path, the same object
    assert (TOKENIZER.eos_id, TOKENIZER.pad_id, TOKENIZER.vocab_size) == (2, 0, 100)
    ids = TOKENIZER.encode("add 3+4=")
    assert tokenize_prompt(TOKENIZER, "add 3+4=") == tokenize_prompt(TOKENIZER, "add 3+4=", chat=False) == ids
    with pytest.raises(TokenizerError, match="not a directory"):
        load_tokenizer("/nonexistent/model")


def test_a_built_model_and_its_tokenizer(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    built = build_tiny_model(tmp_path / "llama", CORPUS, vocab_size=300, seed=3)
    tokenizer = load_tokenizer(str(built))
    assert isinstance(tokenizer, HFTokenizer)
    ids = tokenizer.encode("add 12+7=19\n")
    assert len(ids) < len("add 12+7=19\n")  # BPE merges were learned
    assert tokenizer.decode(ids) == "add 12+7=19\n" and tokenizer.decode([*ids, tokenizer.eos_id]) == "add 12+7=19\n"
    chat = tokenizer.chat([{"role": "user", "content": "add 1+2="}])
    assert tokenizer.tokenizer.decode(chat) == "<|im_start|>user\nadd 1+2=<|im_end|>\n<|im_start|>assistant\n"
    assert tokenize_prompt(tokenizer, "add 1+2=") == chat
    assert tokenize_prompt(tokenizer, "add 1+2=", chat=False) == tokenizer.encode("add 1+2=")
    assert tokenizer.eos_id == tokenizer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.encode("€") == [tokenizer.tokenizer.convert_tokens_to_ids("<unk>")] * 3  # bytes off the alphabet
    model = AutoModelForCausalLM.from_pretrained(built)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == tokenizer.vocab_size
    assert model.config.eos_token_id == tokenizer.eos_id
    with torch.no_grad():
        logits = model(torch.tensor([chat])).logits
    assert logits.shape == (1, len(chat), tokenizer.vocab_size)
    # Deterministic for a seed; another seed, other weights (the tokenizer depends on the corpus only).
    again = _digests(build_tiny_model(tmp_path / "again", CORPUS, vocab_size=300, seed=3))
    other = _digests(build_tiny_model(tmp_path / "other", CORPUS, vocab_size=300, seed=4))
    assert _digests(built) == again
    assert other["model.safetensors"] != again["model.safetensors"]
    assert other["tokenizer.json"] == again["tokenizer.json"]
    qwen = build_tiny_model(tmp_path / "qwen", CORPUS, arch="qwen2")
    assert type(AutoModelForCausalLM.from_pretrained(qwen)).__name__ == "Qwen2ForCausalLM"
