#!/usr/bin/env python3
"""A fake Lean REPL: the one sanctioned stand-in for Lean, which cannot be installed here.

It speaks the protocol of leanprover-community/repl exactly (one JSON request per blank-line-terminated block on
stdin; a pretty-printed JSON reply and a blank line on stdout) and implements a tiny deterministic proof calculus
over propositional goals, so tactic sequences succeed or fail meaningfully:

  theorem t1 : p → p ∧ True := by sorry          -- run as a command: one proof state per sorry
  tactics: intro h | constructor | left | right | exact h | assumption | trivial | rfl | sorry
           simp, omega, decide  -- only when the header imports Mathlib ("unknown tactic" otherwise)
           native_decide        -- closes what decide closes, trusting the compiler (axiom Lean.ofReduceBool)
           kernel_reject        -- closes any goal in tactic mode, as tactic mode once accepted proofs the kernel
                                   rejects (leanprover-community/repl#44); in a command the declaration fails with
                                   "(kernel) declaration has metavariables" (test/app_type_mismatch.expected.out)

A command may span lines (a ``by`` block's tactics on indented lines, one per line or ``;``-separated); an
environment keeps its declarations: ``axiom NAME : PROP`` declares one, a theorem (or lemma) whose proof goes through
is added with the axioms its proof used (``sorry`` → ``sorryAx``, ``simp``/``omega`` → ``propext``, ``native_decide``
→ ``Lean.ofReduceBool``, ``exact NAME`` → NAME's own), and ``#print axioms NAME`` answers as Lean does, an info
message at its line: ``'NAME' depends on axioms: [...]`` or ``'NAME' does not depend on any axioms``.
``set_option debug.skipKernelTC true in`` before a declaration lets ``kernel_reject`` through (the kernel skipped).

Headers matter: ``import ...`` lines at the top of a command cost FAKE_LEAN_IMPORT_S seconds each time they are
processed (as real imports do), and a pickled state can only be unpickled where the same imports are loaded.
Misbehaviour on demand, in a command (``-- fake: crash``) or as a tactic (``fake_crash``): ``sleep S``,
``crash``, ``crash_once MARKER`` (crash unless MARKER exists, then create it), ``hang``, ``garbage`` (malformed
output), ``grow MB`` (memory growth). Test-only, in a command: ``-- fake: io {JSON}`` attempts IO the way ``#eval``
can (read files, connect, write files, signal pids, run a program) and reports each outcome in an info message;
``-- fake: forge {JSON}`` attacks the REPL's own protocol channel the ways ``#eval`` IO can: it writes ``reply``
(a JSON object) as a REPL reply to the REPL's stdout, ``via`` ``"fd"`` (reopening ``/proc/self/fd/1`` in the
process, as ``IO.FS.Handle.mk`` can) or ``"child"`` (a process started with the REPL's stdin and stdout, as
``IO.Process.spawn`` with inherited streams can), and with ``"fence": true`` then reads the next request from the
REPL's stdin (``/proc/self/fd/0``, or the inherited stdin) and answers it too, as the REPL would answer a
``#check`` of an unknown name; the command waits for it, then goes on, and its info message reports the outcome.
``#check NAME`` answers "unknown identifier" (the fake has no global declarations). Every info report carries
``process``, a token drawn once per REPL process.
FAKE_LEAN_TACTIC_MS adds a fixed cost to every tactic; FAKE_LEAN_PICKLE_KB
pads pickles to a realistic size (they compress well, as real ones do).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

IMPORT_S = float(os.environ.get("FAKE_LEAN_IMPORT_S", "0"))
TACTIC_MS = float(os.environ.get("FAKE_LEAN_TACTIC_MS", "0"))
PICKLE_KB = int(os.environ.get("FAKE_LEAN_PICKLE_KB", "64"))
MATHLIB_TACTICS = {"simp", "omega", "decide"}
IMPLIES, OR, AND = "\u2192", "\u2228", "\u2227"

_hog: list[bytearray] = []
PROCESS = os.urandom(8).hex()


def message(severity: str, line: int, column: int, data: str) -> dict[str, object]:
    return {"severity": severity, "pos": {"line": line, "column": column}, "endPos": None, "data": data}


def forge(spec: dict[str, object], out_fd: int, in_fd: int | None) -> None:
    """Write ``spec["reply"]`` as a REPL reply to ``out_fd``; with ``spec["fence"]`` read the next request from
    ``in_fd`` and answer it as the REPL answers ``#check NAME`` of an unknown name."""
    os.write(out_fd, (json.dumps(spec["reply"], indent=2) + "\n\n").encode())
    if not spec.get("fence") or in_fd is None:
        return
    data = b""
    while not data.endswith(b"\n\n"):
        chunk = os.read(in_fd, 1)  # byte by byte: nothing past the request is taken from the pipe
        if not chunk:
            return
        data += chunk
    words = str(json.loads(data).get("cmd", "")).split()
    name = words[1] if len(words) > 1 else ""
    answer = {"messages": [message("error", 1, 7, f"unknown identifier '{name}'")], "env": 0}
    os.write(out_fd, (json.dumps(answer, indent=2) + "\n\n").encode())


