"""Process launcher: every job in a fresh `python -m <entry module> <overrides>` process,
`n_jobs` at a time (0: one per CPU core).

Why one command-line process per job rather than a process pool: a job that
kills its interpreter (segfault, out-of-memory kill) fails only itself, where a
ProcessPoolExecutor marks every pending future broken; no task function or
Hydra state is pickled; and each job is the command a user could rerun by hand
(its log starts with it). Children get PR_SET_PDEATHSIG on Linux, so a
SIGKILLed campaign leaves no orphan still writing ledgers.

Each job's output goes to `<sweep dir>/<job number>/stdout.log` and
`stderr.log`; its last stdout line (the runner's JSON) is the job's return value.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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


class ProcessLauncher(Launcher):
    def __init__(self, n_jobs: int = 0, timeout_s: float | None = None,
                 poll_s: float = 0.05) -> None:
        if isinstance(n_jobs, bool) or not isinstance(n_jobs, int) or n_jobs < 0:
            raise ValueError(f"hydra.launcher.n_jobs={n_jobs!r}: allowed integers >= 0 "
                             "(0: one job per CPU core)")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"hydra.launcher.timeout_s={timeout_s!r}: allowed numbers > 0 or null")
        self.n_jobs = n_jobs or os.cpu_count() or 1
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.progress: Any = None  # a tqdm bar set by the campaign sweeper
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.config = config
        self.task_function = task_function

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
        pending = deque(enumerate(job_overrides))
        running: dict[int, tuple[subprocess.Popen, float, Path]] = {}
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

    def _start(self, overrides: Sequence[str], job_dir: Path, cwd: str, hook) -> subprocess.Popen:
        job_dir.mkdir(parents=True, exist_ok=True)
        cmd = self.command(overrides, job_dir)
        with open(job_dir / "stdout.log", "w") as out, open(job_dir / "stderr.log", "w") as err:
            out.write(f"# {' '.join(cmd)}\n")
            out.flush()
            return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    cwd=cwd, preexec_fn=hook)

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
