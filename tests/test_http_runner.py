"""End to end over HTTP: the runner serves 20 requests on the real tiny model through
`python -m serving_core.server` and writes ledgers that check clean."""

from __future__ import annotations

import subprocess
import sys

import pytest

import ledgers
from ledgers.check import check
from tests.test_server_process import tag  # noqa: F401  (fixture: no process outlives the test)


@pytest.mark.slow
def test_runner_over_http_on_the_tiny_model(tag, tmp_path, tiny_checkpoint):  # noqa: F811
    root = tmp_path / "ledgers"
    cmd = [sys.executable, "-m", "experiments.run", "executor=torch",
           f"executor.checkpoint={tiny_checkpoint}", "model=falcon_h1_tiny", "org=s2",
           "budget=b63", "workload.source=synthetic", "workload.num_requests=20",
           "load.rate=4", "trace=true", f"ledger_root={root}", "campaign_name=http_e2e",
           f"hydra.run.dir={tmp_path / 'hydra'}"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    report = check(root)
    assert report.ok, report
    con = ledgers.connect(root)
    runs = con.sql("SELECT executor, status, completed_requests, episode_end_s, span_end_s, "
                   "output_tokens FROM runs").fetchall()
    assert len(runs) == 1
    executor, status, completed, end, span_end, out = runs[0]
    assert (executor, status, completed) == ("torch:cpu", "complete", 20)
    assert end >= span_end  # the episode covers every request, in whole seconds
    req = con.sql("SELECT count(*), sum(output_tokens), sum(target_output_tokens), "
                  "min(ttft_s), count(*) FILTER (status = 'finished') FROM requests").fetchall()[0]
    assert req[0] == 20 and req[1] == req[2] == out and req[3] > 0 and req[4] == 20
    ticks = [t for (t,) in con.sql("SELECT DISTINCT t_s FROM poller ORDER BY 1").fetchall()]
    assert ticks[0] == 0 and len(ticks) >= end - 1 and ticks == sorted(set(ticks))
    # the server's resident memory, every 0.25 s of the episode
    rss = con.sql("SELECT t_s, rss_bytes FROM footprint ORDER BY t_s").fetchall()
    assert rss[0][0] == 0.0 and len(rss) >= 2 * end and all(b > 10**7 for _, b in rss)
    assert all(round(t / 0.25, 6).is_integer() for t, _ in rss)
    import json

    ((engine_config,),) = con.sql("SELECT engine_config FROM runs").fetchall()
    runtime = json.loads(engine_config)["runtime"]  # the server process's settings
    assert runtime["threads"] >= 1 and runtime["allocator"] in ("glibc", "tcmalloc")
    # each request's actual path as the server reported it, joined to its request row
    paths = con.sql("SELECT p.path, p.reused_tokens, r.adopted_prefix_tokens, "
                    "p.first_batch_computed FROM request_paths p JOIN requests r "
                    "USING (run_id, request_id)").fetchall()
    assert len(paths) == 20
    for path, reused, adopted, computed in paths:
        assert path == ("device_reuse" if reused > 0 else "recompute")
        assert reused == adopted == computed
    last = con.sql("SELECT generation_tokens_total FROM poller ORDER BY t_s DESC LIMIT 1")
    assert last.fetchall()[0][0] == out  # the final scrape saw every generated token
    events = con.sql("SELECT event FROM trace ORDER BY seq").fetchall()
    assert events[-1] == ("END",)
    assert con.sql("SELECT count(*) FROM trace WHERE event = 'FINISH'").fetchall()[0][0] == 20
    # Without preemption each request computes its prompt once and decodes all but its
    # first token (which the prefill step samples).
    assert con.sql("SELECT sum(preemptions) FROM requests").fetchall()[0][0] == 0
    decode, prefill = con.sql("SELECT sum(decode_tokens), sum(prefill_tokens_initial) "
                              "FROM steps").fetchall()[0]
    hits = con.sql("SELECT sum(prompt_tokens - adopted_prefix_tokens) FROM requests")
    assert decode == out - 20 and prefill == hits.fetchall()[0][0]