# --- propositions ------------------------------------------------------------------------------------------------

def split_top(text: str, op: str) -> tuple[str, str] | None:
    """Split at the first top-level (unparenthesised) occurrence of ``op``; right-associative operators."""
    depth = 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif depth == 0 and text.startswith(op, i):
            return text[:i].strip(), text[i + len(op):].strip()
    return None


def strip_parens(text: str) -> str:
    text = text.strip()
    while text.startswith("(") and text.endswith(")"):
        depth = 0
        for i, ch in enumerate(text):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0 and i < len(text) - 1:
                return text
        text = text[1:-1].strip()
    return text


def shape(prop: str) -> tuple[str, str, str] | None:
    prop = strip_parens(prop)
    for op in (IMPLIES, OR, AND):
        parts = split_top(prop, op)
        if parts:
            return op, strip_parens(parts[0]), strip_parens(parts[1])
    return None


def equal_sides(prop: str) -> bool:
    parts = split_top(strip_parens(prop), "=")
    return parts is not None and parts[0] == parts[1]


# --- proof states ------------------------------------------------------------------------------------------------

@dataclass
class Goal:
    hyps: list[tuple[str, str]]
    target: str

    def render(self) -> str:
        return "".join(f"{n} : {t}\n" for n, t in self.hyps) + f"⊢ {self.target}"


@dataclass
class State:
    goals: list[Goal]
    imports: list[str] = field(default_factory=list)


class LeanError(Exception):
    pass


@dataclass
class Decl:
    prop: str
    axioms: set[str]


KERNEL_REJECTS = "<kernel rejects>"  # a marker in a proof's axioms: the kernel refuses the declaration
COMMAND = re.compile(r"(theorem|lemma|example|axiom|#\w+|set_option|open|variable|import|def|instance|attribute)\b")


