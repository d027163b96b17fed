"""The policy's tokenizer, whatever the model: kiln's character tokenizer (``model="char"``) or a Hugging Face
model's own (``model`` is the directory holding it).

Every RL process gets its tokenizer from ``load_tokenizer(settings.model)``: the rollout worker tokenises prompts
and tool output with it once, the server and trainer decode and encode with the same one, so the ids the trainer
sees are the ids the sampler produced.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from kiln.workers.inference.errors import TokenizerError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class PolicyTokenizer(Protocol):
    vocab_size: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]:
        """``text`` as ids, no special tokens added."""
        ...

    def decode(self, ids: list[int]) -> str: ...

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        """``messages`` (``role``/``content``) through the model's chat template, with the generation prompt."""
        ...


class CharTokenizer:
    """Printable ASCII, newline and tab, plus three specials. Unknown characters map to ``?``."""

    PAD, BOS, EOS = 0, 1, 2
    SPECIALS = ("<pad>", "<bos>", "<eos>")

    def __init__(self) -> None:
        self.chars = string.printable[:95] + "\n\t"  # digits, letters, punctuation, space
        self._ids = {c: i + len(self.SPECIALS) for i, c in enumerate(self.chars)}
        self.vocab_size = len(self.SPECIALS) + len(self.chars)
        self.eos_id, self.pad_id = self.EOS, self.PAD

    def encode(self, text: str) -> list[int]:
        unknown = self._ids["?"]
        return [self._ids.get(c, unknown) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.token(i) for i in ids if i >= len(self.SPECIALS))

    def token(self, token_id: int) -> str:
        if token_id < len(self.SPECIALS):
            return self.SPECIALS[token_id]
        return self.chars[token_id - len(self.SPECIALS)]

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The character model has no chat template (it was never trained on one): the messages' text, as is — a
        one-message chat is exactly ``encode(prompt)``, today's prompts."""
        return self.encode("".join(m["content"] for m in messages))


TOKENIZER = CharTokenizer()


class HFTokenizer:
    """A ``transformers`` tokenizer. ``vocab_size`` counts the added tokens too (``len(tokenizer)``): the ids the
    model's embedding must cover. Decoding drops special tokens, as vLLM and SGLang do by default."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        eos = tokenizer.eos_token_id
        if not isinstance(eos, int):
            raise TokenizerError(f"{tokenizer.name_or_path}: the tokenizer names no EOS token")
        pad = tokenizer.pad_token_id
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.eos_id = eos
        self.pad_id = pad if isinstance(pad, int) else eos  # many causal LMs ship without a pad token

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if not isinstance(text, str):  # a list only for batched input, which a flat id list is not
            raise TokenizerError(f"{self.tokenizer.name_or_path}: decode gave {type(text).__name__}")
        return text

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        # Rendered to text, then encoded without specials: the template writes its own BOS/specials, and
        # transformers 5 returns a BatchEncoding (not a list) when asked to tokenize.
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if not isinstance(text, str):
            raise TokenizerError(f"{self.tokenizer.name_or_path}: the chat template did not render to text")
        return self.encode(text)


def load_tokenizer(model: str) -> PolicyTokenizer:
    """``"char"``: kiln's character tokenizer; otherwise ``model`` is a Hugging Face model's directory."""
    if model == "char":
        return TOKENIZER
    if not Path(model).is_dir():
        raise TokenizerError(f"model {model!r}: not 'char' and not a directory holding a Hugging Face model")
    from transformers import AutoTokenizer  # the rl extra; only HF models need it

    return HFTokenizer(AutoTokenizer.from_pretrained(model))


def tokenize_prompt(tokenizer: PolicyTokenizer, prompt: str, chat: bool = True) -> list[int]:
    """A task's prompt as the sampler gets it and the trainer trains after it, tokenised once: one user message
    through the model's chat template (with the generation prompt) when ``chat``, else the text as is (a base
    model's completion prompt). The character model has no template: both give ``encode(prompt)``."""
    return tokenizer.chat([{"role": "user", "content": prompt}]) if chat else tokenizer.encode(prompt)
