"""Each REPL process in a bubblewrap sandbox: ``#eval`` can run IO, so Lean input is untrusted code.

Inside: new user, pid, net, ipc, uts and cgroup namespaces (no route anywhere: the only interface is its own
loopback; uid/gid 65534 without capabilities; the worker's processes are invisible), an environment holding only
what the REPL needs (never the worker's secrets), the system's ``/usr`` plus the toolchain, the REPL and the Lake
project read-only, a private writable scratch directory (the process's work dir: pickles live there) and a private
``/tmp``. It dies with the worker (``--die-with-parent``; the pool also kills its process group).

The REPL's stdin and stdout carry the protocol, and the code being checked runs in the REPL process (``#eval``).
Two rules keep that code from reaching them by any means Lean's IO offers (``repl.py`` fences what is left):
a seccomp program (``spawn_filter``) refuses every way of creating a process (``fork``, ``vfork``, ``clone``
without ``CLONE_THREAD``; ``clone3`` answers ENOSYS, so threads fall back to ``clone``), so ``#eval`` cannot
start a program that inherits the pipes; and there is no ``/proc`` inside, so ``/proc/self/fd/1`` and
``/dev/stdout`` (a link into it) do not exist to reopen them by. The REPL is then started as its binary, never
through ``lake env`` (which would need to start it), with ``LEAN_SYSROOT`` set (``Lean.findSysroot`` otherwise runs
``lean --print-prefix``).

On Kubernetes the worker's pod needs unprivileged user namespaces (the default on current kernels; a seccomp profile
that allows ``clone``/``unshare`` with ``CLONE_NEWUSER``, e.g. RuntimeDefault on containerd ≥ 1.7, and no
AppArmor profile that denies them); it needs no privileged mode and no added capabilities.
"""

from __future__ import annotations

import os
import platform
import shutil
import struct
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


# seccomp: struct seccomp_data is {int nr; u32 arch; u64 ip; u64 args[6]} (linux/seccomp.h); cBPF opcodes from
# linux/filter.h; syscall numbers from the kernel's tables for each architecture.
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_EPERM, _ENOSYS = 1, 38
_CLONE_THREAD = 0x00010000
_X32_BIT = 0x40000000
# machine -> (AUDIT_ARCH_*, clone, clone3, syscalls that always create a process)
_ARCHES = {"x86_64": (0xC000003E, 56, 435, (57, 58)),  # fork, vfork
           "aarch64": (0xC00000B7, 220, 435, ())}


def _stmt(code: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, 0, 0, k)


def _jump(code: int, k: int, if_true: int, if_false: int) -> bytes:
    return struct.pack("=HBBI", code, if_true, if_false, k)


def spawn_filter(machine: str | None = None) -> bytes:
    """A seccomp program (for bwrap's ``--seccomp``) that refuses to create processes and allows all else."""
    try:
        arch, clone, clone3, forks = _ARCHES[machine or platform.machine()]
    except KeyError:
        raise ConfigError(f"no seccomp program for {machine or platform.machine()}: set KILN_LEAN_SANDBOX_SPAWN=true "
                          "to run the REPL without it (code being checked can then start processes)") from None
    deny = _stmt(_RET, _ERRNO | _EPERM)
    program = [_stmt(_LD_W_ABS, 4), _jump(_JEQ, arch, 1, 0), _stmt(_RET, _ERRNO | _ENOSYS),  # another ABI: refused
               _stmt(_LD_W_ABS, 0)]
    if arch == _ARCHES["x86_64"][0]:
        program += [_jump(_JGE, _X32_BIT, 0, 1), deny]  # the x32 ABI's numbers
    for nr in forks:
        program += [_jump(_JEQ, nr, 0, 1), deny]
    program += [_jump(_JEQ, clone3, 0, 1), _stmt(_RET, _ERRNO | _ENOSYS),  # libc falls back to clone (threads)
                _jump(_JEQ, clone, 0, 4), _stmt(_LD_W_ABS, 16),  # clone's flags: the low word of args[0]
                _jump(_JSET, _CLONE_THREAD, 0, 1), _stmt(_RET, _ALLOW), deny,
                _stmt(_RET, _ALLOW)]
    return b"".join(program)


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
                  env: dict[str, str], cwd: Path | None, seccomp_fd: int | None = None,
                  proc: bool = False) -> list[str]:
    """The argv that runs ``command`` sandboxed; ``env`` is the REPL's whole environment; ``seccomp_fd`` an open
    file descriptor (passed to bwrap) holding ``spawn_filter()``; ``proc`` mounts ``/proc`` inside."""
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
            "--uid", NOBODY, "--gid", NOBODY, "--cap-drop", "ALL",
            "--ro-bind", "/usr", "/usr", *(["--proc", "/proc"] if proc else []), "--dev", "/dev", "--tmpfs", "/tmp"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
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


def filter_pipe(program: bytes) -> int:
    """A pipe's read end holding ``program`` (bwrap reads it to the end; one per sandbox started)."""
    read, write = os.pipe()
    try:
        os.write(write, program)  # a few hundred bytes: within any pipe's buffer
    finally:
        os.close(write)
    return read


def check_available(no_spawn: bool = True) -> None:
    """Fail closed at worker start: no bubblewrap, no user namespaces or (with ``no_spawn``) no seccomp means no
    sandbox and no Lean."""
    if shutil.which("bwrap") is None:
        raise ConfigError("bubblewrap (bwrap) is not installed: the Lean REPL runs only sandboxed "
                          "(apt-get install bubblewrap)")
    argv = ["bwrap", "--unshare-all", "--uid", NOBODY, "--gid", NOBODY, "--ro-bind", "/usr", "/usr",
            "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64"]
    fd = filter_pipe(spawn_filter()) if no_spawn else None
    try:
        probe = subprocess.run([*argv, *(["--seccomp", str(fd)] if fd is not None else []), "--", "/usr/bin/true"],
                               capture_output=True, text=True, timeout=30, check=False,
                               pass_fds=(fd,) if fd is not None else ())
    finally:
        if fd is not None:
            os.close(fd)
    if probe.returncode != 0:
        raise ConfigError(f"bubblewrap cannot create its namespaces{' or load its seccomp program' if no_spawn else ''}"
                          f" here ({probe.stderr.strip()[:300]}); the node must allow unprivileged user namespaces")
