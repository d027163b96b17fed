"""A repository's Dockerfile is untrusted input to dockerd, which performs some of its instructions itself, on the
host's behalf, outside any build container: it fetches ``ADD`` URLs on the host's network, reads ``COPY --from``
and ``FROM`` images out of its whole image store, and writes ``USER``, ``VOLUME``, ``LABEL``, ``ONBUILD`` and
``HEALTHCHECK`` into the image that kiln's other stages then trust. ``confine`` parses the Dockerfile the way
dockerd's parser does (parser directives, line continuations, comments inside them) and writes it out again with
only what a build sandbox may do:

- ``FROM`` is a local stand-in for a hub image, ``scratch``, or an earlier stage of the same Dockerfile;
- ``COPY --from`` names an earlier stage (by name or index), never an image; ``RUN`` takes no flags (BuildKit's
  ``--mount=from=``, ``--network``);
- ``ADD`` of a URL (or of anything a build argument could turn into one) is refused; a local ``ADD`` becomes a
  ``COPY`` (no archive is unpacked, so no root-owned or setuid file comes out of a tarball);
- every ``COPY`` gives its files to uid 1000, every stage starts as uid 1000, and every ``USER`` is uid 1000: no
  ``RUN`` of the repository's runs as root;
- ``VOLUME``, ``LABEL``, ``ONBUILD`` and ``HEALTHCHECK`` are dropped: the image carries only kiln's labels;
- anything else the parser does not know is refused.

The rewritten file has one instruction per line and keeps the ``escape`` directive, so dockerd reads the same
instructions kiln checked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.workers.builder.errors import PlanError

UNPRIVILEGED = "1000:1000"
# Instructions passed through as they are: they act inside the build container or only on its environment.
PASSED = {"RUN", "CMD", "ENTRYPOINT", "ENV", "ARG", "WORKDIR", "EXPOSE", "SHELL", "STOPSIGNAL", "MAINTAINER"}
DROPPED = {"VOLUME": "an image volume would escape the exec stage's disk limit",
           "LABEL": "labels of a built image are kiln's own (kiln.* bookkeeping)",
           "ONBUILD": "triggers would run in a later build on top of this image",
           "HEALTHCHECK": "dockerd would run it inside every session of the image, outside its commands"}
_DIRECTIVE = re.compile(r"^#\s*([a-zA-Z][a-zA-Z0-9]*)\s*=\s*(.+?)\s*$")
_INSTRUCTION = re.compile(r"^([A-Za-z]+)(?:\s+(.*))?$", re.DOTALL)
_STAGE_NAME = re.compile(r"^[a-z][a-z0-9._-]*$")


@dataclass
class Confined:
    text: str
    decisions: list[tuple[str, str, str]] = field(default_factory=list)  # (topic, choice, reason)


def instructions(text: str) -> tuple[str, list[str]]:
    """(escape character, logical lines) as dockerd's parser reads them: parser directives only before anything
    else, a line ending in the escape character continues on the next, comment and empty lines inside a
    continuation are skipped."""
    escape = "\\"
    lines = text.lstrip("\ufeff").splitlines()
    start = 0
    for start, raw in enumerate(lines):  # noqa: B007 (the index is used after the loop)
        m = _DIRECTIVE.match(raw.strip())
        if not m:
            break
        if m.group(1).lower() == "escape":
            if m.group(2) not in ("\\", "`"):
                raise PlanError(f"Dockerfile escape directive {m.group(2)!r}: only \\ and ` exist")
            escape = m.group(2)
    else:
        start = len(lines)
    logical: list[str] = []
    current: str | None = None
    for raw in lines[start:]:
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue  # outside an instruction, and inside a continuation alike
        line = raw.rstrip() if current is not None else raw.strip()
        if line.endswith(escape):
            current = (current or "") + line[:-1]
            continue
        logical.append(((current or "") + line).strip())
        current = None
    if current is not None and current.strip():
        logical.append(current.strip())
    return escape, logical


def _flags(args: str) -> tuple[dict[str, str], str]:
    """Leading ``--name=value`` flags of an instruction and the rest."""
    flags: dict[str, str] = {}
    while True:
        m = re.match(r"^--([A-Za-z-]+)(?:=(\S*))?\s+(.*)$", args, re.DOTALL)
        if not m:
            return flags, args
        flags[m.group(1).lower()] = m.group(2) or ""
        args = m.group(3)


def _words(rest: str) -> list[str]:
    """Sources and destination of COPY/ADD, in the JSON or the plain form."""
    if rest.lstrip().startswith("["):
        try:
            words = json.loads(rest)
        except json.JSONDecodeError:
            words = None
        if isinstance(words, list) and all(isinstance(w, str) for w in words):
            return words
    return rest.split()


def confine(text: str, local_image: Callable[[str], str]) -> Confined:
    """The Dockerfile rewritten as the module docstring says; ``local_image(hub image)`` gives the line to put in
    place of a hub image (or raises PlanError). Raises PlanError for what cannot be made safe."""
    escape, lines = instructions(text)
    out = Confined("" if escape == "\\" else f"# escape={escape}\n")
    stages: list[str] = []  # names of earlier stages ("" when unnamed), by index
    dropped: set[str] = set()

    def emit(line: str) -> None:
        out.text += line + "\n"

    for line in lines:
        m = _INSTRUCTION.match(line)
        if not m:
            raise PlanError(f"Dockerfile line {line[:80]!r}: not an instruction")
        keyword, args = m.group(1).upper(), (m.group(2) or "").strip()
        if keyword == "FROM":
            flags, rest = _flags(args)
            parts = rest.split()
            if not parts or (len(parts) not in (1, 3)) or (len(parts) == 3 and parts[1].lower() != "as"):
                raise PlanError(f"Dockerfile FROM {args[:80]!r}: not `FROM image [AS name]`")
            image = parts[0]
            name = parts[2].lower() if len(parts) == 3 else ""
            if name and not _STAGE_NAME.match(name):
                raise PlanError(f"Dockerfile stage name {name!r} is not a valid stage name")
            earlier = image.lower() in [s for s in stages if s] or image == "scratch"
            source = image.lower() if earlier else local_image(image)
            emit(f"FROM {source}" + (f" AS {name}" if name else ""))
            # Every stage starts unprivileged, whatever its base's user was.
            emit(f"USER {UNPRIVILEGED}")
            stages.append(name)
        elif not stages and keyword != "ARG":
            raise PlanError(f"Dockerfile {keyword} before any FROM")
        elif keyword == "USER":
            if args not in (UNPRIVILEGED, "1000", "kiln"):
                out.decisions.append(("dockerfile user", UNPRIVILEGED, f"`USER {args[:40]}` replaced: the project "
                                      "build never runs as root, nor as anyone but the build user"))
            emit(f"USER {UNPRIVILEGED}")
        elif keyword in ("COPY", "ADD"):
            flags, rest = _flags(args)
            words = _words(rest)
            if len(words) < 2:
                raise PlanError(f"Dockerfile {keyword} {args[:80]!r}: needs a source and a destination")
            sources = words[:-1]
            if keyword == "ADD":
                remote = [s for s in sources if "://" in s or s.startswith("git@") or "$" in s]
                if remote:
                    raise PlanError(f"Dockerfile ADD {remote[0][:80]!r}: dockerd would fetch it on the host's network "
                                    "(download it in a RUN step instead, through the build proxy)")
                if "from" in flags:
                    raise PlanError("Dockerfile ADD --from does not exist")
            if "from" in flags:
                # Earlier stages only: a name dockerd cannot find among them is looked up as an image.
                ref, before = flags["from"].lower(), stages[:-1]
                known = (ref.isdigit() and int(ref) < len(before)) or (bool(ref) and ref in before)
                if not known:
                    raise PlanError(f"Dockerfile COPY --from={flags['from'][:80]}: only an earlier stage of the same "
                                    "Dockerfile can be copied from, never an image")
            kept = "".join(f" --{k}={v}" for k, v in flags.items() if k == "from")
            if keyword == "ADD":
                out.decisions.append(("dockerfile add", "COPY", "ADD of local files becomes COPY: no archive is "
                                      "unpacked (ownership and setuid bits from a tarball never reach the image)"))
            emit(f"COPY --chown={UNPRIVILEGED}{kept} {json.dumps(words)}")
        elif keyword in DROPPED:
            if keyword not in dropped:
                dropped.add(keyword)
                out.decisions.append((f"dockerfile {keyword.lower()}", "dropped", DROPPED[keyword]))
        elif keyword == "RUN" and _flags(args)[0]:
            # BuildKit's RUN flags (--mount=from=<image>, --network=host, --security=insecure) would reach images
            # and networks outside the sandbox; the classic builder kiln asks for refuses them too.
            raise PlanError(f"Dockerfile RUN --{next(iter(_flags(args)[0]))}: RUN takes no flags here")
        elif keyword in PASSED:
            emit(f"{keyword} {args}".rstrip())
        else:
            raise PlanError(f"Dockerfile instruction {keyword}: not one kiln lets a repository use")
    if not stages:
        raise PlanError("Dockerfile without FROM")
    return out
