"""A serving process owned by the runner: start, wait until healthy, stop, never leak.

`ServerProcess` is a context manager around one server subprocess (ours, or any
OpenAI-compatible server started by a command). The process runs in its own
session so a stop reaches its children too; leaving the context stops it
(SIGTERM, then SIGKILL after a grace period) whatever happened inside, and our
server also watches its parent (`--exit-with-parent`) in case the runner dies.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

_LISTENING = re.compile(r"listening on (http://\S+)")
_ENGINE_PREFIX = "engine "  # serving_core.server prints its effective rules first
_RUNTIME_PREFIX = "runtime "  # then its process settings


class ServerError(RuntimeError):
    """The server did not start, did not become healthy, or died."""


# ----- allocator ----------------------------------------------------------------------------
# Under glibc malloc a decode step's large temporaries are mmapped and page-faulted afresh
# every step (a third of all CPU time was system time); tcmalloc keeps them (+70 % output
# tokens/s for our server, +10 % for vLLM's on the 2-core machine). `auto` preloads it when
# a libtcmalloc is installed (Debian: libtcmalloc-minimal4 or libgoogle-perftools4); without
# one everything runs on glibc malloc as before.
ALLOCATORS = ("auto", "tcmalloc", "glibc")
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so",
                  "libtcmalloc.so")
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
            "/usr/local/lib")


def find_tcmalloc() -> str | None:
    """Path of an installed tcmalloc shared library, or None."""
    for d in LIB_DIRS:
        for name in TCMALLOC_NAMES:
            path = Path(d) / name
            if path.exists():
                return str(path)
    return None


def allocator_env(allocator: str = "auto", env: dict | None = None) -> tuple[dict, str]:
    """(environment for a server process, allocator it will run): `auto` preloads tcmalloc
    when installed, `tcmalloc` requires it, `glibc` never preloads (and drops an inherited
    tcmalloc preload). ValueError names the field and the allowed values."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator={allocator!r}: allowed values are {', '.join(ALLOCATORS)}")
    env = dict(os.environ if env is None else env)
    preload = [p for p in env.get("LD_PRELOAD", "").split() if "tcmalloc" not in p]
    path = find_tcmalloc() if allocator != "glibc" else None
    if allocator == "tcmalloc" and path is None:
        raise ValueError("allocator=tcmalloc: no libtcmalloc installed (Debian: apt-get install "
                         "libtcmalloc-minimal4); allowed values without it: auto, glibc")
    if path:
        preload.insert(0, path)
    if preload:
        env["LD_PRELOAD"] = " ".join(preload)
    else:
        env.pop("LD_PRELOAD", None)
    return env, "tcmalloc" if path else "glibc"


def hsl_server_command(*, spec: str, records: str | None = None, drain: str = "finish",
                       tokenizer: str = "none", threads: int = 0) -> list[str]:
    """The command line of `python -m serving_core.server` for the engine spec in file
    `spec` (serving_core.engine_spec.EngineSpec as JSON), on a free port (`threads`: torch
    intra-op threads, 0 = the server's default)."""
    cmd = [sys.executable, "-m", "serving_core.server", "--spec", str(spec),
           "--tokenizer", tokenizer, "--port", "0", "--drain", drain, "--exit-with-parent",
           "--threads", str(int(threads))]
    if records:
        cmd += ["--records", str(records), "--records-writer", RECORDS_WRITER]
    return cmd


# The server's records port (serving_core/server/records_out.py), filled by the ledger side.
RECORDS_WRITER = "experiments.runners.server_process:write_server_records"


def write_server_records(folder, tables: dict[str, dict[str, list]], summary: dict) -> Path:
    """The server's records under the ledger's engine schemas (`--records-writer`)."""
    from ledgers.schemas import ENGINE_SCHEMAS
    from serving_core.server.records_out import write_records

    return write_records(folder, tables, summary, ENGINE_SCHEMAS)


