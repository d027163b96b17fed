"""The builder's real-repository corpus (``bench/corpus/projects.toml``): fetch each project's source artefact with
its ecosystem's ordinary client, check that it carries tests, and make it a one-commit repository tagged with its
version, under ``~/.cache/kiln/corpus`` (fetched once; the sources are never committed).

Usage: python -m bench.corpus [--only NAME ...]   (prints one line per project: ready, or why it was rejected)
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import tarfile
import tempfile
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from rich.progress import Progress

from tests.ingest.gitrepos import Builder

MANIFEST = Path(__file__).parent / "corpus" / "projects.toml"
CACHE = Path.home() / ".cache" / "kiln" / "corpus"
TEST_MARKERS = re.compile(r"(^|/)(tests?|testing|t|spec|__tests__)(/|$)|(^|/)test_[^/]*\.py$|_test\.go$|"
                          r"(^|/)[^/]*[._-]test\.[a-z]+$", re.IGNORECASE)


@dataclass(frozen=True)
class Project:
    ecosystem: str
    name: str
    version: str
    system: str
    test: str
    drawn: str = "before issue 50"  # or "issue 50 rule": drawn by the rule in the header of projects.toml
    cite: str = ""  # where its test command is written (file:line in the artefact)
    half: str = "tuning"  # the projects chosen before issue 50 count in the tuning half whatever their hash

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{self.ecosystem}-{self.name}-{self.version}").strip("-")


def _has_unit_tests(path: Path) -> bool:
    """Tests inside the sources (Rust's ``#[test]`` modules)."""
    return path.suffix == ".rs" and "#[test]" in path.read_text(errors="replace")


def half_of(ecosystem: str, name: str) -> str:
    """Issue 50's split: the first hex digit of sha256("ecosystem/name") below 8 is the reporting half."""
    return "reporting" if int(hashlib.sha256(f"{ecosystem}/{name}".encode()).hexdigest()[0], 16) < 8 else "tuning"


def carries_tests(root: Path) -> bool:
    """The unpacked artefact ships tests: a test directory, test files by their ecosystem's naming, Rust tests."""
    files = [p for p in root.rglob("*") if p.is_file()]
    return any(TEST_MARKERS.search(str(f.relative_to(root))) or _has_unit_tests(f) for f in files)


def projects() -> list[Project]:
    return [Project(**p) for p in tomllib.loads(MANIFEST.read_text())["project"]]


def _run(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {(done.stderr or done.stdout).strip()[-800:]}")


def _untar_single(archive: Path, into: Path) -> None:
    """Unpack an archive whose members share one top directory into ``into`` (that directory removed)."""
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
        tops = list(Path(tmp).iterdir())
        shutil.copytree(tops[0] if len(tops) == 1 and tops[0].is_dir() else Path(tmp), into, symlinks=True)


def apt_dir(work: Path) -> list[str]:
    """apt options for a private source-package index built from the machine's own Debian sources."""
    conf = work / "apt"
    if not (conf / "lists").is_dir():
        (conf / "lists" / "partial").mkdir(parents=True)
        text = "\n".join(p.read_text() for p in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")))
        (conf / "src.sources").write_text(re.sub(r"^Types: deb$", "Types: deb-src", text, flags=re.MULTILINE))
    options = ["-o", "Dir::Etc::SourceList=/dev/null", "-o", f"Dir::Etc::SourceParts={conf}",
               "-o", f"Dir::State::Lists={conf / 'lists'}"]
    if not any((conf / "lists").glob("*Sources*")):
        _run("apt-get", "-q", *options, "update")
    return options


def _debian_orig(project: Project, download: Path, work: Path) -> None:
    """The source package's main upstream tarball (``*.orig.tar.*``, no ``.orig-<component>``), as apt lists it."""
    done = subprocess.run(["apt-get", "-q", *apt_dir(work), "source", "--print-uris",
                           f"{project.name}={project.version}"], capture_output=True, text=True, timeout=300)
    found = re.search(r"^'(\S+)' (\S+\.orig\.tar\.\w+) \d+ SHA256:([0-9a-f]{64})$", done.stdout, re.MULTILINE)
    if found is None:
        raise RuntimeError(f"{project.name} {project.version}: no upstream tarball in the source index")
    url, name, sha256 = found.groups()
    shutil.rmtree(download)
    download.mkdir(parents=True)
    with urllib.request.urlopen(url, timeout=300) as response:
        data = response.read()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise RuntimeError(f"{name}: SHA256 differs from the source index")
    (download / name).write_bytes(data)


def fetch_sources(project: Project, into: Path, work: Path) -> None:
    """The project's source artefact, unpacked at ``into``."""
    download = work / project.slug
    download.mkdir(parents=True, exist_ok=True)
    if project.ecosystem == "pypi":
        _run("python3", "-m", "pip", "download", "-q", "--no-deps", "--no-binary", project.name,
             f"{project.name}=={project.version}", "-d", str(download))
        _untar_single(next(download.glob("*.tar.gz")), into)
    elif project.ecosystem == "crates":
        probe = download / "probe"
        probe.mkdir(exist_ok=True)
        (probe / "Cargo.toml").write_text(f'[package]\nname = "probe"\nversion = "0.0.0"\nedition = "2021"\n'
                                          f'[dependencies]\n{project.name} = "={project.version}"\n')
        (probe / "src").mkdir(exist_ok=True)
        (probe / "src" / "lib.rs").write_text("")
        _run("cargo", "vendor", "-q", "--versioned-dirs", str(download / "vendor"), cwd=probe)
        shutil.copytree(download / "vendor" / f"{project.name}-{project.version}", into, symlinks=True)
        (into / ".cargo-checksum.json").unlink(missing_ok=True)
    elif project.ecosystem == "go":
        done = subprocess.run(["go", "mod", "download", "-json", f"{project.name}@{project.version}"], cwd=download,
                              capture_output=True, text=True, timeout=900, check=True)
        source = Path(re.search(r'"Dir": "([^"]+)"', done.stdout).group(1))  # type: ignore[union-attr]
        shutil.copytree(source, into, symlinks=True)
        subprocess.run(["chmod", "-R", "u+w", str(into)], check=True)  # the module cache is read-only
    elif project.ecosystem == "npm":
        _run("npm", "pack", "--silent", f"{project.name}@{project.version}", "--pack-destination", str(download))
        _untar_single(next(download.glob("*.tgz")), into)
    elif project.ecosystem == "debian":
        try:
            _run("apt-get", "-q", *apt_dir(work), "source", f"{project.name}={project.version}", cwd=download)
        except RuntimeError:
            # The mirror may serve a package's upstream tarball without its Debian packaging (or its extra
            # components): the upstream tarball alone is the project's source, checked against the index's SHA256.
            _debian_orig(project, download, work)
            _untar_single(next(download.glob("*.orig.tar.*")), into)
            return
        unpacked = next(p for p in download.iterdir() if p.is_dir())
        shutil.copytree(unpacked, into, symlinks=True)
        shutil.rmtree(into / "debian", ignore_errors=True)  # the packaging, not the project
    else:
        raise ValueError(f"unknown ecosystem {project.ecosystem!r}")


def prepare(project: Project, cache: Path = CACHE) -> Path:
    """The project's one-commit repository (fetched once); raises when the artefact carries no tests."""
    repo = cache / "repos" / project.slug
    if (repo / ".git").is_dir():
        return repo
    with tempfile.TemporaryDirectory(dir=cache.parent if cache.parent.exists() else None) as tmp:
        staged = Path(tmp) / "src"
        fetch_sources(project, staged, cache / "downloads")
        if not carries_tests(staged):
            raise RuntimeError(f"{project.name} {project.version}: the source artefact carries no tests")
        shutil.rmtree(staged / ".git", ignore_errors=True)
        builder = Builder(Path(tmp) / "repo")
        for item in staged.iterdir():
            shutil.move(str(item), builder.path / item.name)
        builder("add", "--all", "--force")  # the artefact as shipped: its .gitignore must not drop files from it
        builder.commit(f"{project.name} {project.version} from its {project.ecosystem} source artefact")
        # Debian's "+~" (a repack with components) is not allowed in a git ref.
        builder("tag", f"v{project.version.lstrip('v').split(':')[-1]}".replace("~", "_"))
        repo.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(builder.path), repo)
    return repo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=[])
    args = parser.parse_args()
    chosen = [p for p in projects() if not args.only or p.name in args.only]
    with Progress() as progress:
        task = progress.add_task("fetching the corpus", total=len(chosen))
        for project in chosen:
            try:
                print(f"ready    {project.slug}: {prepare(project)}", flush=True)
            except Exception as e:
                print(f"rejected {project.slug}: {e}", flush=True)
            progress.advance(task)


if __name__ == "__main__":
    main()
