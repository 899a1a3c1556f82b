"""The `models` campaign's regime (issue 48), written stage by stage from declared rules.

Every model is served on the first declared device that holds it with the campaign's larger
budget (serving_core/executor/device_fit.py). Budgets mean the same for every model: room
for BUDGET_REQUESTS requests at the workload's mean (MEAN_REQUEST_TOKENS of KV plus one
recurrent checkpoint each), rounded up to a whole MiB. Three stages, each a campaign the
sweeper runs and resumes (`make models`):

1. `ceiling`: every organization at CEILING_RATE (saturating) with all the state memory its
   device has left, seed CEILING_SEED: the model's memory-unbound ceiling is the best
   request-span throughput (campaign models_ceiling).
2. `split`: D0 at the smaller budget and the higher load over SPLIT_GRID and the
   byte-balanced fraction (a mean request's KV share of its bytes), on SPLIT_SEEDS, which
   the test seeds never use; the best mean throughput per model is D0's split at both
   budgets (ties: nearest 0.5) (campaign models_split).
3. `main`: the test cells, every organization at each budget and at LOAD_FRACTIONS of the
   ceiling (campaign models, plan conf/prereg/models.yaml), and S2's slab-policy
   alternatives on the same cells at the higher load (campaign models_sens).

`python -m experiments.campaigns.models_regime STAGE --ledger-root ROOT` writes the next
stage's campaign file from the ledgers of the previous one and REGIME_FILE, which the page
reads (devices, ceilings, budgets in bytes and units, loads, D0's choice).
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
LOAD_FRACTIONS = (0.6, 0.9)
CEILING_RATE = 100.0  # requests/s: all 300 arrive within about 3 s
CEILING_SEED = 41_000
SPLIT_SEEDS = (43_000, 43_001)
SPLIT_GRID = (0.3, 0.5, 0.7, 0.9)
TEST_SEEDS = (42_000, 42_003)  # range(42000,42003): three seeds
SENSITIVITY = {"slab_refill": "refill", "slab_dense": "dense"}
CEILING_REQUESTS = 300
REQUESTS = 150  # per run of the split and test stages (a 40-minute campaign on 2 cores)
COMMON = {"trace": False, "engine": {"cap": 63, "headroom": 0.0, "pinning_k": 2}}


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


def ceiling_stage() -> dict:
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
                     "budgets": {f"r{r}": budget_mib(m, r) for r in BUDGET_REQUESTS},
                     "byte_balanced_split": byte_balanced(m)}
        blocks[m] = {"model": m, "executor": device, "budget": f"{full}MiB"}
    campaign_file("models_ceiling", "Issue 48 stage 1 (experiments/campaigns/models_regime.py): "
                  "each model's memory-unbound\nceiling on its device, every organization at "
                  f"{CEILING_RATE:g} requests/s with all its device's state memory.",
                  {"load": {"rate": CEILING_RATE, "arrival": "poisson"}},
                  {"org": ",".join(ORGS), "seed": CEILING_SEED}, blocks, CEILING_REQUESTS)
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


def split_stage(regime: dict, root) -> dict:
    """Ceilings from stage 1, the loads they give, and stage 2's campaign (D0's splits)."""
    runs = _runs(root, "models_ceiling")
    blocks = {}
    for m, entry in regime.items():
        mine = [r for r in runs if r["model"] == m]
        best = max(mine, key=lambda r: r["throughput_span"])
        per_request = best["output_tokens"] / best["completed_requests"]
        entry["ceiling_tokens_s"] = {r["org"]: round(r["throughput_span"], 3) for r in mine}
        entry["ceiling"] = {"org": best["org"], "tokens_s": round(best["throughput_span"], 3),
                            "output_tokens_per_request": round(per_request, 3)}
        entry["rates"] = {f"l{round(100 * f)}": round(f * best["throughput_span"]
                                                      / per_request, 3)
                          for f in LOAD_FRACTIONS}
        grid = sorted(set(SPLIT_GRID) | {entry["byte_balanced_split"]})
        blocks[m] = {
            "model": m, "executor": entry["device"],
            "budget": f"{entry['budgets'][f'r{min(BUDGET_REQUESTS)}']}MiB",
            "load.rate": entry["rates"][f"l{round(100 * max(LOAD_FRACTIONS))}"],
            "model.d0_attention_fraction": ",".join(map(str, grid))}
    campaign_file("models_split", "Issue 48 stage 2: D0's split per model at the smaller "
                  "budget and the higher load, over\nthe grid and the byte-balanced fraction, "
                  "on seeds the test cells never use.", {"load": {"arrival": "poisson"}},
                  {"org": "d0", "seed": ",".join(map(str, SPLIT_SEEDS))}, blocks)
    return regime


def choose_split(runs: list[dict]) -> tuple[float, dict]:
    """The fraction of best mean throughput over the runs (ties: nearest 0.5); only runs on
    SPLIT_SEEDS count, so the test seeds never choose it."""
    newest = {}  # a cell and seed run again (another config of the stage): its latest run
    for r in sorted(runs, key=lambda r: str(r.get("created_at", ""))):
        newest[(float(r["d0_attention_fraction"]), r["seed"])] = r
    by: dict[float, list[float]] = {}
    for (fraction, seed), r in sorted(newest.items()):
        if seed in SPLIT_SEEDS:
            by.setdefault(fraction, []).append(r["throughput_span"])
    if not by:
        raise ValueError(f"no D0 run on the selection seeds {SPLIT_SEEDS}")
    means = {f: _mean(v) for f, v in sorted(by.items())}
    top = max(means.values())
    best = min((f for f, v in means.items() if v == top), key=lambda f: abs(f - 0.5))
    return best, {str(f): round(v, 3) for f, v in means.items()}


def main_stage(regime: dict, root) -> dict:
    """D0's splits from stage 2, then the test campaign, its sensitivity twin and plan."""
    runs = _runs(root, "models_split")
    blocks = {}
    for m, entry in regime.items():
        small = f"{entry['budgets'][f'r{min(BUDGET_REQUESTS)}']}MiB"
        split, means = choose_split([r for r in runs if r["model"] == m
                                     and r["budget"] == small])
        entry["d0_split"] = {"fraction": split, "selection_means": means}
        for level, mib in entry["budgets"].items():
            blocks[f"{m}_{level}"] = {
                "model": m, "executor": entry["device"], "budget": f"{mib}MiB",
                "load.rate": ",".join(str(v) for v in entry["rates"].values()),
                "model.d0_attention_fraction": split}
    seeds = f"range({TEST_SEEDS[0]},{TEST_SEEDS[1]})"
    campaign_file("models", MAIN_HEADER, {"load": {"arrival": "poisson"}},
                  {"org": ",".join(ORGS), "seed": seeds}, blocks)
    high = f"l{round(100 * max(LOAD_FRACTIONS))}"
    sens = {name: {**b, "load.rate": regime[b["model"]]["rates"][high]}
            for name, b in blocks.items()}
    campaign_file("models_sens", "Issue 48 sensitivity: S2 under the other slab policies "
                  "(conf/sensitivity/alternatives.yaml\nslab_refill, slab_dense) on every "
                  "cell of the models campaign at the higher load.",
                  {"load": {"arrival": "poisson"}},
                  {"org": "s2", "seed": seeds,
                   "engine.slab_policy": ",".join(SENSITIVITY.values())}, sens,
                  question="sensitivity")  # its S2 cells are the test cells' under other rules
    from experiments.campaigns.models_plan import write_plan

    write_plan(regime, ORGS, range(*TEST_SEEDS))
    return regime


