"""Which locations Saucer fetches from, and how: a location is untrusted input from whoever submits a request.

- Local paths and ``file://`` only under ``KILN_INGEST_LOCAL_ROOTS`` (none by default): the worker can read far
  more than the repositories it should serve. Not only the location: everything git would follow from it to read
  objects is resolved and must lie under a root too (a ``.git`` file or link, the ``.git`` suffixes git tries, a
  worktree's ``commondir``, ``objects/info/alternates`` to any depth, every link inside those git directories;
  ``LocationOutsideRoots`` otherwise), and git is then given the git directory found, as a plain path (git
  percent-decodes ``file://`` paths, so they are decoded before the check). Git's own object-directory variables
  never reach it (``download.git_env``). Hard links and changes made to the roots between the check and the fetch
  are not seen: the roots must not be writable by whoever submits locations.
- http(s)/git/ssh hosts that resolve to loopback, link-local, private, shared (CGNAT), unspecified or any other
  non-global address (also when carried inside an IPv6 address: mapped, compatible, 6to4, NAT64) are refused
  (server-side request forgery into the cluster) unless named in ``KILN_INGEST_ALLOW_HOSTS`` (host names or CIDRs).
  The host is resolved with ``getaddrinfo``, as git and libcurl resolve it, so numeric spellings (``2130706433``,
  ``0x7f000001``, ``0177.0.0.1``, ``127.1``) and names resolving inward are judged by the address they reach, and
  every address of a name must pass. For http(s) git then connects to exactly the vetted address
  (``http.curloptResolve``) and follows no redirect, so neither DNS rebinding nor a redirect can move the fetch
  inward afterwards; git:// and ssh connect by name again (not pinned).
- ssh only with kiln's own key (``KILN_INGEST_SSH_KEY``, optionally ``KILN_INGEST_SSH_KNOWN_HOSTS``): never the
  worker user's keys, agent or ssh config.
- Credentials in a location (``https://user:token@host/…``, a query string) are used for the fetch only; what is
  stored, published and served is the location without them (``shown``), and git's messages are scrubbed of them.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shlex
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.ingest.errors import DownloadFailed, InvalidLocation, LocationOutsideRoots

_INWARD = [ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12", "192.168.0.0/16",
    "224.0.0.0/4", "240.0.0.0/4", "::/128", "::1/128", "fc00::/7", "fe80::/10", "ff00::/8")]
_DEFAULT_PORTS = {"http": 80, "https": 443, "git": 9418, "ssh": 22}


class IngestPolicy(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KILN_INGEST_")

    local_roots: list[Path] = Field(default_factory=list, description="Folders local paths/file:// may lie under.")
    allow_hosts: list[str] = Field(default_factory=list, description="Hosts or CIDRs allowed to resolve inward.")
    ssh_key: Path | None = Field(None, description="The one private key ssh locations are fetched with.")
    ssh_known_hosts: Path | None = Field(None, description="Known hosts for ssh (unset: accept new, pin after).")


@dataclass(frozen=True)
class Vetted:
    location: str  # what git fetches: credentials included
    shown: str  # what is stored and served: credentials stripped
    git_config: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    secrets: tuple[str, ...] = ()

    def scrub(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text


_NAT64 = [ipaddress.ip_network(n) for n in ("64:ff9b::/96", "64:ff9b:1::/48")]


def _embedded(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """IPv4 addresses an IPv6 address carries (mapped, compatible, 6to4, NAT64): each is checked as well."""
    found = [v4 for v4 in (ip.ipv4_mapped, ip.sixtofour) if v4 is not None]
    if int(ip) >> 32 == 0 or any(ip in net for net in _NAT64):  # ::a.b.c.d (deprecated), NAT64 prefixes
        found.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return found


def _inward(address: str) -> bool:
    """Anything but a global unicast address: loopback, private, link-local, shared, reserved, documentation."""
    ip = ipaddress.ip_address(address.split("%")[0])
    candidates: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        candidates += _embedded(ip)
    return any(not c.is_global or any(c in net for net in _INWARD) for c in candidates)


def _literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    return True


def _allowed(host: str, address: str, allow: list[str]) -> bool:
    for entry in allow:
        if entry.lower() == host.lower():
            return True
        try:
            if ipaddress.ip_address(address.split("%")[0]) in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:
            continue
    return False


def _resolve(host: str, port: int, policy: IngestPolicy) -> str:
    """The first address of ``host``; InvalidLocation when any of them points inward and the host is not allowed."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise InvalidLocation(f"host {host!r} does not resolve: {e}") from None
    addresses = [str(info[4][0]) for info in infos]
    for address in addresses:
        if _inward(address) and not _allowed(host, address, policy.allow_hosts):
            raise InvalidLocation(f"host {host!r} resolves to {address}, an internal address (allow it with "
                                  "KILN_INGEST_ALLOW_HOSTS)")
    return addresses[0]