class ServerProcess:
    """One server subprocess: `with ServerProcess(cmd) as srv: srv.base_url ...`.

    The base URL comes from the server's `listening on URL` line (or `base_url=`
    for servers that do not print one). `health_timeout_s` bounds the wait for
    GET /health; `stop()` returns the exit code. `allocator` (auto|tcmalloc|glibc, see
    `allocator_env`) sets the process's malloc; `self.allocator` says which it got.
    """

    def __init__(self, cmd: list[str], *, base_url: str | None = None,
                 health_path: str = "/health", health_timeout_s: float = 120.0,
                 stop_timeout_s: float = 60.0, env: dict | None = None,
                 allocator: str = "auto") -> None:
        self.cmd = cmd
        self.base_url = base_url
        self.health_path = health_path
        self.health_timeout_s = health_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.env, self.allocator = allocator_env(allocator, env)
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile("w+", prefix="server-", suffix=".log",
                                                delete=False)
        self._lines: list[str] = []
        self._url_seen = threading.Event()

    # ----- start ----------------------------------------------------------------------------
    def start(self) -> ServerProcess:
        self.proc = subprocess.Popen(
            self.cmd, stdout=subprocess.PIPE, stderr=self._log, text=True,
            start_new_session=True, env=self.env,
        )
        threading.Thread(target=self._read_stdout, daemon=True).start()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self._lines.append(line.rstrip("\n"))
            m = _LISTENING.search(line)
            if m and self.base_url is None:
                self.base_url = m.group(1)
                self._url_seen.set()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.health_timeout_s
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise ServerError(f"server exited with code {code} before becoming healthy: "
                                  f"{self.stderr_tail()}")
            if self.base_url is not None:
                try:
                    r = httpx.get(self.base_url + self.health_path, timeout=2.0)
                    if r.status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.05)
        raise ServerError(f"server not healthy after {self.health_timeout_s:g} s "
                          f"(GET {self.base_url or '<no url yet>'}{self.health_path}); "
                          f"command: {' '.join(self.cmd)}")

    # ----- state ----------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def stderr_tail(self, lines: int = 5) -> str:
        self._log.flush()
        text = Path(self._log.name).read_text(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:]) or "(no stderr)"

    def log_text(self) -> str:
        """The whole stderr log so far (servers that report their configuration there)."""
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")

    @property
    def stdout_lines(self) -> list[str]:
        return list(self._lines)

    def engine_config(self) -> dict | None:
        """The effective rules our server printed at boot (None for other servers)."""
        return self._json_line(_ENGINE_PREFIX)

    def runtime_config(self) -> dict | None:
        """The process settings our server read back at boot (intra-op threads, allocator);
        None for other servers."""
        return self._json_line(_RUNTIME_PREFIX)

    def _json_line(self, prefix: str) -> dict | None:
        for line in self._lines:
            if line.startswith(prefix):
                return json.loads(line[len(prefix):])
        return None

    # ----- stop -----------------------------------------------------------------------------
    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def _accepting(self) -> bool:
        """The server still takes new work (it has not begun to shut down): its health
        check answers 200. A draining server answers 503, a closed one not at all."""
        if self.base_url is None:
            return False
        try:
            return httpx.get(self.base_url + self.health_path, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, abort: bool = False) -> int | None:
        """SIGTERM (graceful: records are written), SIGKILL after the grace period.
        `abort`: a second SIGTERM, so in-flight requests end now instead of finishing."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeout_s
            if abort:
                # The second signal ends in-flight requests. Sent before the server handled
                # the first (a loaded machine), the two would merge into one; once it has
                # handled the first its health check stops answering 200.
                while (self.proc.poll() is None and time.monotonic() < deadline
                       and self._accepting()):
                    time.sleep(0.05)
                if self.proc.poll() is None:
                    self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait()
        self._signal_group(signal.SIGKILL)  # anything the server left in its session
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self if self.proc is not None else self.start()  # started: enters as it is

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop(abort=exc_type is not None)  # after a failure nothing is worth finishing
        self._log.close()
        os.unlink(self._log.name)
