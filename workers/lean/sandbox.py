"""Each REPL process in a bubblewrap sandbox: ``#eval`` can run IO, so Lean input is untrusted code.

Inside: new user, pid, net, ipc, uts and cgroup namespaces (no route anywhere: the only interface is its own
loopback; uid/gid 65534 without capabilities; the worker's processes are invisible), an environment holding only
what the REPL needs (never the worker's secrets), the system's ``/usr`` plus the toolchain, the REPL and the Lake
project read-only, a private writable scratch directory (the process's work dir: pickles live there) and a private
``/tmp``. It dies with the worker (``--die-with-parent``; the pool also kills its process group).

On Kubernetes the worker's pod needs unprivileged user namespaces (the default on current kernels; a seccomp profile
that allows ``clone``/``unshare`` with ``CLONE_NEWUSER``, e.g. RuntimeDefault on containerd ≥ 1.7, and no
AppArmor profile that denies them); it needs no privileged mode and no added capabilities.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

from kiln.streams.errors import ConfigError

NOBODY = "65534"
# What a dynamically linked toolchain needs from /etc; the rest of /etc (and of the host) stays out.
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives", "/etc/localtime",
             "/etc/nsswitch.conf")
# Variables a REPL may need; anything else of the worker's environment (credentials above all) stays out.
REPL_ENV = ("LEAN_PATH", "LEAN_SYSROOT", "LEAN_SRC_PATH", "ELAN_HOME", "LANG", "LC_ALL")


def _install_prefix(executable: Path) -> Path:
    """The tree an executable runs from: ``…/bin/x`` → ``…`` (its libraries live beside bin/)."""
    real = executable.resolve()
    return real.parent.parent if real.parent.name == "bin" else real.parent


def command_paths(command: Sequence[str]) -> list[Path]:
    """Read-only paths the command itself needs: its executable's install tree and any file argument's folder."""
    paths: list[Path] = []
    found = shutil.which(command[0]) if command else None
    if found:
        paths.append(_install_prefix(Path(found)))
    for arg in command[1:]:
        if arg.startswith("/") and Path(arg).is_file():
            paths.append(Path(arg).resolve().parent)
    return paths


def bwrap_command(command: Sequence[str], *, scratch: Path, readonly: Iterable[Path], writable: Iterable[Path],
                  env: dict[str, str], cwd: Path | None) -> list[str]:
    """The argv that runs ``command`` sandboxed; ``env`` is the REPL's whole environment."""
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
            "--uid", NOBODY, "--gid", NOBODY, "--cap-drop", "ALL",
            "--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    for link in ("bin", "lib", "lib64", "sbin"):
        target = Path("/") / link
        if target.is_symlink():
            argv += ["--symlink", os.readlink(target), str(target)]
        elif target.is_dir():
            argv += ["--ro-bind", str(target), str(target)]
    for path in ETC_FILES:
        argv += ["--ro-bind-try", path, path]
    for path in dict.fromkeys(str(p.resolve()) for p in readonly):
        argv += ["--ro-bind", path, path]
    for path in dict.fromkeys(str(p.resolve()) for p in [*writable, scratch]):
        argv += ["--bind", path, path]
    merged = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(scratch.resolve()), **env}
    for name, value in sorted(merged.items()):
        argv += ["--setenv", name, value]
    # The executable by its real path: a link to it (a virtualenv's python, a shim) may point outside the binds.
    found = shutil.which(command[0])
    executable = str(Path(found).resolve()) if found else command[0]
    argv += ["--chdir", str((cwd or scratch).resolve()), "--", executable, *command[1:]]
    return argv


def repl_environment(worker_env: dict[str, str], passed: Iterable[str]) -> dict[str, str]:
    return {name: worker_env[name] for name in (*REPL_ENV, *passed) if name in worker_env}


def check_available() -> None:
    """Fail closed at worker start: no bubblewrap, or no user namespaces, means no sandbox and no Lean."""
    if shutil.which("bwrap") is None:
        raise ConfigError("bubblewrap (bwrap) is not installed: the Lean REPL runs only sandboxed "
                          "(apt-get install bubblewrap)")
    probe = subprocess.run(["bwrap", "--unshare-all", "--uid", NOBODY, "--gid", NOBODY, "--ro-bind", "/usr", "/usr",
                            "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib", "--symlink",
                            "usr/lib64", "/lib64", "--", "/usr/bin/true"], capture_output=True, text=True,
                           timeout=30, check=False)
    if probe.returncode != 0:
        raise ConfigError(f"bubblewrap cannot create its namespaces here ({probe.stderr.strip()[:300]}); the node "
                          "must allow unprivileged user namespaces")
