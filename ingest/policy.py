"""Which locations Saucer fetches from, and how: a location is untrusted input from whoever submits a request.

- Local paths and ``file://`` only under ``KILN_INGEST_LOCAL_ROOTS`` (none by default): the worker can read far
  more than the repositories it should serve.
- http(s)/git/ssh hosts that resolve to loopback, link-local, private, shared (CGNAT) or unspecified addresses are
  refused (server-side request forgery into the cluster) unless named in ``KILN_INGEST_ALLOW_HOSTS`` (host names or
  CIDRs). For http(s) git then connects to exactly the vetted address (``http.curloptResolve``) and follows no
  redirect, so neither DNS rebinding nor a redirect can move the fetch inward afterwards.
- ssh only with kiln's own key (``KILN_INGEST_SSH_KEY``, optionally ``KILN_INGEST_SSH_KNOWN_HOSTS``): never the
  worker user's keys, agent or ssh config.
- Credentials in a location (``https://user:token@host/…``, a query string) are used for the fetch only; what is
  stored, published and served is the location without them (``shown``), and git's messages are scrubbed of them.
"""

from __future__ import annotations

import contextlib
import ipaddress
import shlex
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.ingest.errors import InvalidLocation

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


def _inward(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in net for net in _INWARD)


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


def _local(path: str, policy: IngestPolicy) -> Path:
    real = Path(path).resolve()
    for root in policy.local_roots:
        if real == root.resolve() or real.is_relative_to(root.resolve()):
            return real
    raise InvalidLocation(f"local path {path!r} is outside KILN_INGEST_LOCAL_ROOTS "
                          f"({', '.join(map(str, policy.local_roots)) or 'none configured'})")


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
    if scheme == "file":
        return Vetted(f"file://{_local(parts.path, policy)}", location)
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
        pinned = address if ":" not in address else f"[{address}]"
        config = ("-c", f"http.curloptResolve={host}:{port}:{pinned}", "-c", "http.followRedirects=false")
    return Vetted(location, shown, config, env, secrets)
