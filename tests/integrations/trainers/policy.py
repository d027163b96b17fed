"""A tiny policy for the trainers' own code: a character tokenizer and a randomly initialised one-layer GPT-2."""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast


def char_tokenizer() -> PreTrainedTokenizerFast:
    symbols = ["<pad>", "<eos>", "<unk>", *string.printable[:95], "\u2192", "\u2227"]
    core = Tokenizer(models.WordLevel({s: i for i, s in enumerate(symbols)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_gpt2(tokenizer: PreTrainedTokenizerFast) -> GPT2LMHeadModel:
    return GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=1, n_head=2,
                                      bos_token_id=1, eos_token_id=1, pad_token_id=0))
