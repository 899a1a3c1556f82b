"""`make campaign C=arms SMOKE=1` end to end (issue 29): the five arms (S2, D0, Jenga, S2 and
D0 under Marconi) at the three budgets, three smoke seeds each, written to a ledger that
passes the checker, each run recording the organization and cache policy its engine ran,
and the arms page with its cell means and the preregistered ARMS-9 family."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import ledgers
from analysis.questions import arms
from ledgers import check as ledger_check

REPO = Path(__file__).resolve().parent.parent
# Requests a run: 20, not the smoke's 60. What is checked here (the run set, the ledger check,
# the rules each run records, the page's frames) does not depend on the run's length; every
# cell still has hits and each Marconi arm its tuned weights.
REQUESTS = 20


def test_make_campaign_arms_smoke(tmp_path):
    root = tmp_path / "ledgers"
    # the make target itself, the default suite's one real `make campaign` (-o: never a
    # reinstall of .venv); in a suite worker its recipe in-process (tests/make_recipe.py) was
    # no cheaper: 45 runs forked from the worker's larger heap
    proc = subprocess.run(["make", "-s", "--no-print-directory", "-o", ".venv/.installed",
                           "campaign", "C=arms",
                           "SMOKE=1", f"LEDGER_ROOT={root}", "JOBS=2",
                           f"ARGS=hydra.sweeper.smoke_requests={REQUESTS} "
                           f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (summary["planned"], summary["done"], summary["failed"]) == (45, 45, 0)
    assert ledger_check.main([str(root)]) == 0
    con = ledgers.connect(root)
    rows = con.execute("SELECT org, budget, count(*) FROM runs GROUP BY ALL").fetchall()
    assert {(org, budget): n for org, budget, n in rows} == {
        (org, budget): 3 for org in ("S2", "D0", "JENGA", "S2_MARCONI", "D0_MARCONI")
        for budget in ("b63", "b83", "b108")}
    recorded = con.execute("SELECT org, engine_config FROM runs").fetchall()
    for org, config in recorded:
        rules = json.loads(config)
        assert rules["cache_policy"] == ("marconi" if org.endswith("_MARCONI") else "lru"), org
        assert rules["org"] == {"JENGA": "JENGA"}.get(org, org.split("_")[0])
    result = arms.analyze(con)
    cells = result.frames["cells"]
    assert len(cells) == 15 and cells["token_hit_rate"].between(0, 1).all()
    (family,) = [f for f in result.families if f.name.startswith("ARMS-9")]
    assert len(family.tables["throughput_span"]) == 9
    alphas = result.frames["marconi_alphas"]  # the tuned weights each Marconi arm recorded
    assert len(alphas) == 6 and (alphas["runs"] == 3).all()
    decomposed = result.frames["marconi_decomposed"]  # D0's grid, then the policy
    assert len(decomposed) == 4 * 3  # 4 pairs (arms.DECOMPOSITION) x 3 budgets
    assert decomposed["comparison"].str.contains("D0+Marconi", regex=False).sum() == 2 * 3
