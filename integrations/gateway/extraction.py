"""The program a completion holds, found as SandboxFusion's online judge finds it (its ``default_extract_helper``), so
a trainer moving its ``/submit`` calls to kiln scores the same code: a trainer sends the raw completion.

Candidates, by priority: fenced blocks (a line of three backticks and a tag, the code, a line closing it); else the
first opened fence that never closes (the rest of the completion); else, for python, the first top-level ``def`` or
``class`` with the ``import``/``from``/``#`` lines just above it and its indented body, and for bash the whole
completion. Among the candidates of the best kind, the first whose tag names the language wins, else the first;
none: the empty program.

Written as linear scans, not SandboxFusion's regular expressions: a completion is the policy's output, and a
completion of unclosed fences must not cost the gateway quadratic time.
"""

from __future__ import annotations

from dataclasses import dataclass

FENCE = "```"

# Fence tags SandboxFusion reads as the languages kiln serves (its alias table: "javascript" names a language of its
# own there, so only "js" and "JS" mark nodejs).
_TAGS: dict[str, str] = {
    **dict.fromkeys(("python", "Python", "py", "Python3", "python3", "PY"), "python"),
    **dict.fromkeys(("cpp", "c++", "C++", "Cpp", "CPP"), "cpp"),
    **dict.fromkeys(("JS", "js"), "nodejs"),
    **dict.fromkeys(("go", "Go"), "go"),
    **dict.fromkeys(("bash", "Bash", "BASH", "sh", "shell"), "bash"),
    **dict.fromkeys(("rust", "Rust", "rs"), "rust"),
}
FENCED, UNCLOSED, HEURISTIC = 30, 20, 10  # SandboxFusion's priorities


@dataclass(frozen=True)
class Block:
    priority: int
    language: str
    code: str


def _closing(text: str, opened: int) -> tuple[int, int] | None:
    """For a fence whose tag line ends at ``opened`` (its newline): the first newline after which only whitespace
    comes before three backticks (where the code ends), and those backticks; None when no such line follows."""
    search = opened + 1
    while (mark := text.find(FENCE, search)) >= 0:
        start = mark
        while start > opened + 1 and text[start - 1].isspace():
            start -= 1
        end = text.find("\n", start, mark)
        if end >= 0:
            return end, mark
        search = mark + 1
    return None


def fenced(text: str) -> list[Block]:
    """Every closed fence, in order (a fence whose code is empty is none: its opening line must be followed by
    one more newline before the closing backticks)."""
    blocks: list[Block] = []
    pos = 0
    while (start := text.find(FENCE, pos)) >= 0:
        opened = text.find("\n", start + len(FENCE))
        if opened < 0:
            break
        closing = _closing(text, opened)
        if closing is None:  # no fence opening later can close either: its code would start later still
            break
        end, mark = closing
        blocks.append(Block(FENCED, _TAGS.get(text[start + len(FENCE):opened].strip(), ""), text[opened + 1:end]))
        pos = mark + len(FENCE)
    return blocks


def unclosed(text: str) -> list[Block]:
    """The first opened fence, to the end of the completion."""
    start = text.find(FENCE)
    opened = text.find("\n", start + len(FENCE)) if start >= 0 else -1
    if opened < 0:
        return []
    return [Block(UNCLOSED, _TAGS.get(text[start + len(FENCE):opened].strip(), ""), text[opened + 1:])]


def _preamble(line: str) -> bool:
    return any(line.startswith(p) and len(line) > len(p) for p in ("import", "from", "#"))


def _definition(line: str) -> bool:
    return any(line.startswith(p) and len(line) > len(p) for p in ("def ", "class "))


def heuristic(text: str, language: str) -> list[Block]:
    """Unfenced code: python's first definition with its preamble and body; bash's every non-blank line."""
    lines = [line for line in text.split("\n") if line.strip()]
    if language == "bash":
        return [Block(HEURISTIC, "bash", "\n".join(lines) + "\n")]
    if language != "python":
        return []
    i = 0
    while i < len(lines):
        first = i
        while i < len(lines) and _preamble(lines[i]):
            i += 1
        if i < len(lines) and _definition(lines[i]):
            end = i + 1
            while end < len(lines) and lines[end][0].isspace():
                end += 1
            if end > i + 1:
                return [Block(HEURISTIC, "python", "\n".join(lines[first:end]) + "\n")]
        i += 1  # (a preamble that leads to no definition: none of its lines starts one either)
    return []


def extract(completion: str, language: str) -> str:
    """The program SandboxFusion would run for ``completion`` in ``language`` ("" when it finds none)."""
    blocks = [*fenced(completion), *heuristic(completion, language), *unclosed(completion)]
    if not blocks:
        return ""
    best = max(b.priority for b in blocks)
    top = [b for b in blocks if b.priority == best]
    return next((b.code for b in top if b.language == language), top[0].code)
