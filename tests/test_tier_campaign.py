"""`make campaign C=tier SMOKE=1`, shrunk to one seed of a short synthetic workload: the
campaign collects its tier cells and the reused tier-off cells under their own campaigns,
each run's record states the tier it ran, and the report's tier page reads them through
the preregistered plan (conf/prereg/tier.yaml)."""

from __future__ import annotations

import json

from make_recipe import make_dry_run, recipe_commands, run_in_process

import ledgers
from analysis.pages.common import host_tier_bytes
from analysis.questions import supporting


def test_tier_smoke_campaign_collects_every_cell_and_the_page_reads_them(tmp_path):
    root = tmp_path / "ledgers"
    args = ("workload.source=synthetic workload.num_requests=20 hydra.sweeper.smoke_seeds=1 "
            f"hydra.sweep.dir={tmp_path / 'sweep'}")
    # the target's recipe (`make -n`) run in this process (tests/make_recipe.py)
    ((module, argv),) = recipe_commands(make_dry_run("campaign", "C=tier", "SMOKE=1",
                                                     f"LEDGER_ROOT={root}", f"ARGS={args}"))
    assert module == "experiments.run" and "campaign=tier" in argv
    code, stdout, stderr = run_in_process(module, argv)
    assert code == 0, stderr[-2000:]
    last = json.loads(stdout.strip().splitlines()[-1])
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