_ALTERNATES_DEPTH = 5  # git follows alternates of alternates this deep, then stops with an error
_SMALL_FILE = 64 << 10  # .git files, commondir and alternates are a few lines


def _roots_text(policy: IngestPolicy) -> str:
    return ", ".join(map(str, policy.local_roots)) or "none configured"


class _GitDirCheck:
    """Follows what git follows from a local location and refuses anything that leads outside the roots."""

    def __init__(self, location: str, policy: IngestPolicy) -> None:
        self.location = location
        self.policy = policy
        self.roots = [root.resolve() for root in policy.local_roots]
        self.walked: set[Path] = set()

    def inside(self, path: Path, what: str) -> Path:
        try:
            real = path.resolve()
        except (RuntimeError, OSError):  # a link loop
            raise LocationOutsideRoots(f"local path {self.location!r}: {what} is a link loop") from None
        if not any(real == root or real.is_relative_to(root) for root in self.roots):
            raise LocationOutsideRoots(f"local path {self.location!r}: {what} leads outside KILN_INGEST_LOCAL_ROOTS "
                                       f"({_roots_text(self.policy)})")
        return real

    def read(self, path: Path, what: str) -> str:
        with open(path, "rb") as f:
            data = f.read(_SMALL_FILE + 1)
        if len(data) > _SMALL_FILE:
            raise InvalidLocation(f"local path {self.location!r}: {what} is larger than {_SMALL_FILE} bytes")
        return data.decode(errors="surrogateescape")

    def walk(self, directory: Path) -> None:
        """Every link under ``directory`` (already inside a root) must resolve inside a root; linked folders are
        walked too."""
        if directory in self.walked:
            return
        self.walked.add(directory)
        for folder, dirs, files in os.walk(directory, followlinks=False):
            for name in (*dirs, *files):
                entry = Path(folder) / name
                if entry.is_symlink():
                    target = self.inside(entry, f"the link {entry.relative_to(directory)} in {directory.name}")
                    if target.is_dir():
                        self.walk(target)

    def git_dir(self, real: Path) -> Path:
        """The git directory git would use for the location ``real``, with everything it reads objects through
        checked."""
        dotgit = real / ".git"
        if dotgit.is_symlink() or dotgit.exists():
            gitdir = self.inside(dotgit, "its .git link") if dotgit.is_symlink() else dotgit
            if gitdir.is_file():
                first = self.read(gitdir, "its .git file").split("\n", 1)[0]
                if not first.startswith("gitdir: "):
                    raise InvalidLocation(f"local path {self.location!r}: its .git file names no gitdir")
                target = Path(first[len("gitdir: "):].rstrip("\r"))
                gitdir = self.inside(target if target.is_absolute() else dotgit.parent / target, "its .git file")
        else:
            gitdir = real
        if not gitdir.is_dir():
            raise InvalidLocation(f"local path {self.location!r} is not a git repository")
        if (gitdir / ".git").is_symlink() or (gitdir / ".git").exists():  # git would look there first
            raise InvalidLocation(f"local path {self.location!r}: its git directory holds a .git of its own")
        self.walk(gitdir)
        common = gitdir
        if (gitdir / "commondir").is_file():
            target = Path(self.read(gitdir / "commondir", "its commondir").split("\n", 1)[0].rstrip("\r"))
            common = self.inside(target if target.is_absolute() else gitdir / target, "its commondir")
            self.walk(common)
        for objects in dict.fromkeys((gitdir / "objects", common / "objects")):
            self.alternates(objects, 0)
        return gitdir

    def alternates(self, objects: Path, depth: int) -> None:
        listing = objects / "info" / "alternates"
        if not listing.is_file():
            return
        if depth >= _ALTERNATES_DEPTH:
            raise InvalidLocation(f"local path {self.location!r}: alternates nested deeper than {_ALTERNATES_DEPTH}")
        for line in self.read(listing, "its objects/info/alternates").split("\n"):
            line = line.rstrip("\r")
            if not line or line.startswith("#"):
                continue
            if line.startswith('"'):  # C-quoted: not followed, refused
                raise LocationOutsideRoots(f"local path {self.location!r}: a quoted entry in its "
                                           "objects/info/alternates is not accepted")
            target = Path(line)
            real = self.inside(target if target.is_absolute() else objects / target, "its objects/info/alternates")
            self.walk(real)
            self.alternates(real, depth + 1)


