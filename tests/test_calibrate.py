"""Calibration of the additive step model: steps-ledger features, exact recovery of known
constants from a steps ledger, and the anchor fit end to end on a tiny subset."""

from __future__ import annotations

import csv
from dataclasses import asdict

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import compose_config

from experiments.runners.cell import run_cell
from experiments.studies import calibrate as cal
from serving_core.executor import AdditiveStepModel, load_device_profile

KNOWN = {
    "name": "known",
    "step_model": "additive",
    "memory_efficiency": 0.7,
    "matmul_efficiency": 0.55,
    "mixed_step_s": 0.003,
    "indirection_overhead": 0.05,
    "per_step_overhead_s": 0.0007,
}
SYNTH = ("workload.source=synthetic", "workload.synthetic_prompt_tokens=1400",
         "workload.synthetic_context_tokens=1200", "workload.synthetic_output_tokens=200",
         "workload.num_requests=40", "org=s2", "budget=b30", "load.rate=4")


def known_profile():
    base = asdict(load_device_profile("a100_roofline"))
    return load_device_profile({**base, **KNOWN})


def run_with(profile, *overrides):
    from omegaconf import OmegaConf

    cfg = compose_config(*SYNTH, *overrides)
    OmegaConf.set_struct(cfg, False)
    cfg.executor = OmegaConf.create(asdict(profile))
    return run_cell(cfg)


class Recording:
    """Delegates to a model and keeps every batch it timed."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def step_seconds(self, new, ctx, writes=0):
        self.calls.append((list(new), list(ctx), writes))
        return self.model.step_seconds(new, ctx, writes)


def test_steps_ledger_columns_carry_the_model_features(falcon):
    """Feature sums rebuilt from the steps ledger equal those of the timed batches."""
    from engines import run_simulated

    from experiments.workloads.workload import build_workload
    from serving_core.scheduler import SchedulerConfig

    profile = known_profile()
    model = AdditiveStepModel(falcon, profile, "S2")
    rec = Recording(model)
    cfg = compose_config(*SYNTH)
    wl = build_workload(cfg.workload, cfg.load, 42000)
    res = run_simulated(falcon, "S2", {"shared": 30},
                        SchedulerConfig(max_num_batched_tokens=2048), wl.requests, rec)
    from_ledger = cal.step_feature_sums(model, res.tables["steps"])
    from_batches = [sum(x) for x in zip(*((*model.plan_features(*c), len(c[0]))
                                          for c in rec.calls), strict=True)]
    assert from_ledger.tolist() == pytest.approx(from_batches, rel=1e-12)
    assert sum(res.tables["steps"]["duration_s"]) == pytest.approx(
        sum(model.step_seconds(*c) for c in rec.calls), rel=1e-12)
    assert from_ledger[3] > 0 and from_ledger[1] > 0  # mixed and prefill steps occur


def test_fit_to_a_steps_ledger_recovers_known_constants(tmp_path):
    """`--steps` goes through serving_core's fit_steps. A profile it can represent exactly
    (dense and scan efficiencies scaled together from the start's) is recovered from an S0
    run's ledger (S0 has no indirection term to confound)."""
    start = load_device_profile("a100_roofline")
    known = {**KNOWN, "indirection_overhead": 0.0,
             "scan_efficiency": start.scan_efficiency * KNOWN["matmul_efficiency"]
             / start.matmul_efficiency}
    res = run_with(load_device_profile({**asdict(start), **known}), "org=s0")
    steps = tmp_path / "steps.parquet"
    pq.write_table(pa.table(res.tables["steps"]), steps)
    out = tmp_path / "fitted.yaml"
    assert cal.main(["--steps", str(steps), "--org", "S0", "--start", "a100_roofline",
                     "--out", str(out)]) == 0
    fitted = load_device_profile(yaml.safe_load(out.read_text()))
    for key in ("memory_efficiency", "matmul_efficiency", "scan_efficiency", "mixed_step_s",
                "per_step_overhead_s", "per_seq_overhead_s"):
        assert getattr(fitted, key) == pytest.approx(known.get(key, getattr(start, key)),
                                                     rel=1e-4), key
    fit = yaml.safe_load(out.read_text())["fit"]
    assert fit["residuals"]["rows"] == len(res.tables["steps"]["step"])
    assert fit["residuals"]["rms_rel_error"] < 1e-6


def test_anchor_fit_end_to_end_on_a_tiny_subset(tmp_path, capsys):
    """Two cells of 40 requests: the fit runs, writes a loadable profile with residuals and
    data provenance, and prints every anchor with its relative error."""
    anchors = tmp_path / "anchors.csv"
    rows = [
        ("C", "L", "b63", "3.0", "63", "1.0", "0-2", "D0", "event_s", "30.0"),
        ("C", "L", "b63", "3.0", "63", "1.0", "0-2", "S2", "event_s", "28.0"),
        ("C", "L", "b63", "3.0", "63", "1.0", "0-2", "D0", "throughput", "400.0"),
        ("C", "L", "b63", "3.0", "63", "1.0", "0-2", "S2", "throughput", "420.0"),
        ("C", "L", "b63", "3.0", "63", "1.0", "0-2", "S2", "c_once", "100000"),
    ]
    with anchors.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["section", "point", "budget", "rate", "cap", "q", "seeds", "org", "metric",
                    "value"])
        w.writerows(rows)
    out = tmp_path / "a100.yaml"
    code = cal.main(["--anchors", str(anchors), "--seeds", "1", "--iterations", "1",
                     "--skip-output-fit", "--out", str(out),
                     "--override", "workload.num_requests=40"])
    assert code == 0
    data = yaml.safe_load(out.read_text())
    profile = load_device_profile(data)
    assert profile.step_model == "additive"
    assert set(data["fit"]["fitted"]) == set(cal.FITTED)
    # two event rows, two throughput rows, two mixed steps
    assert len(data["fit"]["residuals"]) == 2 + 2 + 2
    assert data["fit"]["data"]["anchors_sha256"] == cal._sha(anchors)
    printed = capsys.readouterr().out
    for metric in ("event_s", "throughput", "c_once"):
        assert metric in printed
    assert "rel err" in printed


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert cal.main(["--seeds", "0"]) == 2
    assert cal.main(["--steps", str(tmp_path / "missing.parquet")]) == 2
    assert cal.main(["--start", "tpu"]) == 2
    err = capsys.readouterr().err
    assert "--seeds" in err and "missing.parquet" in err and "tpu" in err


