"""The program ``/submit`` finds in a completion is the one SandboxFusion's online judge would run: fenced blocks
first (the language's own tag preferred), then an unclosed fence, then unfenced python definitions or bash lines;
and a completion built to make the search quadratic costs it linear time."""

from __future__ import annotations

from kiln.integrations.gateway.extraction import extract, fenced


def test_a_fence_tagged_with_the_language_wins_among_fences() -> None:
    completion = ("First a sketch:\n```\nprint('untagged')\n```\nIn C++:\n```cpp\nint main(){}\n```\n"
                  "And the answer:\n```python\nprint(input())\n```\nDone.")
    assert extract(completion, "python") == "print(input())"
    assert extract(completion, "cpp") == "int main(){}"
    # No block tagged with the language: the first block.
    assert extract(completion, "rust") == "print('untagged')"
    # "javascript" is a language of its own in SandboxFusion's table: only "js" marks nodejs.
    assert extract("```javascript\nA\n```\n```js\nB\n```", "nodejs") == "B"


def test_a_fence_closes_at_a_line_of_backticks_only() -> None:
    completion = "```py\nx = '```'\nprint(x)\n   \n  ```tail"
    assert extract(completion, "python") == "x = '```'\nprint(x)"
    # Code must follow the opening line: an empty fence is no block, and an unclosed one runs to the end.
    assert fenced("```py\n```") == []
    assert extract("```py\n```", "python") == "```"
    assert extract("Here:\n```python\nimport sys\nprint(sys.argv)\n", "python") == "import sys\nprint(sys.argv)\n"


def test_unfenced_code() -> None:
    completion = ("Let me think.\nimport math\n\n# the helper\ndef area(r):\n    return math.pi * r * r\n"
                  "print(area(2))\ndef other():\n    pass\n")
    # python: the first definition, with the import and comment lines right above it, and its indented body.
    assert extract(completion, "python") == "import math\n# the helper\ndef area(r):\n    return math.pi * r * r\n"
    # bash: every non-blank line.
    assert extract("echo hi\n\n  read x\n", "bash") == "echo hi\n  read x\n"
    # No fence and nothing the language's heuristic finds: the empty program (it then fails its cases).
    assert extract("print(input())", "python") == ""
    assert extract("int main() {}", "cpp") == ""


def test_a_completion_built_to_be_slow_is_not() -> None:
    # Fences that never close, a preamble that leads to no definition: SandboxFusion's expressions scan to the end
    # from each of them (quadratic: hours for these); here each is one pass.
    assert extract("```x" * 200_000 + "\n", "python") == ""
    assert extract("import x\n" * 200_000, "python") == ""
    assert extract("```py\n" + "```py " * 200_000, "python") == "```py " * 200_000