def apply_tactic(state: State, tactic: str, decls: dict[str, Decl] | None = None,
                 used: set[str] | None = None) -> State:
    """One tactic on the first goal; ``decls`` are the environment's declarations (``exact NAME``), and the axioms
    the step relies on are added to ``used``."""
    used = set() if used is None else used
    if not state.goals:
        raise LeanError("no goals to be proved")
    goal, rest = state.goals[0], state.goals[1:]
    words = tactic.split()
    name, args = words[0], words[1:]
    target = strip_parens(goal.target)
    s = shape(target)
    if name in MATHLIB_TACTICS and not any(i.startswith("Mathlib") for i in state.imports):
        raise LeanError(f"unknown tactic '{name}'")
    if name == "intro" and s and s[0] == IMPLIES:
        hyp = args[0] if args else f"h{len(goal.hyps)}"
        return State([Goal([*goal.hyps, (hyp, s[1])], s[2]), *rest], state.imports)
    if name == "constructor" and s and s[0] == AND:
        return State([Goal(goal.hyps, s[1]), Goal(goal.hyps, s[2]), *rest], state.imports)
    if name in ("left", "right") and s and s[0] == OR:
        return State([Goal(goal.hyps, s[1] if name == "left" else s[2]), *rest], state.imports)
    if name == "exact" and args and args[0] not in dict(goal.hyps) and decls and args[0] in decls:
        decl = decls[args[0]]
        if strip_parens(decl.prop) != target:
            raise LeanError(f"type mismatch\n  {args[0]}\nhas type\n  {decl.prop}\nbut is expected to have type\n"
                            f"  {target}")
        used.update(decl.axioms)
        return State(rest, state.imports)
    if name == "kernel_reject":
        used.add(KERNEL_REJECTS)
        return State(rest, state.imports)
    if name == "native_decide" and re.fullmatch(r"[\d\s+*<=≤]+", target):
        used.add("Lean.ofReduceBool")
        return State(rest, state.imports)
    if name == "exact" and args:
        hyps = dict(goal.hyps)
        if args[0] not in hyps:
            raise LeanError(f"unknown identifier '{args[0]}'")
        if strip_parens(hyps[args[0]]) != target:
            raise LeanError(f"type mismatch\n  {args[0]}\nhas type\n  {hyps[args[0]]}\nbut is expected to have type\n"
                            f"  {target}")
        return State(rest, state.imports)
    if name == "assumption" and target in {strip_parens(t) for _, t in goal.hyps}:
        return State(rest, state.imports)
    if name == "trivial" and target == "True":
        return State(rest, state.imports)
    if name == "rfl" and equal_sides(target):
        return State(rest, state.imports)
    if name == "sorry":
        used.add("sorryAx")
        return State(rest, state.imports)
    if name == "simp" and (target == "True" or equal_sides(target) or
                           (s and s[0] == AND and all(p == "True" or equal_sides(p) for p in s[1:]))):
        used.add("propext")
        return State(rest, state.imports)
    if name in ("omega", "decide") and re.fullmatch(r"[\d\s+*<=≤]+", target):
        used.update({"propext"} if name == "omega" else set())
        return State(rest, state.imports)
    if name in {"intro", "constructor", "left", "right", "exact", "assumption", "trivial", "rfl", *MATHLIB_TACTICS}:
        raise LeanError(f"tactic '{name}' failed\n{goal.render()}")
    raise LeanError(f"unknown tactic '{name}'")


# --- the REPL --------------------------------------------------------------------------------------------------