def test_organization_ratios_pair_organizations_within_one_section_and_point():
    """Ratios of cell means, measured and ours, gap in pp; section C's S2 at point L is not
    paired with section B's S1 at the same point."""
    rows = [  # (section, point, org, metric, anchor, ours, rel err)
        ("B", "L", "S0", "throughput", 100.0, 110.0, 0.10),
        ("B", "L", "S1", "throughput", 150.0, 176.0, 176 / 150 - 1),
        ("B", "L", "S2", "throughput", 165.0, 176.0, 176 / 165 - 1),
        ("B", "L", "S1", "c_once", 200.0, 100.0, -0.5),
        ("B", "L", "S2", "c_once", 150.0, 90.0, -0.4),
        ("C", "L", "S2", "throughput", 400.0, 400.0, 0.0),
        ("C", "L", "D0", "throughput", 412.0, 404.0, 0.01),
    ]
    got = {(r[0], r[2], r[3]): r for r in cal.ratio_rows(rows)}
    assert set(got) == {("B", "throughput", "S1/S0"), ("B", "throughput", "S2/S1"),
                        ("B", "c_once", "S2/S1"), ("C", "throughput", "D0/S2")}
    r = got[("B", "throughput", "S1/S0")]
    assert (r[4], r[5], r[6]) == pytest.approx((0.5, 0.6, 10.0))
    r = got[("B", "throughput", "S2/S1")]
    assert (r[4], r[5], r[6]) == pytest.approx((0.1, 0.0, -10.0))
    r = got[("B", "c_once", "S2/S1")]
    assert (r[4], r[5]) == pytest.approx((-0.25, -0.1))
    r = got[("C", "throughput", "D0/S2")]
    assert (r[4], r[5], r[6]) == pytest.approx((0.03, 0.01, -2.0))
    lines = cal.acceptance(rows, cal.ratio_rows(rows))
    ratio_line = next(line for line in lines if line.startswith("throughput ratios"))
    assert "NO" in ratio_line and "S1/S0 +10.0" in ratio_line and "D0/S2" not in ratio_line
    assert next(line for line in lines if line.startswith("throughput within")).count("NO") == 1


def test_slab_dumps_anchor_is_read_from_conf():
    assert cal.load_slab_dumps() == [(43, 3), (69, 5)]


