"""A small Hugging Face causal LM built here, for tests and benchmarks that need a real architecture and a real
tokenizer without downloading either: a byte-level BPE tokenizer trained on a corpus with the ``tokenizers``
package, a ChatML chat template, and a random-init Llama- or Qwen2-shaped model, saved as any Hub model is
(``config.json``, safetensors weights, ``tokenizer.json``), so ``transformers`` — and vLLM or SGLang — load it from
the directory.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any, Literal

SPECIALS = ["<pad>", "<s>", "<unk>", "<|im_start|>", "<|im_end|>"]
# ChatML (Qwen's): a turn ends with <|im_end|>, the EOS, so a chat-tuned policy stops there.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tiny_model(out: Path, corpus: list[str], *, arch: Literal["llama", "qwen2"] = "llama",
                     vocab_size: int = 256, hidden: int = 64, layers: int = 2, heads: int = 4, seed: int = 0,
                     max_len: int = 512) -> Path:
    """Train the tokenizer on ``corpus``, build the model, ``save_pretrained`` both into ``out``; returns ``out``.

    The tokenizer's alphabet is printable ASCII, newline and tab (as byte-level symbols) plus whatever the corpus
    holds; ``vocab_size`` is the whole vocabulary's target, so the default leaves ~150 BPE merges. Other bytes map
    to ``<unk>``. The same arguments give the same files (the BPE trainer is deterministic; the weights come from a
    generator seeded with ``seed``, leaving torch's global RNG alone).
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = byte_level
    bpe.decoder = decoders.ByteLevel()
    printable = string.printable[:95] + "\n\t"
    alphabet = sorted({symbol for piece, _ in byte_level.pre_tokenize_str(printable) for symbol in piece})
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                                         initial_alphabet=alphabet, show_progress=False))
    # transformers 5's fast tokenizer class leaves its __init__ unannotated
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=bpe, bos_token="<s>", eos_token="<|im_end|>", unk_token="<unk>", pad_token="<pad>",
        model_max_length=max_len)
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {name: bpe.token_to_id(name) for name in ("<pad>", "<s>", "<|im_end|>")}
    shape: dict[str, Any] = {"vocab_size": len(tokenizer), "hidden_size": hidden, "intermediate_size": 4 * hidden,
             "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
             "max_position_embeddings": max_len, "pad_token_id": ids["<pad>"], "bos_token_id": ids["<s>"],
             "eos_token_id": ids["<|im_end|>"], "tie_word_embeddings": True}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = (LlamaForCausalLM(LlamaConfig(**shape)) if arch == "llama"
                 else Qwen2ForCausalLM(Qwen2Config(**shape)))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
