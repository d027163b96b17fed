"""The README is a landing page and the docs stay real: every relative link points at a file (and heading) that
exists, and every ``kiln …`` command they name exists with the flags they give it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import typer.main

from kiln.streams.cli import app

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "infra" / "k8s" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
COMMAND = re.compile(r"`(kiln [^`]+)`")
ROOT_COMMAND = typer.main.get_command(app)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_is_a_landing_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert "make demo" in text and "make test" in text
    for page in ("runtime", "saucer", "builder", "exec", "lean", "rl", "gateway", "operations", "security",
                 "benchmarks", "architecture", "install"):
        assert f"(docs/{page}.md)" in text, page


def test_every_relative_link_resolves() -> None:
    broken = []
    checked = 0
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            checked += 1
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and resolved.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", resolved.read_text(), flags=re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert checked > 20 and broken == []


def _words(snippet: str) -> list[str]:
    """The command's words up to a pipe into another program; brackets and parentheses (optional and alternative
    parts) dropped."""
    words = []
    for token in re.sub(r"[\[\]()]", " ", snippet).split():
        if token == "|" and words and not words[-1].startswith("-"):
            nxt = snippet.split(" | ", 1)[1].split()[0] if " | " in snippet else ""
            if nxt and not nxt.startswith("-") and not nxt.isupper():
                break  # `kiln k8s render | kubectl apply -f -`
        words.append(token)
    return words


def _check(snippet: str) -> list[str]:
    """Problems with one ``kiln …`` snippet: a word that is not a command of its group, a flag its command lacks."""
    command: Any = ROOT_COMMAND  # typer's own click: a group is a command with ``commands``
    problems = []
    words = _words(snippet)[1:]
    resolving = True
    takes_value = False
    for word in words:
        if word in ("|", "…", "...") or word.endswith("..."):
            continue
        if takes_value:  # the value of the option before
            takes_value = False
            continue
        if word.startswith("-"):
            options = {o: p for p in command.params for o in (*p.opts, *p.secondary_opts)}
            for flag in word.split("|"):
                name = flag.split("=")[0].rstrip(",")
                if name.startswith("-") and name not in {*options, "--help"}:
                    problems.append(f"{snippet!r}: {command.name} has no {name}")
                elif name in options and "=" not in flag:
                    takes_value = not getattr(options[name], "is_flag", False)
            continue
        if resolving and hasattr(command, "commands"):  # a group: the word names one of its commands
            found = [command.commands.get(a) for a in word.split("|")]
            if not all(found):
                problems.append(f"{snippet!r}: no command {word!r} in {command.name or 'kiln'}")
                break
            command = found[0]
            continue
        resolving = False  # an argument: the command is resolved
    return problems


def test_every_kiln_command_the_docs_name_exists_with_its_flags() -> None:
    snippets = {s for page in PAGES for s in COMMAND.findall(page.read_text())}
    assert len(snippets) > 40
    problems = [p for s in sorted(snippets) for p in _check(s)]
    assert problems == []


def test_the_command_check_catches_what_does_not_exist() -> None:
    assert _check("kiln worker echo --slots 2") == []
    assert _check("kiln k8s render values.yaml | kubectl apply -f -") == []
    assert _check("kiln frobnicate") and _check("kiln worker echo --no-such-flag") and _check("kiln dlq nothing")