def _device(theta, f, paged, pieces):
    """The additive device time of summed features (the fit's model, written out)."""
    inv_mem, inv_mm, mix, x, _, page_s, slot_s = theta
    return ((f[0] * inv_mem + f[1] * inv_mm + f[2] + f[3] * mix) * (1 + x * paged)
            + f[4] * (pieces[0] * page_s + pieces[1] * slot_s))


@pytest.mark.parametrize("form", ["pages", "indirection", "both"])
def test_fit_recovers_known_paged_constants_of_its_form(form):
    """Eight synthetic cells (D0, S1, S2 with different feature sums) whose event seconds
    and throughputs follow a known profile exactly: the fit, started elsewhere, recovers the
    form's constants and sets the paged constants outside the form to 0."""
    import numpy as np

    rng = np.random.default_rng(3)
    truth = {"memory_efficiency": 0.7, "matmul_efficiency": 0.55, "mixed_step_s": 0.004,
             "per_step_overhead_s": 0.0008, "indirection_overhead": 0.0,
             "state_page_s": 0.0, "conv_slot_s": 0.0}
    if form in ("pages", "both"):
        truth |= {"state_page_s": 2e-5, "conv_slot_s": 7e-6}
    if form in ("indirection", "both"):
        truth["indirection_overhead"] = 0.04
    ran = load_device_profile({**asdict(load_device_profile("a100")),
                               "memory_efficiency": 0.6, "matmul_efficiency": 0.5,
                               "mixed_step_s": 0.003, "per_step_overhead_s": 0.0006,
                               "indirection_overhead": 0.01, "state_page_s": 1e-5,
                               "conv_slot_s": 1e-5})

    def vec(p):
        return [1 / p["memory_efficiency"], 1 / p["matmul_efficiency"], p["mixed_step_s"],
                p["indirection_overhead"], p["per_step_overhead_s"], p["state_page_s"],
                p["conv_slot_s"]]

    true_v, ran_v = vec(truth), vec(asdict(ran))
    pieces = {"D0": (0, 0), "S1": (4, 0), "S2": (3, 1)}
    runs, anchors = {}, []
    for i, org in enumerate(["D0", "S1", "S2", "D0", "S1", "S2", "S1", "S2"]):
        cell = cal.Cell(f"p{i}", "b63", 3.0, 63, 1.0, "0-2", org)
        f = np.array([rng.uniform(40, 90), rng.uniform(20, 60), rng.uniform(10, 30),
                      rng.uniform(500, 2000), rng.uniform(3e4, 1.5e5)])
        paged = org != "D0"
        k, out, span = float(rng.uniform(2000, 6000)), 72000.0, float(rng.uniform(150, 260))
        metrics = {"output_tokens": out, "span_s": span, "k": k, "state_pages": pieces[org][0],
                   "conv_slots": pieces[org][1]}
        runs[cell] = [cal.RunStats(cell, 0, metrics, f)]
        event = _device(true_v, f, paged, pieces[org])
        moved = span + event - _device(ran_v, f, paged, pieces[org]) + k * (
            true_v[4] - ran_v[4])
        anchors += [cal.Anchor("C", cell, "event_s", event),
                    cal.Anchor("B", cell, "throughput", out / moved)]
    mixed = [(512, 15, 0.004), (1536, 15, 0.004)]
    fitted, residuals = cal.fit_constants(runs, anchors, mixed, ran, cal.STEP_FORMS[form])
    for name, want in truth.items():
        assert getattr(fitted, name) == pytest.approx(want, rel=1e-4, abs=1e-12), name
    assert max(abs(r[3]) for r in residuals) < 1e-6


def test_out_empty_writes_nothing(tmp_path, monkeypatch):
    """`--out ''` ("'' to write nothing") runs the fit and writes no file (it used to become
    Path('.') and fail after the fit)."""
    anchors = tmp_path / "anchors.csv"
    with anchors.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["section", "point", "budget", "rate", "cap", "q", "seeds", "org", "metric",
                    "value"])
        w.writerow(["C", "L", "b63", "3.0", "63", "1.0", "0-2", "S2", "throughput", "420.0"])
        w.writerow(["C", "L", "b63", "3.0", "63", "1.0", "0-2", "S2", "event_s", "28.0"])
    monkeypatch.chdir(tmp_path)
    assert cal.main(["--anchors", str(anchors), "--seeds", "1", "--iterations", "1",
                     "--skip-output-fit", "--out", "", "--form", "pages",
                     "--override", "workload.num_requests=20"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["anchors.csv"]
