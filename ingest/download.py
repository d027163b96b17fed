"""Fetch a repository into a bare repo: parallel runners over disjoint ref sets, then one plain fetch, then give up.

Git runs with a scrubbed environment: no prompts, no user or system config, only the file/git/http(s)/ssh
transports (``ext::`` would run a command), and a location can never be read as an option.
"""

from __future__ import annotations

import asyncio
import fnmatch
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from kiln.ingest.errors import DownloadFailed, InvalidLocation
from kiln.ingest.policy import Vetted
from kiln.schemas.ingest import FailureReason

_SCP_LIKE = re.compile(r"^[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:[^:]")
_URL = re.compile(r"^(https?|git|ssh|file)://", re.IGNORECASE)
_SHA = re.compile(r"^[0-9a-f]{40}$")


def check_location(location: str) -> str:
    """The location as git should see it; raises InvalidLocation for anything but a URL, scp-like or absolute path."""
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in location):
        raise InvalidLocation("location contains whitespace or control characters")
    if location.startswith("-"):
        raise InvalidLocation("location may not start with '-'")
    if _URL.match(location) or _SCP_LIKE.match(location):
        return location
    if "::" in location:
        raise InvalidLocation("remote-helper locations ('transport::address') are not accepted")
    if location.startswith("/"):
        return location
    raise InvalidLocation(f"not a git URL or absolute path: {location!r}")


def git_env(home: Path) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_ASKPASS": "/bin/false",
        "GIT_SSH_COMMAND": "ssh -o BatchMode=yes",
        "GIT_ALLOW_PROTOCOL": "file:git:http:https:ssh",
        "LC_ALL": "C",
    }


# Keeps fetches from doing anything but fetching (no background gc, no hooks acting on the received objects).
GIT_QUIET_CONFIG = ["-c", "gc.auto=0", "-c", "maintenance.auto=false", "-c", "core.hooksPath=/dev/null",
                    "-c", "fetch.writeCommitGraph=false", "-c", "uploadpack.allowAnySHA1InWant=true"]


@dataclass
class Git:
    """Runs git in one bare repository with the scrubbed environment and a time limit per command; ``config`` and
    ``env`` carry what the ingest policy decided for the location (pinned address, ssh key)."""

    repo: Path
    timeout_s: float
    config: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    async def run(self, *args: str, stdin: bytes | None = None, timeout_s: float | None = None) -> bytes:
        proc = await asyncio.create_subprocess_exec(
            "git", *GIT_QUIET_CONFIG, *self.config, *args, cwd=self.repo, env={**git_env(self.repo), **self.env},
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin), timeout_s or self.timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise DownloadFailed("timeout", f"git {args[0]} ran past {timeout_s or self.timeout_s:.0f}s") from None
        except asyncio.CancelledError:  # the job was given up: its git must not run on beside the retry
            proc.kill()
            await proc.wait()
            raise
        if proc.returncode != 0:
            raise DownloadFailed(_classify(err), f"git {args[0]}: {err.decode(errors='replace').strip()[-600:]}")
        return out


def _classify(stderr: bytes) -> FailureReason:
    text = stderr.decode(errors="replace").lower()
    if "authentication" in text or "could not read username" in text or "permission denied" in text:
        return "auth"
    if ("does not appear to be a git repository" in text or "not found" in text
            or "does not exist" in text or "no such" in text):
        return "not_found"
    if "not our ref" in text or "unadvertised object" in text or "bad object" in text:
        return "pin_unavailable"
    return "error"


def is_scp_like(location: str) -> bool:
    return bool(_SCP_LIKE.match(location))


async def init_bare(repo: Path, source: Vetted | None = None) -> Git:
    await asyncio.to_thread(repo.mkdir, parents=True, exist_ok=True)
    git = Git(repo, 600, source.git_config, source.env) if source else Git(repo, 600)
    await git.run("init", "--quiet", "--bare", ".")
    return git


