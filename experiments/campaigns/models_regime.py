"""The `models` campaign's regime (issue 48), written stage by stage from declared rules.

Every model is served on the first declared device that holds it with the campaign's larger
budget (serving_core/executor/device_fit.py). Budgets mean the same for every model: room
for BUDGET_REQUESTS requests at the workload's mean (MEAN_REQUEST_TOKENS of KV plus one
recurrent checkpoint each), rounded up to a whole MiB. Three stages, each a campaign the
sweeper runs and resumes (`make models`):

1. `capacity` (campaign models_capacity, seed CAPACITY_SEED): every organization at
   CEILING_RATE (saturating) with all the state memory its device has left (the model's
   memory-unbound ceiling, shown as the fraction every throughput is of) and at each budget
   (its memory-bound capacity there); and unloaded, IDLE_REQUESTS at IDLE_RATE (the model's
   unloaded p99 TTFT). The load rule: at each budget, LOAD_FRACTIONS of the memory-bound
   capacity of the best organization there (the budget's leader), so memory decides and the
   leader is never overloaded; the overload bound: TTFT_BOUND_FACTOR x the model's unloaded
   p99 TTFT (its best organization's), a cell over it is flagged on the page, not ranked.
2. `split`: D0 at the smaller budget and its (highest) load over SPLIT_GRID and the
   byte-balanced fraction (a mean request's KV share of its bytes), on SPLIT_SEEDS, which
   the test seeds never use; the best mean throughput per model is D0's split at both
   budgets (ties: nearest 0.5) (campaign models_split).
3. `main`: the test cells, every organization at each budget and load on TEST_SEEDS
   (campaign models, plan conf/prereg/models.yaml: enough seeds that a unanimous effect
   passes Holm over the family, experiments/campaigns/models_plan.py), and the sensitivity
   runs (campaign models_sens, experiments/campaigns/models_sens.py).

`python -m experiments.campaigns.models_regime STAGE --ledger-root ROOT` writes the next
stage's campaign file from the ledgers of the previous one and REGIME_FILE, which the page
reads (devices, ceilings, capacities, budgets in bytes and units, loads, bounds, D0's choice).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import yaml

from ledgers.arms import PLAIN_ARMS
from ledgers.writer import read_raw_runs
from serving_core.executor.device_fit import activation_bytes, choose_device, device_fit
from serving_core.executor.profiles import load_device_profile
from serving_core.geometry import load_geometry

ROOT = Path(__file__).resolve().parents[2]
CAMPAIGN_DIR = ROOT / "conf" / "campaign"
REGIME_FILE = ROOT / "conf" / "calibration" / "models_regime.yaml"
MODELS = ("falcon_h1_7b", "granite_4_0_h_tiny", "granite_4_0_h_small", "nemotron_h_8b",
          "qwen3_next_80b_a3b", "jamba_v0_1")
ORGS = PLAIN_ARMS  # every storage organization (ledgers/arms.py)
# The ShareGPT workload's mean request: input 3,365 tokens (conf/config.yaml
# workload.mean_input_tokens) + output 237 (seed 42000: 71,041 tokens over 300 requests).
MEAN_REQUEST_TOKENS = 3_602
BUDGET_REQUESTS = (16, 32)
# Loads: fractions of the budget leader's memory-bound capacity (20 % headroom for Poisson
# bursts; one load: a second at 50 % doubled the runs past the campaign's time on 2 cores).
LOAD_FRACTIONS = (0.8,)
CEILING_RATE = 100.0  # requests/s: all 300 arrive within about 3 s
CAPACITY_SEED = 41_000
IDLE_RATE = 0.05  # requests/s: one request at a time (a mean request takes a few seconds)
IDLE_REQUESTS = 30
TTFT_BOUND_FACTOR = 10.0  # the overload bound: 10 x the unloaded p99 TTFT
SPLIT_SEEDS = (43_000, 43_001)
SPLIT_GRID = (0.3, 0.5, 0.7, 0.9)
TEST_SEEDS = (42_000, 42_009)  # range(42000,42009): models_plan.seeds_for_holm(10 tests)
CEILING_REQUESTS = 300
REQUESTS = 100  # per run of the split, test and sensitivity stages
COMMON = {"trace": False, "engine": {"cap": 63, "headroom": 0.0, "pinning_k": 2}}
FULL = "full"  # the capacity stage's block of all the device's state memory


def request_bytes(model: str) -> int:
    """Bytes of one request at the workload's mean: its KV and one checkpoint."""
    g = load_geometry(model)
    return MEAN_REQUEST_TOKENS * g.kv_bytes_per_token + g.recurrent_bytes_per_checkpoint


