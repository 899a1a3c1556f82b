"""Server processes: bad starts fail clearly and leave nothing running; killing either
side of a run leaves no server behind; a graceful stop writes records ending in END.

Servers here run the paced simulated executor (fast boot); the slow end-to-end test
runs the real tiny model through the runner."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import httpx
import pytest
from conftest import wait_until

from experiments.runners.http_run import serve_over_http
from experiments.runners.server_process import ServerError, ServerProcess, hsl_server_command
from serving_core.server.records_out import read_records

TAG = "HSL_TEST_SERVER_TAG"
ENGINE_CORE = os.environ.get("HSL_ENGINE_CORE", "thread")  # process: every server's engine
# core in a process of its own (the graceful-stop test runs one either way)


@pytest.fixture()
def tag(monkeypatch):
    """A unique environment marker inherited by every process a test starts; at the end
    no process carrying it may be alive."""
    value = uuid.uuid4().hex
    monkeypatch.setenv(TAG, value)
    yield value
    wait_until(lambda: not _tagged(value), timeout_s=60, poll_s=0.2,
               what="every server process of the test to exit")


def _tagged(value: str) -> list[int]:
    """Live (non-zombie) processes whose environment carries the tag."""
    marker = f"{TAG}={value}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(proc.name))
        except OSError:
            continue
    return found


SIM_OVERRIDES = ("model=falcon_h1_tiny", "executor=a100", "org=s2", "budget=b63",
                 "engine.cap=16", "trace=true")


def _sim_cmd(records: Path, *overrides: str) -> list[str]:
    """Our server on the paced step model (fast boot), its spec composed from run overrides
    as `python -m experiments.serve` does."""
    from experiments.serve import server_spec

    spec = server_spec([*SIM_OVERRIDES, *overrides])
    path = Path(records).parent / f"spec-{uuid.uuid4().hex[:8]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(spec.to_json())
    return [*hsl_server_command(spec=str(path), records=str(records)), "--engine-core",
            ENGINE_CORE]


def _run(cmd, timeout=120):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_port_in_use_fails_with_exit_2(tag, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        cmd = _sim_cmd(tmp_path / "rec")
        cmd[cmd.index("--port") + 1] = str(port)
        res = _run(cmd)
    assert res.returncode == 2
    assert res.stderr.strip() == (f"error: --port={port}: address 127.0.0.1:{port} "
                                  "is already in use")
    assert not (tmp_path / "rec").exists()


def _engine_cores_of(pid: int) -> list[int]:
    """The engine core processes among `pid`'s children (not multiprocessing's resource
    tracker, which spawn starts beside it)."""
    kids = [int(c) for t in Path(f"/proc/{pid}/task").iterdir()
            for c in (t / "children").read_text().split()]
    return [k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]


def _server_side_states(port: int) -> set[str]:
    """TCP states (/proc/net/tcp) of the sockets on local port `port`: 0A LISTEN,
    06 TIME_WAIT, 05 FIN_WAIT2, 08 CLOSE_WAIT, ..."""
    states = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port:
            states.add(fields[3])
    return states


def test_restart_on_the_same_port_right_after_sigkill(tag, tmp_path):
    """A server killed with SIGKILL while a client is connected leaves its port's
    connections behind (not listening); a new server on that port, started at once, binds
    (SO_REUSEADDR) and serves, where it used to fail for about 60 s with exit 2."""
    import time

    cmd = _sim_cmd(tmp_path / "rec")
    with ServerProcess(cmd, health_timeout_s=300) as first:
        port = int(first.base_url.rsplit(":", 1)[1])
        client = httpx.Client(timeout=30)
        assert client.post(first.base_url + "/v1/completions",
                           json={"prompt": [1, 2, 3], "max_tokens": 2}).status_code == 200
        os.killpg(first.proc.pid, signal.SIGKILL)
        first.proc.wait(30)
        killed = time.monotonic()
        client.close()  # the server's side of the connection now waits out TIME_WAIT
        left = _server_side_states(port)
        assert left and "0A" not in left  # connections left behind, no listener
        again = list(cmd)
        again[again.index("--port") + 1] = str(port)
        restarted_after = time.monotonic() - killed
        with ServerProcess(again, health_timeout_s=300) as second:  # exit 2 without the fix
            assert second.base_url == f"http://127.0.0.1:{port}"
            r = httpx.post(second.base_url + "/v1/completions",
                           json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=30)
            assert r.status_code == 200
        assert restarted_after < 1.0  # started within a second of the kill


def test_bad_arguments_exit_2_with_one_line(tag, tmp_path, capsys):
    serve = [sys.executable, "-m", "experiments.serve", "model=falcon_h1_tiny", "budget=b63",
             "--port", "0"]
    res = _run([*serve, "org=s7"])
    assert res.returncode == 2
    assert res.stderr.strip() == "error: org='s7': allowed values are s0, s1, s2, d0, " \
                                 "s2_retention, n0, n0_vllm, jenga, s2_marconi, d0_marconi"
    res = _run([*serve, "org=s2", "executor=torch", f"executor.checkpoint={tmp_path / 'none'}"])
    assert res.returncode == 2 and "not a directory" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    # The server itself, in process (`python -m serving_core.server` exits with main's
    # status; test_port_in_use_fails_with_exit_2 runs it as a process): a spec file that is
    # not a spec, an unknown engine core, an unknown OpenMP wait.
    from serving_core.server.__main__ import main as server_main

    def server(argv: list[str]) -> tuple[int, str]:
        capsys.readouterr()
        code = server_main(argv)
        return code, capsys.readouterr().err

    bad = tmp_path / "spec.json"
    bad.write_text('{"org": "s2", "budget": "b63", "model": {}, "colour": 1}')
    code, err = server(["--spec", str(bad), "--port", "0"])
    assert code == 2
    assert err.strip().startswith(f"error: --spec={str(bad)!r}: engine spec: unknown "
                                  "keys ['colour']")
    sim_args = _sim_cmd(tmp_path / "rec")[3:]  # after `python -m serving_core.server`
    code, err = server([*sim_args, "--engine-core", "fork"])
    assert code == 2
    assert err.strip() == "error: --engine-core='fork': allowed values are thread, process"
    code, err = server([*sim_args, "--omp-wait", "spin"])
    assert code == 2
    assert err.strip() == "error: --omp-wait='spin': allowed values are default, passive"
    for name, bad_value, allowed in (("HSL_PAGED_LOOPS", "fast", "auto, compiled, python"),
                                     ("HSL_ARENA_HUGE_PAGES", "yes", "auto, off")):
        with pytest.MonkeyPatch.context() as mp:  # read by the engine's torch side
            mp.setenv(name, bad_value)
            code, err = server(sim_args)
        assert code == 2
        assert err.strip() == (f"error: {name}={bad_value!r} (environment): allowed values "
                               f"are {allowed}")
    assert not (tmp_path / "rec").exists()


def test_records_go_through_the_writer_the_launcher_names(tmp_path, capsys):
    """The server writes its records through a port (server/records_out.py): --records
    without --records-writer, or a writer that does not load, is one line and exit 2,
    nothing written; the launchers name the ledger side's writer."""
    from experiments.runners.server_process import RECORDS_WRITER, hsl_server_command
    from serving_core.server.__main__ import main
    from serving_core.server.records_out import load_writer

    rec = tmp_path / "rec"
    for extra, message in (([], "error: --records: needs --records-writer MODULE:FUNCTION"),
                           (["--records-writer", "nowhere:write"],
                            "error: --records-writer='nowhere:write': cannot load")):
        assert main(["--spec", str(tmp_path / "none.json"), "--records", str(rec),
                     *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith(message) and len(err.strip().splitlines()) == 1
    assert not rec.exists()
    from serving_core.server.__main__ import _check, parser

    args = parser().parse_args(["--spec", "s.json"])  # no records: the shutdown's writer is
    _check(args)  # None (it was unset, and a server without --records failed at shutdown)
    assert args.write_records is None
    cmd = hsl_server_command(spec="s.json", records=str(rec))
    assert cmd[cmd.index("--records-writer") + 1] == RECORDS_WRITER
    import pyarrow.parquet as pq

    from ledgers.schemas import ENGINE_SCHEMAS
    from serving_core.server.records_out import RECORD_TABLES

    empty = {name: {c: [] for c in ENGINE_SCHEMAS[name].names} for name in RECORD_TABLES}
    out = load_writer(RECORDS_WRITER)(rec, empty, {"clock_end_s": 0.0})
    for name in RECORD_TABLES:  # written under the ledger's column types
        written = pq.read_schema(out / f"{name}.parquet")
        assert [(f.name, f.type) for f in written] == \
            [(f.name, f.type) for f in ENGINE_SCHEMAS[name]]
    assert read_records(out)[1] == {"clock_end_s": 0.0}


def test_model_folder_that_does_not_load(tag, tmp_path, tiny_checkpoint):
    """config.json matches the preset but the weights are damaged: exit 1, one clear
    line, nothing left running."""
    broken = tmp_path / "falcon_h1_tiny"
    broken.mkdir()
    (broken / "config.json").write_text((Path(tiny_checkpoint) / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    res = _run([sys.executable, "-m", "experiments.serve", "model=falcon_h1_tiny", "org=s2",
                "budget=b63", "executor=torch", f"executor.checkpoint={broken}", "--port", "0"])
    assert res.returncode == 1
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "the checkpoint does not load" in err[0], res.stderr


def test_server_that_never_becomes_healthy(tag, tmp_path):
    """A process that listens but answers /health with 503: a clear timeout, then it is
    stopped."""
    script = textwrap.dedent("""
        import http.server, socketserver
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(503); self.end_headers()
            def log_message(self, *a): pass
        with socketserver.TCPServer(("127.0.0.1", 0), H) as s:
            print(f"listening on http://127.0.0.1:{s.server_address[1]}", flush=True)
            s.serve_forever()
    """)
    srv = ServerProcess([sys.executable, "-c", script], health_timeout_s=1.5, stop_timeout_s=5)
    with pytest.raises(ServerError, match=r"server not healthy after 1.5 s \(GET http://"):
        srv.start()
    assert srv.proc is None or srv.proc.poll() is not None  # stopped, not left running


def test_server_that_exits_during_boot(tag, tmp_path):
    srv = ServerProcess([sys.executable, "-c", "import sys; sys.exit(3)"], health_timeout_s=30)
    with pytest.raises(ServerError, match="exited with code 3 before becoming healthy"):
        srv.start()


def _specs(n: int, prompt: int, output: int):
    import numpy as np

    from experiments.workloads.workload import RequestSpec

    return [RequestSpec(i, 0.05 * i, np.arange(1 + i, 1 + i + prompt, dtype=np.int32), output,
                        -1, "") for i in range(n)]


@pytest.mark.parametrize(("sig", "core"), [(signal.SIGTERM, "thread"),
                                           (signal.SIGINT, "process")])
def test_graceful_stop_writes_records_with_end(tag, tmp_path, sig, core):
    """Either signal drains and writes the records; with `--engine-core process` the engine
    core process (the one child of the server) writes them and exits with it (the tag
    fixture: nothing left)."""
    rec = tmp_path / "rec"
    with ServerProcess([*_sim_cmd(rec), "--engine-core", core], health_timeout_s=300) as srv:
        assert srv.runtime_config()["engine_core"] == core
        assert len(_engine_cores_of(srv.pid)) == (core == "process")
        r = httpx.post(srv.base_url + "/v1/completions",
                       json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=30)
        assert r.status_code == 200
        assert r.json()["usage"]["hsl_path"]["path"] == "recompute"
        os.kill(srv.pid, sig)
        assert srv.proc.wait(60) == 0
    tables, summary = read_records(rec)
    assert tables["trace"]["event"][-1] == "END"
    assert summary["completed"] == 1 and summary["output_tokens"] == 4
    assert len(tables["steps"]["step"]) == 4


def _generated_tokens(base_url: str) -> float:
    """The server's generated-token counter (its /metrics; labelled by model_name)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=30).text
    (value,) = [s.value for fam in text_string_to_metric_families(text)
                for s in fam.samples if s.name == "vllm:generation_tokens_total"]
    return float(value)


def _request_in_background(srv, max_tokens: int):
    """A completion request in a thread, returned once the server is generating its tokens
    (a condition, not a sleep: a loaded machine only makes it later); (thread, result)."""
    out = {}

    def request():
        out["r"] = httpx.post(srv.base_url + "/v1/completions",
                              json={"prompt": [1, 2, 3], "max_tokens": max_tokens}, timeout=120)

    t = threading.Thread(target=request)
    t.start()
    wait_until(lambda: _generated_tokens(srv.base_url) > 0, poll_s=0.02,
               what="the request's first generated token")
    return t, out


def test_sigterm_finishes_in_flight_requests(tag, tmp_path):
    """--drain finish: a request in flight when SIGTERM arrives still completes."""
    rec = tmp_path / "rec"
    with ServerProcess(_sim_cmd(rec), health_timeout_s=300) as srv:
        t, out = _request_in_background(srv, 600)
        os.kill(srv.pid, signal.SIGTERM)
        t.join(120)
        assert srv.proc.wait(120) == 0
    assert out["r"].status_code == 200
    assert len(out["r"].json()["choices"][0]["token_ids"]) == 600
    tables, summary = read_records(rec)
    assert summary["completed"] == 1 and tables["trace"]["event"][-1] == "END"


def test_sigterm_answers_new_requests_503_while_draining(tag, tmp_path):
    """--drain finish: after SIGTERM the server keeps listening; a new request gets 503
    (OpenAI error body) while the in-flight one completes; then exit 0."""
    rec = tmp_path / "rec"
    with ServerProcess(_sim_cmd(rec), health_timeout_s=60) as srv:
        t, out = _request_in_background(srv, 1200)
        os.kill(srv.pid, signal.SIGTERM)

        def refused():  # until the signal is handled a new request is still served
            r = httpx.post(srv.base_url + "/v1/completions",
                           json={"prompt": [1], "max_tokens": 1}, timeout=30)
            return r if r.status_code == 503 else None

        r = wait_until(refused, what="a 503 after SIGTERM")
        assert r.json()["error"]["code"] == 503
        t.join(60)
        assert srv.proc.wait(60) == 0
    assert out["r"].status_code == 200
    assert len(out["r"].json()["choices"][0]["token_ids"]) == 1200


def test_abort_stop_ends_in_flight_requests(tag, tmp_path):
    """stop(abort=True): a second SIGTERM ends the in-flight request at once; exit 0 and
    the records show it unfinished."""
    rec = tmp_path / "rec"
    with ServerProcess(_sim_cmd(rec), health_timeout_s=300, stop_timeout_s=30) as srv:
        t, out = _request_in_background(srv, 8000)
        # exit 0 within stop_timeout_s (past it the server would be killed, code -9), and
        # the request ends unfinished: aborted, not drained
        assert srv.stop(abort=True) == 0
        t.join(120)
    assert out["r"].status_code == 503
    tables, summary = read_records(rec)
    assert tables["requests"]["status"] == ["unfinished"] and summary["completed"] == 0
    assert tables["trace"]["event"][-1] == "END"


def test_run_over_http_measures_at_the_client(tag, tmp_path):
    """serve_over_http against the paced simulated server: every request completes with its
    planned tokens; client times are ordered; the poller saw the final counters; the
    engine tables are mapped onto workload ids. Without records (another server kind) the
    engine counts come from the poller."""
    specs = _specs(6, 64, 20)
    for records in (tmp_path / "rec", None):
        cmd = _sim_cmd(tmp_path / "unused" if records is None else records)
        if records is None:
            i = cmd.index("--records")
            del cmd[i:i + 2]
        tables, summary = serve_over_http(cmd, specs, records_dir=records and str(records))
        req = tables["requests"]
        assert req["request_id"] == list(range(6)) and req["status"] == ["finished"] * 6
        assert req["output_tokens"] == [20] * 6 and summary["output_tokens"] == 120
        for a, f, e in zip(req["arrival_s"], req["first_token_s"], req["finish_s"], strict=True):
            assert 0 <= a < f <= e <= summary["episode_end_s"]
        assert summary["episode_end_s"] == math.ceil(summary["episode_end_s"])
        poll = tables["poller"]
        assert poll["t_s"][0] == 0 and poll["generation_tokens_total"][-1] == 120
        assert summary["prefill_tokens_computed"] == 6 * 64
        if records is None:
            assert tables["trace"]["seq"] == [] and tables["steps"]["step"] == []
        else:
            finishes = [r for e, r in zip(tables["trace"]["event"], tables["trace"]["request_id"],
                                          strict=True) if e == "FINISH"]
            assert sorted(finishes) == list(range(6))
            assert tables["trace"]["event"][-1] == "END"


def test_killing_the_server_mid_run_fails_the_run(tag, tmp_path, monkeypatch):
    """SIGKILL on the server while the client streams: a clear error, no process left."""
    import asyncio

    import experiments.runners.http_run as http_run

    send = http_run.send_workload

    async def send_then_kill(base_url, specs, t0, **kw):
        async def kill_later():
            await asyncio.to_thread(  # the workload is streaming by now
                wait_until, lambda: _generated_tokens(base_url) > 0, poll_s=0.02,
                what="the first generated token")
            (server,) = [p for p in _tagged(os.environ[TAG])
                         if b"serving_core.server" in Path(f"/proc/{p}/cmdline").read_bytes()]
            os.kill(server, signal.SIGKILL)

        killer = asyncio.create_task(kill_later())
        try:
            return await send(base_url, specs, t0, **kw)
        finally:
            await killer

    monkeypatch.setattr(http_run, "send_workload", send_then_kill)
    rec = tmp_path / "rec"
    with pytest.raises(ServerError) as err:
        serve_over_http(_sim_cmd(rec), _specs(16, 200, 3000), records_dir=str(rec))
    assert "requests failed (server exited with code -9)" in str(err.value)


def test_killing_the_client_stops_the_server(tag, tmp_path):
    """The runner dies (SIGKILL, no cleanup): its server notices and exits."""
    rec = tmp_path / "rec"
    script = textwrap.dedent(f"""
        import json, sys, time
        from experiments.runners.server_process import ServerProcess
        srv = ServerProcess({json.dumps(_sim_cmd(rec))}, health_timeout_s=300).start()
        print(srv.pid, flush=True)
        time.sleep(600)
    """)
    client = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(client.stdout.readline())
        assert Path(f"/proc/{server_pid}").exists()
        client.kill()
        client.wait(60)
        wait_until(lambda: server_pid not in _tagged(os.environ[TAG]), timeout_s=120,
                   poll_s=0.2, what="the orphaned server to exit")
    finally:
        client.kill()
    _, summary = read_records(rec)  # it shut down gracefully: records written
    assert summary["completed"] == 0


def test_engine_core_process_dies_with_its_server(tag, tmp_path):
    """A server killed with SIGKILL (no cleanup) takes its engine core process with it."""
    srv = ServerProcess([*_sim_cmd(tmp_path / "rec"), "--engine-core", "process"],
                        health_timeout_s=300).start()
    try:
        (child,) = _engine_cores_of(srv.pid)
        os.kill(srv.pid, signal.SIGKILL)
        srv.proc.wait(30)
        wait_until(lambda: child not in _tagged(os.environ[TAG]), timeout_s=60, poll_s=0.1,
                   what="the engine core process to exit")
    finally:
        srv.stop()
