"""Run many `python -m <module> <args>` commands as forked processes of one interpreter that
imported their common modules once (`python tests/cli_batch.py < cases.json`).

Each command still runs in its own process, with its own working directory, stdout, stderr
and exit code, and its module executed as `__main__` as `python -m` does (runpy, the working
directory first on sys.path, argv[0] the module's file). What is saved is the interpreter
start and the ~0.4 s of imports (Hydra, OmegaConf, the project) that every command would
repeat: the bad-input test runs 46 such commands.

stdin: {"preload": [entry module, ...], "parallel": n, "warm": {"config_dir": dir,
"overrides": [[override, ...], ...]}, "cases": [{"argv": [module, *args], "cwd": dir}, ...]}.
stdout: one JSON list of {"returncode", "stdout", "stderr"}, in order. No threads: the
driver forks from a single-threaded process.

`warm` (optional): compose those configs once in the driver, with tests/conftest.py's
memo of parsed YAML files installed, so the commands inherit the parsed files (a third of
a composition's CPU) and Hydra's plugin scan instead of repeating them. Each command still
composes its own config with Hydra, from the same files.

`run_cases` (imported by the tests: tests/test_bad_input.py, tests/test_campaign.py) starts
this file as a script with such a request and returns each command's outcome.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import runpy
import subprocess
import sys
import tempfile
import traceback


def _exit_code(exc: SystemExit) -> int:
    """The exit status the interpreter gives `raise SystemExit(code)` (printing a message)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _child(argv: list[str], cwd: str, out: str, err: str) -> int:
    """In the forked child: the command as `python -m`; its exit status."""
    module, *args = argv
    os.chdir(cwd)
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        new = os.open(path, flags, 0o600)
        os.dup2(new, fd)
        os.close(new)
    sys.argv = [importlib.util.find_spec(module).origin, *args]
    sys.path[0] = os.getcwd()  # `python -m` puts the working directory first
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as exc:
        return _exit_code(exc)
    except BaseException:  # noqa: BLE001 - as the interpreter: traceback, status 1
        traceback.print_exc()
        return 1


def _warm(config_dir: str, overrides: list[list[str]]) -> None:
    """Compose each override list once (the YAML memo keeps the files it parsed)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import conftest  # noqa: F401 - installs the memo of parsed YAML files (OmegaConf.load)
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(version_base="1.3", config_dir=config_dir):
        for each in overrides:
            compose(config_name="config", overrides=each, return_hydra_config=True)


def main() -> int:
    request = json.load(sys.stdin)
    sys.path[0] = os.getcwd()  # imports resolve as they will for the commands
    for name in request.get("preload", []):  # their imports stay; the entry modules
        importlib.import_module(name)           # themselves run afresh as __main__
    for name in request.get("preload", []):
        sys.modules.pop(name, None)
        parent, _, child = name.rpartition(".")
        if parent in sys.modules and hasattr(sys.modules[parent], child):
            delattr(sys.modules[parent], child)
    if request.get("warm"):
        _warm(request["warm"]["config_dir"], request["warm"]["overrides"])
    cases, parallel = request["cases"], max(1, int(request.get("parallel", 1)))
    work = tempfile.mkdtemp(prefix="cli_batch-")
    files = [(os.path.join(work, f"{i}.out"), os.path.join(work, f"{i}.err"))
             for i in range(len(cases))]
    codes: dict[int, int] = {}
    running: dict[int, int] = {}  # pid -> case index
    pending = list(range(len(cases)))
    while pending or running:
        while pending and len(running) < parallel:
            i = pending.pop(0)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the child never returns into this loop
                code = _child(cases[i]["argv"], cases[i]["cwd"], *files[i])
                sys.stdout.flush()
                sys.stderr.flush()
                raise SystemExit(code)  # ordinary interpreter exit: atexit handlers run
            running[pid] = i
        pid, status = os.waitpid(-1, 0)
        codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
    results = []
    for i, (out, err) in enumerate(files):
        with open(out) as f_out, open(err) as f_err:
            results.append({"returncode": codes[i], "stdout": f_out.read(),
                            "stderr": f_err.read()})
        os.remove(out)
        os.remove(err)
    os.rmdir(work)
    json.dump(results, sys.stdout)
    return 0


# Cases run this many processes at a time: one per core, at most four (all of them at once
# made the machine's load, and every process's start-up, as long as the slowest).
PARALLEL = max(1, min(4, os.cpu_count() or 1))


def run_cases(commands: list[list[str]], cwd: str, preload: tuple[str, ...] = (),
              warm: dict | None = None) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each `<this interpreter> -m <module> ARGS` command,
    run from `cwd` by one batch process (this file), PARALLEL at a time."""
    assert all(c[:2] == [sys.executable, "-m"] for c in commands)
    request = {"preload": list(preload), "parallel": PARALLEL, "warm": warm,
               "cases": [{"argv": c[2:], "cwd": cwd} for c in commands]}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], cwd=cwd,
                          input=json.dumps(request), capture_output=True, text=True,
                          timeout=900)  # a bound for a hang only
    assert proc.returncode == 0, proc.stderr
    return [(r["returncode"], r["stdout"], r["stderr"]) for r in json.loads(proc.stdout)]


if __name__ == "__main__":
    sys.exit(main())