MAIN_HEADER = """\
The question per model (issue 48; plan conf/prereg/models.yaml; page
analysis/questions/models.py), written by experiments/campaigns/models_regime.py from its
declared rules and the ledgers of stages 1-2: each model on the first declared device that
holds it (serving_core/executor/device_fit.py), every organization (S0, S1, S2, D0, N0,
Jenga), budgets of 16 and 32 requests at the workload's mean (KV of 3,602 tokens and one
checkpoint each), loads of 60 % and 90 % of the model's measured memory-unbound ceiling,
D0's split chosen on seeds 43000-43001; 150 requests a run; seeds 42000-42002.
conf/calibration/models_regime.yaml holds every value and its source."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=("ceiling", "split", "main"))
    ap.add_argument("--ledger-root", default="ledgers/data")
    args = ap.parse_args(argv)
    try:
        if args.stage == "ceiling":
            regime = ceiling_stage()
        else:
            regime = yaml.safe_load(REGIME_FILE.read_text())["models"]
            regime = (split_stage if args.stage == "split" else main_stage)(regime,
                                                                            args.ledger_root)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    REGIME_FILE.write_text(REGIME_HEADER + yaml.safe_dump({"models": regime}, sort_keys=False,
                                                          width=100))
    print(f"wrote {REGIME_FILE.relative_to(ROOT)} ({args.stage})")
    return 0


REGIME_HEADER = ("# The models campaign's regime (issue 48), written by "
                 "experiments/campaigns/models_regime.py;\n# do not edit by hand. Per model: "
                 "device and fit, bytes per request at the mean, budgets (MiB),\n# measured "
                 "ceilings (tokens/s per organization), loads (requests/s), D0's split.\n")

if __name__ == "__main__":
    sys.exit(main())