def _local(path: str, policy: IngestPolicy) -> Path:
    """The git directory to fetch from for the local location ``path``; LocationOutsideRoots when the location or
    anything git reads objects through lies outside the roots."""
    check = _GitDirCheck(path, policy)
    real = Path(path).resolve()
    if not any(real == root or real.is_relative_to(root) for root in check.roots):
        raise LocationOutsideRoots(f"local path {path!r} is outside KILN_INGEST_LOCAL_ROOTS ({_roots_text(policy)})")
    suffixed = Path(f"{real}.git")  # git would try ``path.git`` and ``path.git/.git`` next: never handed to it
    if not real.exists() and not (suffixed.exists() or suffixed.is_symlink()):
        raise DownloadFailed("not_found", f"local path {path!r} does not exist")
    if not real.is_dir():
        raise InvalidLocation(f"local path {path!r} is not a directory under KILN_INGEST_LOCAL_ROOTS")
    return check.git_dir(real)


def _ssh(policy: IngestPolicy) -> dict[str, str]:
    if policy.ssh_key is None:
        raise InvalidLocation("ssh locations need kiln's own key (KILN_INGEST_SSH_KEY); the worker's are never used")
    known = (f"-o UserKnownHostsFile={shlex.quote(str(policy.ssh_known_hosts))} -o StrictHostKeyChecking=yes"
             if policy.ssh_known_hosts else "-o UserKnownHostsFile=/dev/null -o StrictHostKeyChecking=accept-new")
    return {"GIT_SSH_COMMAND": f"ssh -F /dev/null -o BatchMode=yes -o IdentitiesOnly=yes -o IdentityAgent=none "
                               f"-i {shlex.quote(str(policy.ssh_key))} {known}"}


def shown_form(location: str) -> str:
    """``location`` without credentials (userinfo other than an ssh user name, query, fragment): purely textual,
    so it is safe to record even for a location that is then refused."""
    if "://" not in location:
        return location
    parts = urlsplit(location)
    if not parts.hostname:
        return location.split("?", 1)[0].split("#", 1)[0]
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    with contextlib.suppress(ValueError):  # an invalid port is dropped from what is shown
        host += f":{parts.port}" if parts.port else ""
    user = f"{parts.username}@" if parts.username and parts.scheme.lower() == "ssh" else ""
    return urlunsplit((parts.scheme, user + host, parts.path, "", ""))


def vet(location: str, scp_like: bool, policy: IngestPolicy) -> Vetted:
    """``location`` (already checked for form by ``download.check_location``) under the policy."""
    if scp_like:  # user@host:path is ssh
        ssh_env = _ssh(policy)
        _resolve(location.split("@", 1)[1].split(":", 1)[0], 22, policy)
        return Vetted(location, location, env=ssh_env)
    if location.startswith("/"):
        return Vetted(str(_local(location, policy)), location)
    parts = urlsplit(location)
    scheme = parts.scheme.lower()
    if scheme == "file":  # git percent-decodes file:// paths; it is given the checked git directory as a path
        if parts.netloc not in ("", "localhost"):
            raise InvalidLocation(f"location {location!r}: file:// names a host")
        return Vetted(str(_local(unquote(parts.path), policy)), location)
    env: dict[str, str] = _ssh(policy) if scheme == "ssh" else {}
    host = parts.hostname or ""
    if not host:
        raise InvalidLocation(f"location {location!r} names no host")
    try:
        port = parts.port or _DEFAULT_PORTS[scheme]
    except ValueError:
        raise InvalidLocation(f"location {location!r} has an invalid port") from None
    address = _resolve(host, port, policy)
    secrets = tuple(s for s in (parts.password, parts.query, parts.fragment) if s)
    if parts.username and scheme != "ssh":  # https://TOKEN@host: the user name is the credential
        secrets += (parts.username,)
    shown = shown_form(location)
    config: tuple[str, ...] = ()
    if scheme in ("http", "https"):
        config = ("-c", "http.followRedirects=false")
        if not _literal(host):  # an address needs no pin (and curl cannot parse a resolve entry for IPv6 literals)
            pinned = address if ":" not in address else f"[{address}]"
            config = ("-c", f"http.curloptResolve={host}:{port}:{pinned}", *config)
    return Vetted(location, shown, config, env, secrets)
