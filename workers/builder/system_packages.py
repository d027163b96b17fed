"""The Debian packages a C/C++ build requires by name, read from its build files: pkg-config modules (meson's
``dependency('x')``, CMake's ``pkg_check_modules``/``pkg_search_module``, autoconf's ``PKG_CHECK_MODULES``), CMake
packages (``find_package(X REQUIRED)``), meson's programs and libraries (``find_program('x')``, a compiler's
``find_library('x')``), each mapped to the bookworm package that ships ``x.pc``, ``XConfig.cmake``, ``/usr/bin/x`` or
``libx.so`` (programs of the sections builds use: devel, text,
libdevel, gnome, interpreters, graphics) by an index made from Debian's Contents files (``debian-bookworm-dev.tsv``,
made again by ``python -m kiln.workers.builder.system_packages TOOLCHAIN_INCLUDES CONTENTS.gz…``); and for make
and autotools builds, whose build files name no packages, the system headers their sources include (``<x.h>``,
``<dir/…>``) that neither the repository nor the toolchain image provides, by the package that ships them under
/usr/include. Only what the build requires:
meson's ``required: false`` or an option off by default (``required: get_option('x')``: a boolean whose value
is false, a feature not ``enabled``), CMake's calls without ``REQUIRED`` and autoconf's with an
action when not found are left out; a name the index lacks (``threads``, a library Debian does not package, a
script of the repository's own) is left to the build, which fails as it did. Names come from a repository, packages
only from the index: nothing but a bookworm package is installed.
"""

from __future__ import annotations

import gzip
import re
import sys
from functools import cache
from pathlib import Path

INDEX = Path(__file__).with_name("debian-bookworm-dev.tsv")
# Build-file trees never read: hidden ones (.git, quilt's .pc copies), vendored projects, build outputs, and
# examples and docs (optional parts, whose requirements, such as a GUI toolkit for a demo, are heavy and no test's).
_SKIP = re.compile(r"(^|/)(\.[^/]*|subprojects|third[_-]?party|vendor|external|build|examples?|docs?)(/|$)")
_VENDORED = re.compile(r"(^|/)(\.[^/]*|subprojects|third[_-]?party|vendor|external|build)(/|$)")
_MESON_DEP = re.compile(r"\b(dependency|find_program|find_library)\s*\(")
_CMAKE_CALL = re.compile(r"\b(find_package|pkg_check_modules|pkg_search_module)\s*\(", re.IGNORECASE)
_AC_PKG = re.compile(r"\bPKG_CHECK_MODULES(?:_STATIC)?\s*\(")
_PKG_NAME = re.compile(r"^[A-Za-z][\w.+-]*$")
_CMAKE_WORDS = {"REQUIRED", "QUIET", "IMPORTED_TARGET", "GLOBAL", "NO_CMAKE_PATH", "NO_CMAKE_ENVIRONMENT_PATH"}


@cache
def index() -> dict[tuple[str, str], str]:
    """(kind, name) → package: kind ``pc`` (a pkg-config module) or ``cmake`` (a CMake package, lower case)."""
    table = {}
    for line in INDEX.read_text().splitlines():
        kind, name, package = line.split("\t")
        table[kind, name] = package
    return table


def _call_args(text: str, start: int) -> str:
    """The text between the parenthesis before ``start`` and its match (comments are the caller's)."""
    depth, i = 1, start
    while i < len(text) and depth:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    return text[start:i - 1]


def meson_options_on(root: Path) -> set[str]:
    """The project's meson options that are on by default: booleans (true unless their value says false) and
    features whose value is ``enabled``."""
    on = set()
    for name in ("meson_options.txt", "meson.options"):
        path = root / name
        text = re.sub(r"#[^\n]*", "", path.read_text(errors="replace")) if path.is_file() else ""
        for m in re.finditer(r"\boption\s*\(", text):
            args = _call_args(text, m.end())
            option, kind = re.match(r"\s*'([^']+)'", args), re.search(r"\btype\s*:\s*'(\w+)'", args)
            value = re.search(r"\bvalue\s*:\s*'?(\w+)", args)
            if option and kind and ((kind.group(1) == "boolean" and (value is None or value.group(1) == "true"))
                                    or (kind.group(1) == "feature" and value and value.group(1) == "enabled")):
                on.add(option.group(1))
    return on