async def list_remote(git: Git, location: str, patterns: list[str]) -> tuple[dict[str, str], str | None]:
    """The remote's refs matching ``patterns`` (name -> id) and the branch its HEAD points to."""
    out = await git.run("ls-remote", "--symref", "--", location, timeout_s=120)
    refs: dict[str, str] = {}
    head = None
    for line in out.decode(errors="surrogateescape").splitlines():
        left, _, name = line.partition("\t")
        if left.startswith("ref: ") and name == "HEAD":
            head = left[5:]
        elif not name.endswith("^{}") and matches(name, patterns):
            refs[name] = left
    return refs, head


def matches(ref: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(ref, p) for p in patterns)


async def _fetch(git: Git, location: str, refspecs: list[str]) -> None:
    await git.run("fetch", "--quiet", "--no-tags", "--no-write-fetch-head", "--", location, *refspecs)


async def download(repo: Path, source: Vetted, patterns: list[str], pin: dict[str, str] | None,
                   runners: int = 4) -> tuple[str, dict[str, str], str | None]:
    """Fetch into the bare repo ``repo``; returns (strategy, refs name -> id as stored, remote HEAD branch).

    Raises DownloadFailed with the reason of the last failed strategy.
    """
    location = source.location
    git = await init_bare(repo, source)
    try:
        remote, head = await list_remote(git, location, patterns)
        wanted = sorted(pin) if pin is not None else sorted(remote)
        if not wanted:
            raise DownloadFailed("no_refs", f"no refs match {patterns}")
        chunks = [wanted[i::runners] for i in range(min(runners, len(wanted)))]
        await asyncio.gather(*(_fetch(git, location, [f"+{r}:{r}" for r in chunk if r in remote])
                               for chunk in chunks))
        return "parallel", await _settle_refs(git, location, patterns, pin), head
    except DownloadFailed as first:
        if first.reason == "no_refs":
            raise
    # One plain fetch of everything into a fresh repository, then keep only the wanted refs.
    await asyncio.to_thread(_wipe, repo)
    git = await init_bare(repo, source)
    await git.run("fetch", "--quiet", "--no-tags", "--no-write-fetch-head", "--", location, "+refs/*:refs/*",
                  timeout_s=1800)
    refs = await _settle_refs(git, location, patterns, pin)
    if not refs:
        raise DownloadFailed("no_refs", f"no refs match {patterns}")
    try:
        _, head = await list_remote(git, location, [])
    except DownloadFailed:
        head = None
    return "single", refs, head


async def _settle_refs(git: Git, location: str, patterns: list[str], pin: dict[str, str] | None) -> dict[str, str]:
    """Make the repository hold exactly the wanted refs: the pattern matches, or exactly the pinned commits."""
    refs = await local_refs(git)
    if pin is None:
        keep = {name: oid for name, oid in refs.items() if matches(name, patterns)}
    else:
        for name, oid in sorted(pin.items()):
            if not _SHA.match(oid):
                raise DownloadFailed("pin_unavailable", f"pin {name} -> {oid!r} is not a full commit id")
            if not await has_commit(git, oid):
                await git.run("fetch", "--quiet", "--no-tags", "--no-write-fetch-head", "--", location, oid)
        keep = dict(pin)
    script = "".join(f"delete {name}\n" for name in refs if name not in keep)
    script += "".join(f"update {name} {oid}\n" for name, oid in keep.items() if refs.get(name) != oid)
    if script:
        await git.run("update-ref", "--no-deref", "--stdin", stdin=script.encode(errors="surrogateescape"))
    return keep


async def local_refs(git: Git) -> dict[str, str]:
    out = await git.run("for-each-ref", "--format=%(objectname) %(refname)")
    return {name: oid for oid, _, name in (line.partition(" ") for line in
                                          out.decode(errors="surrogateescape").splitlines())}


async def has_commit(git: Git, oid: str) -> bool:
    try:
        await git.run("cat-file", "-e", f"{oid}^{{commit}}")
    except DownloadFailed:
        return False
    return True


def _wipe(repo: Path) -> None:
    shutil.rmtree(repo, ignore_errors=True)