class Repl:
    def __init__(self) -> None:
        self.envs: dict[int, list[str]] = {}
        self.decls: dict[int, dict[str, Decl]] = {}
        self.states: dict[int, State] = {}

    def misbehave(self, directive: str) -> None:
        word, _, arg = directive.strip().partition(" ")
        if word == "sleep":
            time.sleep(float(arg or 1))
        elif word == "crash":
            os._exit(3)
        elif word == "crash_once":  # crash unless the marker file exists; create it (a retry then succeeds)
            if not os.path.exists(arg):
                open(arg, "w").close()
                os._exit(3)
        elif word == "hang":
            while True:
                time.sleep(3600)
        elif word == "garbage":
            sys.stdout.write("this is not json {{{\n\n")
            sys.stdout.flush()
        elif word == "grow":
            block = bytearray(int(float(arg or 100) * (1 << 20)))
            for i in range(0, len(block), 4096):
                block[i] = 1
            _hog.append(block)

    @staticmethod
    def attempt_io(spec: dict[str, list[str | int]]) -> dict[str, object]:
        """What an ``#eval`` with IO could do from here: every attempt's outcome ("ok" or the error)."""
        def outcome(action: object) -> str:
            try:
                action()  # type: ignore[operator]
                return "ok"
            except Exception as e:
                return f"{type(e).__name__}: {e}"

        def connect(address: str) -> None:
            host, port = str(address).rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=3):
                pass

        def write(path: str) -> None:
            with open(path, "w") as f:
                f.write("written by Lean input")

        def read(path: str) -> None:
            with open(path, "rb") as f:
                f.read(1)

        try:
            ran = subprocess.run(["id", "-u"], capture_output=True, text=True, check=False).stdout.strip()
        except OSError as e:
            ran = f"{type(e).__name__}: {e}"
        return {"process": PROCESS, "uid": os.getuid(), "run": ran, "env": sorted(os.environ),
                "read": {str(p): outcome(lambda p=p: read(str(p))) for p in spec.get("read", [])},
                "connect": {str(a): outcome(lambda a=a: connect(str(a))) for a in spec.get("connect", [])},
                "write": {str(p): outcome(lambda p=p: write(str(p))) for p in spec.get("write", [])},
                "signal": {str(p): outcome(lambda p=p: os.kill(int(p), 0)) for p in spec.get("signal", [])}}

    @staticmethod
    def attempt_forge(spec: dict[str, object]) -> dict[str, object]:
        """The ``forge`` attack; its outcome ("ok" or the error that stopped it)."""
        try:
            if spec.get("via") == "child":
                child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--forge", json.dumps(spec)])
                child.wait()
            else:
                out = os.open("/proc/self/fd/1", os.O_WRONLY | os.O_APPEND)
                inp = os.open("/proc/self/fd/0", os.O_RDONLY) if spec.get("fence") else None
                forge(spec, out, inp)
            outcome = "ok"
        except OSError as e:
            outcome = f"{type(e).__name__}: {e}"
        return {"process": PROCESS, "forge": outcome}

    def new_state(self, state: State) -> int:
        sid = len(self.states)
        self.states[sid] = state
        return sid

    def command(self, req: dict[str, object]) -> dict[str, object]:
        code = str(req["cmd"])
        io_reports: list[dict[str, object]] = []
        for directive in re.findall(r"--\s*fake:\s*(.+)", code):
            if directive.startswith("io "):
                io_reports.append(self.attempt_io(json.loads(directive[3:])))
            elif directive.startswith("forge "):
                io_reports.append(self.attempt_forge(json.loads(directive[6:])))
            else:
                self.misbehave(directive)
        lines = code.split("\n")
        imports = [ln.strip()[len("import "):].strip() for ln in lines if ln.strip().startswith("import ")]
        messages: list[dict[str, object]] = [self._msg("info", 1, 0, json.dumps(r)) for r in io_reports]
        if "env" in req:
            if int(str(req["env"])) not in self.envs:
                return {"message": f"unknown environment {req['env']}"}
            if imports:
                messages.append(self._msg("error", 1, 0, "invalid 'import' command, it must be used in the "
                                                          "beginning of the file"))
            imports = self.envs[int(str(req["env"]))]
        else:
            time.sleep(IMPORT_S * len(imports))
        decls = dict(self.decls.get(int(str(req["env"])), {})) if "env" in req else {}
        sorries: list[dict[str, object]] = []
        skip_kernel_from_here = False
        for number, block in self.blocks(lines, messages):
            standalone = re.match(r"\s*set_option\s+(\S+)\s+(\S+)\s*$", block)
            if standalone:
                skip_kernel_from_here |= standalone.group(1) == "debug.skipKernelTC" and standalone.group(2) == "true"
                continue
            skip_kernel = skip_kernel_from_here
            while (option := re.match(r"\s*set_option\s+(\S+)\s+(\S+)\s+in\s+", block, re.S)) is not None:
                skip_kernel |= option.group(1) == "debug.skipKernelTC" and option.group(2) == "true"
                block = block[option.end():]
            check = re.match(r"\s*#check\s+(\S+)\s*$", block)
            if check:
                name = check.group(1)
                if name in decls:
                    messages.append(self._msg("info", number, 0, f"{name} : {decls[name].prop}"))
                else:
                    messages.append(self._msg("error", number, 7, f"unknown identifier '{name}'"))
                continue
            printed = re.match(r"\s*#print\s+axioms\s+(\S+)\s*$", block)
            if printed:
                name = printed.group(1)
                if name not in decls:
                    messages.append(self._msg("error", number, 15, f"unknown constant '{name}'"))
                elif decls[name].axioms:
                    messages.append(self._msg("info", number, 0, f"'{name}' depends on axioms: "
                                                                f"[{', '.join(sorted(decls[name].axioms))}]"))
                else:
                    messages.append(self._msg("info", number, 0, f"'{name}' does not depend on any axioms"))
                continue
            axiom = re.match(r"\s*axiom\s+(\S+)\s*:\s*(.+?)\s*$", block, re.S)
            if axiom:
                decls[axiom.group(1)] = Decl(axiom.group(2), {axiom.group(1)})
                continue
            m = re.match(r"\s*(theorem|lemma|example)\s*([^\s:]*)\s*:\s*(.+?)\s*:=\s*(by\s+)?(.*)$", block, re.S)
            if not m:
                if not block.strip().startswith(("import ", "--", "open ", "variable ")):
                    messages.append(self._msg("error", number, 0, f"unexpected token; expected command: {block!r}"))
                continue
            name, prop, body = m.group(2), m.group(3), m.group(5).strip()
            if body == "sorry":
                column = lines[number - 1].rindex("sorry") if "sorry" in lines[number - 1] else 0
                sid = self.new_state(State([Goal([], prop)], imports))
                sorries.append({"pos": {"line": number, "column": column},
                                "endPos": {"line": number, "column": column + 5},
                                "goal": f"⊢ {prop}", "proofState": sid})
                messages.append(self._msg("warning", number, 0, "declaration uses 'sorry'"))
                if name:
                    decls[name] = Decl(prop, {"sorryAx"})
                continue
            state, used = State([Goal([], prop)], imports), set()
            try:
                for tactic in re.split(r"[;\n]", body):
                    if tactic.strip():
                        state = apply_tactic(state, tactic.strip(), decls, used)
                if state.goals:
                    messages.append(self._msg("error", number, 0, "unsolved goals\n" +
                                              "\n\n".join(g.render() for g in state.goals)))
                    continue
            except LeanError as e:
                messages.append(self._msg("error", number, 0, str(e)))
                continue
            if KERNEL_REJECTS in used and not skip_kernel:
                messages.append(self._msg("error", number, 0, "(kernel) declaration has metavariables "
                                                              f"'{name or '_example'}'"))
                continue
            used.discard(KERNEL_REJECTS)
            if "sorryAx" in used:
                messages.append(self._msg("warning", number, 0, "declaration uses 'sorry'"))
            if name:
                decls[name] = Decl(prop, used)
        env = len(self.envs)
        self.envs[env] = imports
        self.decls[env] = decls
        reply: dict[str, object] = {"env": env}
        if messages:
            reply["messages"] = messages
        if sorries:
            reply["sorries"] = sorries
        return reply

    def blocks(self, lines: list[str], messages: list[dict[str, object]]) -> list[tuple[int, str]]:
        """The commands of ``lines``, each with its first line's number: a command starts at a line that begins
        with a command keyword; indented lines after it continue it (a ``by`` block's tactics); an unindented line
        that starts no command is an error of its own."""
        found: list[tuple[int, str]] = []
        for number, line in enumerate(lines, start=1):
            if not line.strip() or line.strip().startswith("--"):
                continue
            if found and re.search(r"\sin$", found[-1][1].rstrip()):  # `set_option … in` before its command
                found[-1] = (found[-1][0], f"{found[-1][1]}\n{line}")
            elif COMMAND.match(line.strip()):
                found.append((number, line))
            elif found and line[:1].isspace():
                found[-1] = (found[-1][0], f"{found[-1][1]}\n{line}")
            else:
                messages.append(self._msg("error", number, 0, f"unexpected token; expected command: {line!r}"))
        return found

    @staticmethod
    def _msg(severity: str, line: int, column: int, data: str) -> dict[str, object]:
        return message(severity, line, column, data)

    def tactic(self, req: dict[str, object]) -> dict[str, object]:
        text = str(req["tactic"])
        for part in re.split(r"[;\n]", text):
            if part.strip().startswith("fake_"):
                self.misbehave(part.strip()[len("fake_"):])
        time.sleep(TACTIC_MS / 1000)
        sid = int(str(req["proofState"]))
        if sid not in self.states:
            return {"message": "Unknown proof state."}
        state = self.states[sid]
        try:
            for tactic in re.split(r"[;\n]", text):
                if tactic.strip() and not tactic.strip().startswith("fake_"):
                    state = apply_tactic(state, tactic.strip())
        except LeanError as e:
            return {"message": f"Lean error:\n<input>:1:0: {e}"}
        new = self.new_state(state)
        return {"proofState": new, "goals": [g.render() for g in state.goals],
                "proofStatus": "Completed" if not state.goals else "Incomplete: open goals remain"}

    def pickle(self, req: dict[str, object]) -> dict[str, object]:
        path = str(req["pickleTo"])
        if "proofState" in req:
            sid = int(str(req["proofState"]))
            if sid not in self.states:
                return {"message": "Unknown proof state."}
            st = self.states[sid]
            doc = {"kind": "proofState", "imports": st.imports,
                   "goals": [{"hyps": g.hyps, "target": g.target} for g in st.goals]}
        else:
            env = int(str(req.get("env", -1)))
            if env not in self.envs:
                return {"message": f"unknown environment {env}"}
            doc = {"kind": "env", "imports": self.envs[env]}
        body = json.dumps(doc).encode()
        # Real pickles hold compacted olean data: large and very compressible.
        padding = (b"olean-region:" + body[:64]) * (PICKLE_KB * 1024 // (13 + min(64, len(body))) + 1)
        with open(path, "wb") as f:
            f.write(len(body).to_bytes(4, "big") + body + padding[:PICKLE_KB * 1024])
        return {"proofState": req["proofState"]} if "proofState" in req else {"env": req["env"]}

    def unpickle(self, req: dict[str, object]) -> dict[str, object]:
        path = str(req.get("unpickleProofStateFrom") or req.get("unpickleEnvFrom"))
        try:
            with open(path, "rb") as f:
                raw = f.read()
            doc = json.loads(raw[4:4 + int.from_bytes(raw[:4], "big")])
        except (OSError, ValueError) as e:
            return {"message": f"Lean error:\ncould not unpickle {path}: {e}"}
        loaded = self.envs.get(int(str(req["env"])), []) if "env" in req else []
        if doc["imports"] != loaded:
            return {"message": f"Lean error:\nimports {doc['imports']} of the pickle are not loaded ({loaded})"}
        if doc["kind"] == "env":
            env = len(self.envs)
            self.envs[env] = doc["imports"]
            return {"env": env}
        state = State([Goal([tuple(h) for h in g["hyps"]], g["target"]) for g in doc["goals"]], doc["imports"])
        sid = self.new_state(state)
        return {"proofState": sid, "goals": [g.render() for g in state.goals]}

    def handle(self, req: dict[str, object]) -> dict[str, object]:
        if "cmd" in req:
            return self.command(req)
        if "tactic" in req:
            return self.tactic(req)
        if "pickleTo" in req:
            return self.pickle(req)
        if "unpickleProofStateFrom" in req or "unpickleEnvFrom" in req:
            return self.unpickle(req)
        return {"message": "Could not parse as a valid JSON command"}


def main() -> None:
    repl = Repl()
    block: list[str] = []
    for line in sys.stdin:
        if line.strip():
            block.append(line)
            continue
        if not block:
            continue
        text, block = "".join(block), []
        try:
            request = json.loads(text)
        except ValueError as e:
            reply: dict[str, object] = {"message": f"Could not parse JSON:\n{e}"}
        else:
            reply = repl.handle(request)
        sys.stdout.write(json.dumps(reply, indent=2, ensure_ascii=False) + "\n\n")
        sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--forge"]:  # the child of a ``forge`` attack: the REPL's stdin and stdout are its own
        forge(json.loads(sys.argv[2]), 1, 0)
    else:
        main()
