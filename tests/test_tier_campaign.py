"""`make campaign C=tier SMOKE=1`, shrunk to one seed of a short synthetic workload: the
campaign collects its tier cells and the reused tier-off cells under their own campaigns,
each run's record states the tier it ran, and the report's tier page reads them through
the preregistered plan (conf/prereg/tier.yaml)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import ledgers
from analysis.pages.common import host_tier_bytes
from analysis.questions import supporting

REPO = Path(__file__).resolve().parent.parent


def test_tier_smoke_campaign_collects_every_cell_and_the_page_reads_them(tmp_path):
    root = tmp_path / "ledgers"
    args = ("workload.source=synthetic workload.num_requests=20 hydra.sweeper.smoke_seeds=1 "
            f"hydra.sweep.dir={tmp_path / 'sweep'}")
    proc = subprocess.run(["make", "--no-print-directory", "campaign", "C=tier", "SMOKE=1",
                           f"LEDGER_ROOT={root}", f"ARGS={args}"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (last["planned"], last["done"], last["failed"]) == (18, 18, 0)
    con = ledgers.connect(root)
    rows = con.execute("SELECT campaign, org, budget, engine_config FROM runs").fetchall()
    cells = sorted((c, o, b, host_tier_bytes(e)) for c, o, b, e in rows)
    want = sorted([("q1_smoke", o, b, -1) for o in ("S0", "S2") for b in ("b63", "b108")]
                  + [("q4_smoke", "D0", b, -1) for b in ("b63", "b108")]
                  + [("tier_smoke", o, b, t) for o in ("S0", "S2", "D0")
                     for b in ("b63", "b108") for t in (4 << 30, 32 << 30)])
    assert cells == want
    page = next(p for p in supporting.PAGES if p.QUESTION == "tier")
    result = page.analyze(con)
    text = result.markdown()
    assert "Family `TIER-1 (smoke)`" in text and "Family `TIER-2 (smoke)`" in text
    assert "tier_smoke" in text
    con.close()
