"""Guards over the agent's source: every file it reads goes through host/bounded.py (regular files only,
a size cap, a time cap, decoding chosen per format), and every command it runs through host/proc.py
(output bounded, the process group killed, the program checked). A new open(), read_text(),
read_bytes(), os.open() for reading, subprocess call or os.system anywhere else fails here, naming
the line; the few that stay are listed below with the reason. An entry that no longer matches a
line fails too, so the list stays true."""
from __future__ import annotations

import ast
from collections.abc import Iterator

from package_source import modules, nodes


# (module, the call's line as written, stripped): why it may read the file itself.
READS_ALLOWED = {
    ("host/bounded.py", "fd = os.open(path, flags)"): "the bounded reader itself",
    ("daemon/app.py", 'handle = open(path, "a+")'):
        "the agent's own lock file, opened to be locked and written; its holder is read 32 bytes at most",
    ("sim/machine.py", 'source = json.loads(root(f"{STATE_DIR}/machine.json").read_text()).get("source")'):
        "the simulator's own state, written atomically by it under its lock",
    ("sim/machine.py", "self._cache = json.loads(self.path.read_text())"): "the simulator's own state",
    ("sim/machine.py", "state = json.loads(self.path.read_text())"): "the simulator's own state",
    ("sim/machine.py", 'with open(self.writes_path, "rb") as counter:'): "the simulator's own write counter",
    ("sim/kernel.py", 'with open(name, encoding="utf-8", errors="surrogateescape") as current:'):
        "a file of the simulated kernel's tree, which the simulator renders itself",
}
# Calls named open() that open no file: a gRPC stream, the device plugin's gate.
NOT_FILES = {"self.gate.open()", "async with list_method(channel).open(timeout=timeout) as stream:",
             "async with api.register_method(channel).open(timeout=REGISTER_TIMEOUT_S) as stream:"}
RUNS_ALLOWED = {
    ("host/proc.py", "child = subprocess.Popen(argv, stdin=subprocess.PIPE if given else subprocess.DEVNULL,"):
        "the bounded runner itself",
    ("mps/launch.py", "os.execv(binary, [binary, *rest])"):
        "the MPS launcher becomes the control daemon (without systemd): nothing is read from it",
}
_WRITES = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_DIRECTORY", "O_PATH"}  # os.open flags of a write or a directory
_RUNS = {("subprocess", name) for name in ("run", "Popen", "call", "check_call", "check_output", "getoutput",
                                           "getstatusoutput")} | {("os", name) for name in (
    "system", "popen", "execv", "execve", "execvp", "execvpe", "execl", "execlp", "execle", "spawnv", "spawnvp",
    "posix_spawn", "posix_spawnp", "fork", "forkpty")} | {("asyncio", "create_subprocess_exec"),
                                                         ("asyncio", "create_subprocess_shell")}


def calls(tree: ast.AST) -> Iterator[ast.Call]:
    return (node for node in nodes(tree) if isinstance(node, ast.Call))


def _names(node: ast.AST) -> set[str]:
    return {n.attr if isinstance(n, ast.Attribute) else n.id
            for n in ast.walk(node) if isinstance(n, (ast.Attribute, ast.Name))}


def _mode(call: ast.Call) -> object:
    given = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
    return given.value if isinstance(given, ast.Constant) else None


def reads_a_file(call: ast.Call) -> bool:
    func = call.func
    if isinstance(func, ast.Name) and func.id == "open":  # a write-only mode ("w", "ab") is atomic_write's business
        mode = _mode(call)
        return not (isinstance(mode, str) and not set(mode) & set("r+"))
    if not isinstance(func, ast.Attribute):
        return False
    if func.attr in ("read_text", "read_bytes", "fdopen"):
        return func.attr != "fdopen" or "r" in str(_mode(call)) or "+" in str(_mode(call))
    if func.attr == "open":
        if isinstance(func.value, ast.Name) and func.value.id == "os":
            return len(call.args) < 2 or not _names(call.args[1]) & _WRITES
        return True  # Path.open, io.open
    return False


def runs_a_program(call: ast.Call) -> bool:
    func = call.func
    return (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
            and (func.value.id, func.attr) in _RUNS)


def found(predicate: object) -> set[tuple[str, str]]:
    places = set()
    for module in modules():
        for call in calls(module.tree):
            if predicate(call):  # type: ignore[operator]
                places.add((module.relative, module.lines[call.lineno - 1].strip().split("  #")[0]))
    return places


def test_every_file_the_agent_reads_goes_through_the_bounded_reader() -> None:
    places = {place for place in found(reads_a_file) if place[1] not in NOT_FILES}
    unlisted = sorted(places - READS_ALLOWED.keys())
    assert not unlisted, "read through gpu_agent.host.bounded (read_text, read_checked, read_head) instead:\n" + \
        "\n".join(f"  {module}: {line}" for module, line in unlisted)
    assert not READS_ALLOWED.keys() - places, f"listed but gone: {sorted(READS_ALLOWED.keys() - places)}"


def test_every_command_the_agent_runs_goes_through_the_bounded_runner() -> None:
    places = found(runs_a_program)
    unlisted = sorted(places - RUNS_ALLOWED.keys())
    assert not unlisted, "run through gpu_agent.host.proc (run, run_bytes) instead:\n" + \
        "\n".join(f"  {module}: {line}" for module, line in unlisted)
    assert not RUNS_ALLOWED.keys() - places, f"listed but gone: {sorted(RUNS_ALLOWED.keys() - places)}"


def test_the_guards_see_what_they_guard() -> None:
    """Each kind of call the guards look for is found in a sample, and what they let pass is let pass."""
    sample = ast.parse("\n".join([
        "open(p)", "open(p, 'rb')", "open(p, 'a+')", "Path(p).read_text()", "p.read_bytes()", "p.open()",
        "os.open(p, os.O_RDONLY)", "os.fdopen(fd, 'r')", "io.open(p)",
        "open(p, 'w')", "os.open(d, os.O_RDONLY | os.O_DIRECTORY)", "os.fdopen(fd, 'wb')",
        "subprocess.run(argv)", "subprocess.Popen(argv)", "os.system(cmd)", "asyncio.create_subprocess_exec(a)",
    ]))
    outermost = [statement.value for statement in sample.body if isinstance(statement, ast.Expr)]
    read = [reads_a_file(call) for call in outermost if isinstance(call, ast.Call)]
    run = [runs_a_program(call) for call in outermost if isinstance(call, ast.Call)]
    assert read == [True] * 9 + [False] * 7
    assert run == [False] * 12 + [True] * 4
