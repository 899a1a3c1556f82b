"""Process launcher: every job in its own process, `n_jobs` at a time (0: one per CPU core).

Two ways to start a job process (`start`):
- fork (default on Linux): the campaign process, which has already imported
  everything and composed every job's config, forks one child per job; the child
  runs the task on its config and exits. No interpreter start-up, imports or
  Hydra composition per run (about 70 % of a run's wall time otherwise). Modules every
  run imports only when it gets there (`preload`: pandas, through pyarrow's array
  conversion, about 0.7 CPU s per run) are imported once, before the first fork, and
  `before_fork` functions run on each job's config in the campaign process before its fork
  (reading the ledger's earlier runs once there, not again in every child).
- exec: a fresh `python -m <entry module> <overrides>` process per job.

Either way one process per job, not a pool: a job that kills its interpreter
(segfault, out-of-memory kill) fails only itself, where a ProcessPoolExecutor
marks every pending future broken; nothing is pickled; and each job's log starts
with the command a user could rerun by hand. Children get PR_SET_PDEATHSIG on
Linux, so a SIGKILLed campaign leaves no orphan still writing ledgers.

Each job's output goes to `<sweep dir>/<job number>/stdout.log` and
`stderr.log`; its last stdout line (the runner's JSON) is the job's return value.
A forked job reports bad input as the command would: one `error:` line, exit 2.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

_PR_SET_PDEATHSIG = 1
# Hydra overrides of the sweep itself; a job process runs in RUN mode in its own directory.
_NOT_FORWARDED = ("hydra.sweep", "hydra/sweeper", "hydra/launcher", "hydra.launcher",
                  "hydra.mode", "hydra.run", "hydra.job.num", "hydra.job.id")


class JobProcessFailed(RuntimeError):
    """A job process exited non-zero, was killed, or printed no JSON last line."""


def _die_with_parent_hook():
    """A preexec function asking the kernel to SIGKILL the child when its parent dies."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)

    return hook


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _quoted(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


STARTS = ("fork", "exec")


class ForkedJob:
    """A forked job process, with the part of Popen's interface the launch loop uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_forked_task(task_function: TaskFunction, cfg: DictConfig) -> int:
    """Inside a forked job: run the task, return the exit code the command would give."""
    from omegaconf.errors import OmegaConfBaseException

    from experiments.config.bad_input import EXIT_BAD_INPUT, bad_input_message

    try:
        task_function(cfg)
        return 0
    except SystemExit as ex:
        return ex.code if isinstance(ex.code, int) else 1
    except (ValueError, OmegaConfBaseException) as ex:
        print(f"error: {bad_input_message(ex) or ex}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BaseException:
        traceback.print_exc()
        return 1


def _named_function(name: str):
    """The function a "module:function" name names (hydra.launcher.before_fork)."""
    module, _, function = name.partition(":")
    found = getattr(importlib.import_module(module), function, None) if function else None
    if not callable(found):
        raise ValueError(f"hydra.launcher.before_fork: {name!r}: allowed 'module:function' "
                         "names of importable functions")
    return found


class ProcessLauncher(Launcher):
    def __init__(self, n_jobs: int = 0, timeout_s: float | None = None,
                 poll_s: float = 0.05, start: str = "fork",
                 preload: Sequence[str] = (), before_fork: Sequence[str] = ()) -> None:
        if isinstance(n_jobs, bool) or not isinstance(n_jobs, int) or n_jobs < 0:
            raise ValueError(f"hydra.launcher.n_jobs={n_jobs!r}: allowed integers >= 0 "
                             "(0: one job per CPU core)")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"hydra.launcher.timeout_s={timeout_s!r}: allowed numbers > 0 or null")
        if start not in STARTS:
            raise ValueError(f"hydra.launcher.start={start!r}: allowed {', '.join(STARTS)}")
        self.n_jobs = n_jobs or os.cpu_count() or 1
        self.start = start
        self.preload = tuple(str(m) for m in preload)
        self.before_fork = tuple(str(f) for f in before_fork)  # "module:function" names
        self._before_fork_calls: list = []
        self.hydra_context: HydraContext | None = None
        self.composer: Any = None  # a CellComposer; the campaign shares its planner's
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.progress: Any = None  # a tqdm bar set by the campaign sweeper
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.config = config
        self.task_function = task_function
        self.hydra_context = hydra_context

    @property
    def forks(self) -> bool:
        """Whether jobs are forked (needs os.fork and Hydra's config loader to compose)."""
        return self.start == "fork" and hasattr(os, "fork") and self.hydra_context is not None

    def compose(self, overrides: Sequence[str]) -> DictConfig:
        """A job's config, composed as Hydra would (experiments.campaigns.composer)."""
        if self.composer is None:
            from experiments.campaigns.composer import CellComposer

            self.composer = CellComposer(self.hydra_context.config_loader, self.config)
        return self.composer.compose(list(overrides))

    # ------------------------------------------------------------ the job command

    def _entry(self) -> list[str]:
        module = self.task_function.__module__
        if module == "__main__":
            spec = getattr(sys.modules["__main__"], "__spec__", None)
            if spec is None or not spec.name:
                return [sys.executable, os.path.abspath(sys.argv[0])]
            module = spec.name.removesuffix(".__main__")
        return [sys.executable, "-m", module]

    def _config_args(self) -> list[str]:
        hydra = self.config.hydra
        args = ["--config-name", str(hydra.job.config_name)]
        for src in hydra.runtime.config_sources:
            if src.schema == "file" and src.provider == "main":
                args += ["--config-path", str(src.path)]
            elif src.schema == "file" and src.provider == "command-line":
                args += ["--config-dir", str(src.path)]
        forwarded = [o for o in hydra.overrides.hydra
                     if not o.lstrip("+~").startswith(_NOT_FORWARDED)]
        return args + forwarded

    def command(self, overrides: Sequence[str], job_dir: Path) -> list[str]:
        return [*self._entry(), *self._config_args(), *overrides,
                f"hydra.run.dir={_quoted(str(job_dir))}"]

    # ------------------------------------------------------------ running

    def launch(self, job_overrides: Sequence[Sequence[str]],
               initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.task_function is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        cwd = str(self.config.hydra.runtime.cwd)
        hook = _die_with_parent_hook()
        if self.forks and len(job_overrides) > 1:  # once here, not once per forked child
            for module in self.preload:
                importlib.import_module(module)
            self._before_fork_calls = [_named_function(name) for name in self.before_fork]
        pending = deque(enumerate(job_overrides))
        running: dict[int, tuple[subprocess.Popen | ForkedJob, float, Path]] = {}
        returns: dict[int, JobReturn] = {}
        num_failed = 0
        try:
            while pending or running:
                while pending and len(running) < self.n_jobs:
                    i, overrides = pending.popleft()
                    job_dir = sweep_dir / str(initial_job_idx + i)
                    running[i] = (self._start(overrides, job_dir, cwd, hook),
                                  time.monotonic(), job_dir)
                finished = [i for i, (p, _, _) in running.items() if p.poll() is not None]
                for i, (proc, started, _) in list(running.items()):
                    if (i not in finished and self.timeout_s is not None
                            and time.monotonic() - started > self.timeout_s):
                        proc.kill()
                        proc.wait()
                        finished.append(i)
                for i in finished:
                    proc, started, job_dir = running.pop(i)
                    elapsed = time.monotonic() - started
                    ret = self._job_return(job_overrides[i], job_dir, proc.returncode, elapsed)
                    returns[i] = ret
                    num_failed += ret.status == JobStatus.FAILED
                    if self.progress is not None:
                        self.progress.set_postfix(failed=num_failed, refresh=False)
                        self.progress.update(1)
                if not finished:
                    time.sleep(self.poll_s)
        finally:
            for proc, _, _ in running.values():  # interrupted: take the children down too
                proc.kill()
                proc.wait()
        return [returns[i] for i in range(len(job_overrides))]

    def _start(self, overrides: Sequence[str], job_dir: Path, cwd: str, hook):
        job_dir.mkdir(parents=True, exist_ok=True)
        cmd = self.command(overrides, job_dir)
        cfg = self.compose(overrides) if self.forks else None
        with open(job_dir / "stdout.log", "w") as out, open(job_dir / "stderr.log", "w") as err:
            out.write(f"# {' '.join(cmd)}\n")
            out.flush()
            if cfg is None:
                return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                        cwd=cwd, preexec_fn=hook)
            return self._fork(cfg, out.fileno(), err.fileno(), cwd, hook)

    def _fork(self, cfg: DictConfig, out: int, err: int, cwd: str, hook) -> ForkedJob:
        for call in self._before_fork_calls:  # in the campaign process, for the child to inherit
            call(cfg)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            return ForkedJob(pid)
        code = 1
        try:  # the child: never returns into the campaign's code
            if hook is not None:
                hook()
            devnull = os.open(os.devnull, os.O_RDONLY)
            for fd, target in ((devnull, 0), (out, 1), (err, 2)):
                os.dup2(fd, target)
            sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
            os.chdir(cwd)
            HydraConfig.instance().set_config(self.config)  # the sweep's (mode MULTIRUN)
            code = run_forked_task(self.task_function, cfg)
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)

    def _job_return(self, overrides: Sequence[str], job_dir: Path, code: int,
                    elapsed: float) -> JobReturn:
        ret = JobReturn(overrides=list(overrides), working_dir=str(job_dir),
                        task_name=self.config.hydra.job.name)
        last = _last_line(job_dir / "stdout.log")
        try:
            value = json.loads(last) if code == 0 else None
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict):
            ret.status = JobStatus.COMPLETED
            ret.return_value = value
            return ret
        if self.timeout_s is not None and elapsed > self.timeout_s:
            why = f"timed out after {self.timeout_s:g} s"
        elif code is not None and code < 0:
            why = f"killed by signal {-code}"
        else:
            why = f"exit code {code}"
        detail = _last_line(job_dir / "stderr.log") or "no JSON last line"
        ret.status = JobStatus.FAILED
        ret.return_value = JobProcessFailed(f"{why}: {detail} (logs: {job_dir})")
        return ret