def _meson(text: str, options_on: set[str] | frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    text = re.sub(r"#[^\n]*", "", text)
    names = []
    for m in _MESON_DEP.finditer(text):
        args = _call_args(text, m.end())
        required = re.search(r"\brequired\s*:\s*(\S+?)\s*(?:,|$)", args)
        option = re.fullmatch(r"get_option\s*\(\s*'([^']+)'\s*\)", required.group(1)) if required else None
        if required and required.group(1) != "true" and not (option and option.group(1) in options_on):
            continue
        kind = {"dependency": "pc", "find_program": "bin", "find_library": "lib"}[m.group(1)]
        names += [(kind, n) for n in re.findall(r"^\s*\[?\s*'([^']+)'", args)[:1]]
    return names


def _cmake(text: str) -> list[tuple[str, str]]:
    text = re.sub(r"#[^\n]*", "", text)
    found: list[tuple[str, str]] = []
    for m in _CMAKE_CALL.finditer(text):
        words = _call_args(text, m.end()).split()
        if "REQUIRED" not in words or not words:
            continue
        if m.group(1).lower() == "find_package":
            found.append(("cmake", words[0]))
        else:  # pkg_check_modules(PREFIX [REQUIRED] [QUIET] ... module>=version ...)
            found += [("pc", re.split(r"[<>=]", w)[0]) for w in words[1:] if w not in _CMAKE_WORDS
                      and not re.match(r"^[<>=]|^\d", w)]
    return found


def _m4_args(args: str) -> list[str]:
    """An m4 call's arguments: split at the commas outside brackets and parentheses, quotes removed."""
    parts, depth, current = [], 0, ""
    for ch in args:
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return [p.strip().strip("[]").strip() for p in [*parts, current]]


def _autoconf(text: str) -> list[str]:
    text = re.sub(r"(^|\s)dnl\b[^\n]*", r"\1", text)
    names = []
    for m in _AC_PKG.finditer(text):
        args = _m4_args(_call_args(text, m.end()))
        if len(args) < 2 or (len(args) >= 4 and args[3]):
            continue
        names += [w for w in args[1].split() if not re.match(r"^[<>=!]|^\d", w)]
    return names


def required(root: Path, system: str) -> list[tuple[str, str]]:
    """(what asks for it, Debian package) for every name the build files of ``system`` require that the index maps,
    in the order found, each package once."""
    asked: list[tuple[str, str, str]] = []  # (file, kind, name)
    files = {"meson": ["meson.build"], "cmake": ["CMakeLists.txt", "*.cmake"],
             "autotools": ["configure.ac", "configure.in"]}.get(system, [])
    options_on = meson_options_on(root) if system == "meson" else set()
    if system in ("make", "autotools"):  # no build file names what the sources include
        asked += _includes(root)
    for pattern in files:
        for path in sorted(root.rglob(pattern)) if system != "autotools" else [root / pattern]:
            rel = str(path.relative_to(root))
            if not path.is_file() or _SKIP.search(rel):
                continue
            text = path.read_text(errors="replace")
            if system == "meson":
                asked += [(rel, kind, n) for kind, n in _meson(text, options_on)]
            elif system == "cmake":
                asked += [(rel, kind, n) for kind, n in _cmake(text)]
            else:
                asked += [(rel, "pc", n) for n in _autoconf(text)]
    table, out, seen = index(), [], set()
    for rel, kind, name in asked:
        if kind != "h" and not _PKG_NAME.match(name):
            continue
        keys = [(kind, name)] if kind != "cmake" else [("cmake", name.lower()), ("pc", name.lower()),
                                                       ("pc", f"lib{name.lower()}")]
        package = next((table[k] for k in keys if k in table), None)
        if package and package not in seen:
            seen.add(package)
            out.append((f"{name} ({_KINDS[kind]}, {rel})", package))
    return out


_KINDS = {"pc": "pkg-config", "cmake": "CMake package", "bin": "program", "h": "header", "lib": "library"}
_SOURCES = (".c", ".h", ".cc", ".cpp", ".cxx", ".hh", ".hpp")
_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*<([\w./+-]+)>", re.MULTILINE)


def _includes(root: Path) -> list[tuple[str, str, str]]:
    """(file, "h", key) for each system header the C/C++ sources include (``#include <x.h>``: key ``x.h``;
    ``<dir/x.h>``: key ``dir/``) that no file of the repository provides, examples included (make builds them)."""
    files = [f for f in root.rglob("*") if f.suffix in _SOURCES and f.is_file()
             and not _VENDORED.search(str(f.relative_to(root))) and not _OTHER_PLATFORM.search(f.name)]
    own = {str(f.relative_to(root)) for f in root.rglob("*")}
    found: dict[str, str] = {}
    for f in files:
        for include in _unconditional_includes(f.read_text(errors="replace"), f.suffix.startswith(".h")):
            key = include.split("/")[0] + "/" if "/" in include else include
            if key not in found and not any(o in (include, include + ".in") or o.endswith(("/" + include,
                                                                                        "/" + include + ".in"))
                                            for o in own):
                found[key] = str(f.relative_to(root))
    return [(rel, "h", key) for key, rel in found.items()]


# Sources for another platform, by their name (libiberty's pex-win32.c includes io.h, which Debian ships for
# another purpose): never compiled here.
_OTHER_PLATFORM = re.compile(r"win32|win64|windows|mingw|cygwin|darwin|macos|osx|beos|haiku|vms|os2|msdos|djgpp",
                             re.IGNORECASE)
_DIRECTIVE = re.compile(r"^[ \t]*#[ \t]*(if|ifdef|ifndef|endif|include)\b[ \t]*<?([\w./+-]*)", re.MULTILINE)


def _unconditional_includes(text: str, header: bool) -> list[str]:
    """The ``<…>`` includes outside any ``#if``: one under ``#ifdef _WIN32`` or ``#if HAVE_X`` is a platform's or
    an option's (io.h, mach/, an optional library). A header's include guard (its first directive an ``#ifndef``)
    is no condition."""
    depth, guard, includes = 0, 0, []
    for i, (directive, name) in enumerate(_DIRECTIVE.findall(text)):
        if directive.startswith("if"):
            guard = 1 if header and i == 0 and directive == "ifndef" else guard
            depth += 1
        elif directive == "endif":
            depth = max(0, depth - 1)
        elif depth <= guard and name:
            includes.append(name)
    return includes
# Cross compilers' tools and versioned copies are left out of the index (its size): builds ask for ``nasm``.
_BIN = re.compile(r"^usr/bin/(?![^/\s]*(?:-linux-|-w64-|mingw|-elf-|-eabi))([^/\s]+?)(?<!\d)\s+(\S+)$")
_LIB = re.compile(r"^usr/lib/x86_64-linux-gnu/lib([^/\s]+)\.so\s+(\S+)$")  # the -dev package's link
_BIN_SECTIONS = {"devel", "text", "libdevel", "gnome", "interpreters", "graphics"}
_PC = re.compile(r"^usr/(?:lib/x86_64-linux-gnu|lib|share)/pkgconfig/([^/\s]+)\.pc\s+(\S+)$")
_CMAKE_CONFIG = re.compile(r"^usr/(?:lib/x86_64-linux-gnu|lib|share)/cmake/([^/\s]+)/[^/\s]*[Cc]onfig\.cmake\s+(\S+)$")


_HEADER = re.compile(r"^usr/include/(?:x86_64-linux-gnu/)?([^/\s]+\.h|[^/\s]+/)\S*\s+(\S+)$")
# Directories one level down, for what a -I flag makes a top-level include (<libxml/parser.h> from
# /usr/include/libxml2): only where no top-level entry has the name and one package alone ships it.
_HEADER_BELOW = re.compile(r"^usr/include/(?:x86_64-linux-gnu/)?[^/\s]+/([^/\s.]+/)\S*\s+(\S+)$")


_PATTERNS = (("pc", _PC), ("cmake", _CMAKE_CONFIG), ("bin", _BIN), ("h", _HEADER), ("lib", _LIB))


def make_index(contents: list[Path], have: set[str]) -> str:
    """The index from Debian Contents files: per name, a ``-dev`` package first, then the shortest name. Headers
    (``x.h`` and ``dir/`` under /usr/include) the toolchain image already has (``have``: its /usr/include entries)
    are left out."""
    # (kind, name) -> package -> files: a header directory goes to the package shipping most of it.
    candidates: dict[tuple[str, str], dict[str, int]] = {}
    below: dict[str, dict[str, int]] = {}
    for path in contents:
        with gzip.open(path, "rt", errors="replace") as f:
            for line in f:
                m = _HEADER_BELOW.match(line)
                if m:
                    for package in m.group(2).split(","):
                        counts = below.setdefault(m.group(1), {})
                        counts[package.rpartition("/")[2]] = counts.get(package.rpartition("/")[2], 0) + 1
                for kind, pattern in _PATTERNS:
                    m = pattern.match(line)
                    if m and not (kind == "h" and m.group(1).rstrip("/") in have):
                        name = re.sub(r"-[\d.]+$", "", m.group(1)).lower() if kind == "cmake" else m.group(1)
                        for package in m.group(2).split(","):
                            section, _, name_of = package.rpartition("/")
                            if ((kind != "bin" or section.rpartition("/")[2] in _BIN_SECTIONS)
                                    and (kind != "lib" or name_of.endswith("-dev"))):
                                counts = candidates.setdefault((kind, name), {})
                                counts[name_of] = counts.get(name_of, 0) + 1
    for name, counts in below.items():
        if len(counts) == 1 and ("h", name) not in candidates and name.rstrip("/") not in have:
            candidates["h", name] = counts
    rows = [f"{kind}\t{name}\t{min(counts, key=lambda p: (-counts[p], not p.endswith('-dev'), len(p), p))}"
            for (kind, name), counts in sorted(candidates.items())]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # TOOLCHAIN_INCLUDES (ls of its /usr/include and /usr/include/<triplet>) CONTENTS.gz...
    INDEX.write_text(make_index([Path(a) for a in sys.argv[2:]], set(Path(sys.argv[1]).read_text().split())))