def budget_mib(model: str, requests: int) -> int:
    return math.ceil(requests * request_bytes(model) / 2**20)


def device_for(model: str) -> str:
    """The declared device that holds the model with its larger budget."""
    return choose_device(load_geometry(model), budget_mib(model, max(BUDGET_REQUESTS)) * 2**20)


def full_device_mib(model: str, device: str) -> int:
    """The state memory the device has left after the weights and activations, in MiB."""
    g, profile = load_geometry(model), load_device_profile(device)
    fit = device_fit(g, device, 0)
    per_gpu = fit.usable - fit.weights - activation_bytes(g, profile)
    return int(per_gpu * profile.tensor_parallel // 2**20)


def byte_balanced(model: str) -> float:
    """A mean request's KV share of its bytes: D0's byte-balanced attention fraction."""
    g = load_geometry(model)
    return round(MEAN_REQUEST_TOKENS * g.kv_bytes_per_token / request_bytes(model), 3)


def campaign_file(name: str, header: str, top: dict, params: dict, blocks: dict,
                  requests: int = REQUESTS, question: str = "models") -> Path:
    """Write conf/campaign/<name>.yaml (a sweeper campaign of question `question`)."""
    doc = {"campaign_name": name, "question": question, **COMMON,
           "workload": {"q": 1.0, "reuse": "share", "num_requests": requests}, **top,
           "hydra": {"sweeper": {"order": "seed_major", "smoke_requests": 30,
                                 "params": params, "blocks": blocks}}}
    path = CAMPAIGN_DIR / f"{name}.yaml"
    lines = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    path.write_text("# @package _global_\n" + lines + yaml.safe_dump(doc, sort_keys=False,
                                                                     width=100))
    return path


def _level(requests: int) -> str:
    return f"r{requests}"


def _load(fraction: float) -> str:
    return f"l{round(100 * fraction)}"


def capacity_stage() -> dict:
    """Stage 1's campaign and the regime's devices and budgets."""
    regime, blocks = {}, {}
    for m in MODELS:
        device = device_for(m)
        full = full_device_mib(m, device)
        g = load_geometry(m)
        regime[m] = {"device": device, "device_name": load_device_profile(device).name,
                     "fit": device_fit(g, device, budget_mib(m, max(BUDGET_REQUESTS))
                                       * 2**20).line(),
                     "request_bytes": request_bytes(m), "full_device_mib": full,
                     "kv_bytes_per_token": g.kv_bytes_per_token,
                     "checkpoint_bytes": g.recurrent_bytes_per_checkpoint,
                     "budgets": {_level(r): budget_mib(m, r) for r in BUDGET_REQUESTS},
                     "byte_balanced_split": byte_balanced(m)}
        for level, mib in {FULL: full, **regime[m]["budgets"]}.items():
            blocks[f"{m}_{level}"] = {"model": m, "executor": device, "budget": f"{mib}MiB"}
        blocks[f"{m}_idle"] = {"model": m, "executor": device, "budget": f"{full}MiB",
                               "load.rate": IDLE_RATE, "workload.num_requests": IDLE_REQUESTS}
    campaign_file("models_capacity", "Issue 48 stage 1 (experiments/campaigns/models_regime.py):"
                  " every organization at\n"
                  f"{CEILING_RATE:g} requests/s with all its device's state memory (the "
                  "memory-unbound ceiling) and at each\nbudget (the memory-bound capacity), "
                  f"and unloaded ({IDLE_REQUESTS} requests at {IDLE_RATE:g}/s: the unloaded "
                  "p99 TTFT).", {"load": {"rate": CEILING_RATE, "arrival": "poisson"}},
                  {"org": ",".join(ORGS), "seed": CAPACITY_SEED}, blocks, CEILING_REQUESTS)
    return regime


def _runs(root, campaign: str) -> list[dict]:
    runs = [r for r in read_raw_runs(root, campaign) if r.get("status") == "complete"]
    if not runs:
        raise ValueError(f"ledger_root={str(root)!r}: no runs of campaign {campaign}; run "
                         f"`make campaign C={campaign}` first")
    return runs


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def best_run(runs: list[dict]) -> dict:
    """The run of highest request-span throughput (ties: the first organization of ORGS)."""
    order = {org: i for i, org in enumerate(a.upper() for a in ORGS)}
    return max(runs, key=lambda r: (r["throughput_span"], -order.get(str(r["org"]), 99)))


def load_rates(capacity_tokens_s: float, tokens_per_request: float) -> dict[str, float]:
    """The load rule: {l<percent>: requests/s} at LOAD_FRACTIONS of a capacity in tokens/s."""
    return {_load(f): round(f * capacity_tokens_s / tokens_per_request, 3)
            for f in LOAD_FRACTIONS}


def ttft_bound(idle_ttft_p99: dict[str, float]) -> float:
    """The overload bound in seconds: TTFT_BOUND_FACTOR x the best unloaded p99 TTFT."""
    return round(TTFT_BOUND_FACTOR * min(idle_ttft_p99.values()), 3)


def ttft_p99(root, campaign: str, run_ids) -> dict[str, float]:
    """{run_id: p99 TTFT of its finished requests} from the requests ledger (linear
    interpolation, as the pages' quantile_cont)."""
    import numpy as np
    import pyarrow.parquet as pq

    wanted, ttfts = set(run_ids), {}
    for path in sorted((Path(root) / "requests" / f"campaign={campaign}").glob("*.parquet")):
        table = pq.read_table(path, columns=["run_id", "status", "ttft_s"]).to_pandas()
        table = table[table["run_id"].isin(wanted) & (table["status"] == "finished")]
        for run_id, group in table.groupby("run_id"):
            ttfts.setdefault(run_id, []).extend(group["ttft_s"].dropna())
    return {r: float(np.quantile(v, 0.99)) for r, v in ttfts.items()}


def measure_regime(entry: dict, mine: list[dict]) -> None:
    """Ceiling, capacities, leaders, loads and the overload bound of one model from its
    capacity-stage runs (budgets tell the blocks apart; the idle runs, which carry their
    `ttft_p99`, by their rate)."""
    idle = [r for r in mine if math.isclose(float(r["rate"]), IDLE_RATE)]
    busy = [r for r in mine if r not in idle]
    entry["idle_ttft_p99_s"] = {r["org"]: round(r["ttft_p99"], 3) for r in idle}
    entry["ttft_bound_s"] = ttft_bound(entry["idle_ttft_p99_s"])
    budgets = {FULL: entry["full_device_mib"], **entry["budgets"]}
    measured = {}
    for level, mib in budgets.items():
        at = [r for r in busy if r["budget"] == f"{mib}MiB"]
        best = best_run(at)
        per_request = best["output_tokens"] / best["completed_requests"]
        measured[level] = {"org": best["org"], "tokens_s": round(best["throughput_span"], 3),
                           "output_tokens_per_request": round(per_request, 3),
                           "per_org": {r["org"]: round(r["throughput_span"], 3) for r in at}}
    entry["ceiling"] = measured.pop(FULL)
    entry["capacity"] = measured
    entry["rates"] = {level: load_rates(c["tokens_s"], c["output_tokens_per_request"])
                      for level, c in measured.items()}


def split_stage(regime: dict, root) -> dict:
    """Stage 1's measures, and stage 2's campaign (D0's splits)."""
    runs = _runs(root, "models_capacity")
    p99 = ttft_p99(root, "models_capacity", [r["run_id"] for r in runs
                                             if math.isclose(float(r["rate"]), IDLE_RATE)])
    runs = [{**r, "ttft_p99": p99.get(r["run_id"], math.nan)} for r in runs]
    blocks = {}
    small, high = _level(min(BUDGET_REQUESTS)), _load(max(LOAD_FRACTIONS))
    for m, entry in regime.items():
        measure_regime(entry, [r for r in runs if r["model"] == m])
        grid = sorted(set(SPLIT_GRID) | {entry["byte_balanced_split"]})
        blocks[m] = {
            "model": m, "executor": entry["device"], "budget": f"{entry['budgets'][small]}MiB",
            "load.rate": entry["rates"][small][high],
            "model.d0_attention_fraction": ",".join(map(str, grid))}
    campaign_file("models_split", "Issue 48 stage 2: D0's split per model at the smaller "
                  "budget and its higher load, over\nthe grid and the byte-balanced fraction, "
                  "on seeds the test cells never use.", {"load": {"arrival": "poisson"}},
                  {"org": "d0", "seed": ",".join(map(str, SPLIT_SEEDS))}, blocks)
    return regime


def choose_split(runs: list[dict]) -> tuple[float, dict]:
    """The fraction of best mean throughput over the runs (ties: nearest 0.5); only runs on
    SPLIT_SEEDS count, so the test seeds never choose it, and only fractions complete on
    every one of them (a split that cannot hold some request fails its run)."""
    newest = {}  # a cell and seed run again (another config of the stage): its latest run
    for r in sorted(runs, key=lambda r: str(r.get("created_at", ""))):
        newest[(float(r["d0_attention_fraction"]), r["seed"])] = r
    by: dict[float, list[float]] = {}
    for (fraction, seed), r in sorted(newest.items()):
        if seed in SPLIT_SEEDS:
            by.setdefault(fraction, []).append(r["throughput_span"])
    by = {f: v for f, v in by.items() if len(v) == len(SPLIT_SEEDS)}  # a failed seed: out
    if not by:
        raise ValueError(f"no D0 fraction complete on the selection seeds {SPLIT_SEEDS}")
    means = {f: _mean(v) for f, v in sorted(by.items())}
    top = max(means.values())
    best = min((f for f, v in means.items() if v == top), key=lambda f: abs(f - 0.5))
    return best, {str(f): round(v, 3) for f, v in means.items()}


def main_stage(regime: dict, root) -> dict:
    """D0's splits from stage 2, then the test campaign, its sensitivity campaign and plan;
    returns the sensitivity spec (models_sens.write_sensitivity)."""
    from experiments.campaigns.models_plan import write_plan
    from experiments.campaigns.models_sens import write_sensitivity

    runs = _runs(root, "models_split")
    blocks = {}
    for m, entry in regime.items():
        small = f"{entry['budgets'][_level(min(BUDGET_REQUESTS))]}MiB"
        split, means = choose_split([r for r in runs if r["model"] == m
                                     and r["budget"] == small])
        entry["d0_split"] = {"fraction": split, "selection_means": means}
        for level, mib in entry["budgets"].items():
            blocks[f"{m}_{level}"] = {
                "model": m, "executor": entry["device"], "budget": f"{mib}MiB",
                "load.rate": ",".join(str(v) for v in entry["rates"][level].values()),
                "model.d0_attention_fraction": split}
    seeds = f"range({TEST_SEEDS[0]},{TEST_SEEDS[1]})"
    campaign_file("models", MAIN_HEADER, {"load": {"arrival": "poisson"}},
                  {"org": ",".join(ORGS), "seed": seeds}, blocks)
    spec = write_sensitivity(regime, blocks, _load(max(LOAD_FRACTIONS)))
    write_plan(regime, ORGS, range(*TEST_SEEDS))
    return spec


MAIN_HEADER = """\
The question per model (issue 48; plan conf/prereg/models.yaml; page
analysis/questions/models.py), written by experiments/campaigns/models_regime.py from its
declared rules and the ledgers of stages 1-2: each model on the first declared device that
holds it (serving_core/executor/device_fit.py), every organization (S0, S1, S2, D0, N0,
Jenga), budgets of 16 and 32 requests at the workload's mean (KV of 3,602 tokens and one
checkpoint each), a load of 80 % of the memory-bound capacity of the budget's best
organization (measured on seed 41000), D0's split chosen on seeds 43000-43001; 100 requests
a run; seeds 42000-42008 (enough for Holm: conf/prereg/models.yaml).
conf/calibration/models_regime.yaml holds every value and its source."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=("capacity", "split", "main"))
    ap.add_argument("--ledger-root", default="ledgers/data")
    args = ap.parse_args(argv)
    try:
        doc = ({"models": capacity_stage()} if args.stage == "capacity"
               else yaml.safe_load(REGIME_FILE.read_text()))
        if args.stage == "split":
            split_stage(doc["models"], args.ledger_root)
        elif args.stage == "main":
            doc["sensitivity"] = main_stage(doc["models"], args.ledger_root)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    REGIME_FILE.write_text(REGIME_HEADER + yaml.safe_dump(doc, sort_keys=False, width=100))
    print(f"wrote {REGIME_FILE.relative_to(ROOT)} ({args.stage})")
    return 0


REGIME_HEADER = """\
# The models campaign's regime (issue 48), written by experiments/campaigns/models_regime.py;
# do not edit by hand. Per model: device and fit, bytes per request at the mean, budgets
# (MiB), measured ceiling and capacities (tokens/s per organization), loads (requests/s) per
# budget, the unloaded p99 TTFT and the overload bound (s), D0's split; `sensitivity`: which
# runs each alternative has of its own and which it shares.
"""

if __name__ == "__main__":
    sys.exit(main())
