"""Server processes: bad starts fail clearly and leave nothing running; killing either
side of a run leaves no server behind; a graceful stop writes records ending in END.

Servers here run the paced simulated executor (fast boot); the slow end-to-end test
runs the real tiny model through the runner."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from experiments.http_run import serve_over_http
from experiments.server_process import ServerError, ServerProcess, hsl_server_command
from serving_core.server.records_out import read_records

TAG = "HSL_TEST_SERVER_TAG"


@pytest.fixture()
def tag(monkeypatch):
    """A unique environment marker inherited by every process a test starts; at the end
    no process carrying it may be alive."""
    value = uuid.uuid4().hex
    monkeypatch.setenv(TAG, value)
    yield value
    deadline = time.monotonic() + 10
    while _tagged(value) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _tagged(value), "a server process outlived its test"


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


def _sim_cmd(records: Path, **kw) -> list[str]:
    args = dict(checkpoint=None, preset="falcon_h1_tiny", org="s2", budget="b63", cap=16,
                max_num_batched_tokens=2048, headroom=0.0, retention_k=None, pinning_k=None,
                trace=True, records=str(records), executor="simulated")
    args.update(kw)
    return hsl_server_command(**args)


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


def test_bad_arguments_exit_2_with_one_line(tag, tmp_path):
    res = _run(_sim_cmd(tmp_path / "rec", org="s7"))
    assert res.returncode == 2
    assert res.stderr.strip() == "error: --org='s7': allowed values are s0, s1, s2, d0, " \
                                 "s2_retention"
    res = _run([sys.executable, "-m", "serving_core.server", "--model", str(tmp_path / "none"),
                "--preset", "falcon_h1_tiny", "--org", "s2", "--budget", "b63", "--port", "0"])
    assert res.returncode == 2 and "not a directory" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_model_folder_that_does_not_load(tag, tmp_path, tiny_checkpoint):
    """config.json matches the preset but the weights are damaged: exit 1, one clear
    line, nothing left running."""
    broken = tmp_path / "falcon_h1_tiny"
    broken.mkdir()
    (broken / "config.json").write_text((Path(tiny_checkpoint) / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    res = _run([sys.executable, "-m", "serving_core.server", "--model", str(broken),
                "--org", "s2", "--budget", "b63", "--port", "0"])
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
    assert not srv.alive()


def test_server_that_exits_during_boot(tag, tmp_path):
    srv = ServerProcess([sys.executable, "-c", "import sys; sys.exit(3)"], health_timeout_s=30)
    with pytest.raises(ServerError, match="exited with code 3 before becoming healthy"):
        srv.start()


def _specs(n: int, prompt: int, output: int):
    import numpy as np

    from experiments.workload import RequestSpec

    return [RequestSpec(i, 0.05 * i, np.arange(1 + i, 1 + i + prompt, dtype=np.int32), output,
                        -1, "") for i in range(n)]


def test_graceful_stop_writes_records_with_end(tag, tmp_path):
    rec = tmp_path / "rec"
    with ServerProcess(_sim_cmd(rec), health_timeout_s=60) as srv:
        r = httpx.post(srv.base_url + "/v1/completions",
                       json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=30)
        assert r.status_code == 200
        assert srv.stop() == 0
    tables, summary = read_records(rec)
    assert tables["trace"]["event"][-1] == "END"
    assert summary["completed"] == 1 and summary["output_tokens"] == 4
    assert len(tables["steps"]["step"]) == 4


def test_sigterm_finishes_in_flight_requests(tag, tmp_path):
    """--drain finish: a request in flight when SIGTERM arrives still completes."""
    rec = tmp_path / "rec"
    with ServerProcess(_sim_cmd(rec), health_timeout_s=60) as srv:
        out = {}

        def request():
            out["r"] = httpx.post(srv.base_url + "/v1/completions",
                                  json={"prompt": [1, 2, 3], "max_tokens": 600}, timeout=60)

        t = threading.Thread(target=request)
        t.start()
        time.sleep(0.5)
        os.kill(srv.pid, signal.SIGTERM)
        t.join(60)
        assert srv.proc.wait(60) == 0
    assert out["r"].status_code == 200
    assert len(out["r"].json()["choices"][0]["token_ids"]) == 600
    tables, summary = read_records(rec)
    assert summary["completed"] == 1 and tables["trace"]["event"][-1] == "END"


def test_killing_the_server_mid_run_fails_the_run(tag, tmp_path):
    """SIGKILL on the server while the client streams: a clear error, no process left."""
    rec = tmp_path / "rec"
    cmd = _sim_cmd(rec)
    errors = []

    def killer():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            pids = _tagged(os.environ[TAG])
            servers = [p for p in pids if b"serving_core.server" in
                       Path(f"/proc/{p}/cmdline").read_bytes()]
            if servers:
                time.sleep(2.0)  # booted and serving
                os.kill(servers[0], signal.SIGKILL)
                return
            time.sleep(0.1)

    threading.Thread(target=killer, daemon=True).start()
    with pytest.raises(ServerError) as err:
        serve_over_http(cmd, _specs(16, 200, 3000), records_dir=str(rec))
    errors.append(str(err.value))
    assert "requests failed" in errors[0] and "exited with code -9" in errors[0]


def test_killing_the_client_stops_the_server(tag, tmp_path):
    """The runner dies (SIGKILL, no cleanup): its server notices and exits."""
    rec = tmp_path / "rec"
    script = textwrap.dedent(f"""
        import json, sys, time
        from experiments.server_process import ServerProcess
        srv = ServerProcess({json.dumps(_sim_cmd(rec))}, health_timeout_s=60).start()
        print(srv.pid, flush=True)
        time.sleep(600)
    """)
    client = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(client.stdout.readline())
        assert Path(f"/proc/{server_pid}").exists()
        client.kill()
        client.wait(10)
        deadline = time.monotonic() + 15
        while server_pid in _tagged(os.environ[TAG]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server_pid not in _tagged(os.environ[TAG])
    finally:
        client.kill()
    _, summary = read_records(rec)  # it shut down gracefully: records written
    assert summary["completed"] == 0
