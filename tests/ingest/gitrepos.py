"""Real git repositories for Saucer's tests, built with the git CLI, plus the oracle: what ``git show`` says."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

GIT_ENV = {"GIT_AUTHOR_NAME": "Ada", "GIT_AUTHOR_EMAIL": "ada@example.org", "GIT_COMMITTER_NAME": "Ada",
           "GIT_COMMITTER_EMAIL": "ada@example.org", "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/nonexistent",
           "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"}
NON_UTF8 = b"caf\xe9-\xff.txt"


def git(repo: Path, *args: str | bytes, stdin: bytes | None = None, when: int | None = None) -> bytes:
    env = dict(GIT_ENV)
    if when is not None:
        env["GIT_AUTHOR_DATE"] = env["GIT_COMMITTER_DATE"] = f"{when} +0000"
    return subprocess.run(["git", "-C", str(repo), *args], env=env, input=stdin, check=True,
                          capture_output=True).stdout


def write(repo: Path, rel: bytes | str, data: bytes | str) -> None:
    path = os.path.join(os.fsencode(repo), os.fsencode(rel))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


class Builder:
    """A working repository whose commits get fixed, increasing timestamps (so ids are reproducible)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.clock = 1_700_000_000
        path.mkdir(parents=True)
        git(path, "init", "-q", "-b", "main")

    def commit(self, message: str) -> str:
        self.clock += 60
        git(self.path, "add", "-A")
        git(self.path, "commit", "-q", "--allow-empty", "-m", message, when=self.clock)
        return git(self.path, "rev-parse", "HEAD").decode().strip()

    def __call__(self, *args: str | bytes) -> bytes:
        return git(self.path, *args, when=self.clock)


def rich_repository(path: Path) -> Builder:
    """Branches (one with a slash), light and annotated tags, a merge, a rename, binaries, a symlink, an
    executable, a submodule entry, a non-UTF-8 path, a 3 MB file and a deletion."""
    rng = random.Random(7)
    b = Builder(path)
    write(path, "README.md", "# demo\n")
    write(path, "src/app.py", "def main():\n    return 1\n")
    write(path, "bin/blob.bin", bytes(range(256)) * 40)
    b.commit("initial")
    b("tag", "v0.1")
    write(path, "src/app.py", "def main():\n    return 2\n")
    os.symlink("src/app.py", path / "link-to-app")
    write(path, "tools/run.sh", "#!/bin/sh\necho run\n")
    (path / "tools/run.sh").chmod(0o755)
    b.commit("symlink and executable")
    b("checkout", "-q", "-b", "feature/rename")
    b("mv", "src/app.py", "src/application.py")
    write(path, NON_UTF8, "latin-1 name\n")
    b.commit("rename, non-utf8 path")
    b("checkout", "-q", "main")
    write(path, "large/data.bin", rng.randbytes(3 << 20))
    write(path, "docs/guide.md", "guide\n" * 100)
    b.commit("large file")
    b.clock += 60
    b("merge", "-q", "--no-ff", "-m", "merge feature", "feature/rename")
    b("rm", "-q", "docs/guide.md")
    commit = b.commit("delete docs")
    (path / "vendor/lib").mkdir(parents=True)  # an unpopulated submodule, as a fresh clone has it
    b("update-index", "--add", "--cacheinfo", f"160000,{commit},vendor/lib")
    b("commit", "-q", "-m", "add submodule entry")
    b("tag", "-a", "v1.0", "-m", "release 1.0")
    for i in range(5):
        write(path, "src/counter.txt", "".join(f"line {j}\n" for j in range(i * 50)))
        b.commit(f"counter {i}")
    return b


def all_commits(repo: Path) -> list[str]:
    return git(repo, "rev-list", "--all").decode().split()


def files_at(repo: Path, commit: str) -> dict[bytes, tuple[str, str]]:
    """path -> (mode, object id) of every non-directory entry at ``commit``."""
    out = git(repo, "ls-tree", "-r", "-z", "--full-tree", commit)
    files: dict[bytes, tuple[str, str]] = {}
    for record in out.split(b"\0"):
        if record:
            meta, _, name = record.partition(b"\t")
            mode, _, oid = meta.decode().split(" ")
            files[name] = (mode, oid)
    return files


def show(repo: Path, commit: str, path: bytes) -> bytes:
    return git(repo, "show", commit.encode() + b":" + path)
