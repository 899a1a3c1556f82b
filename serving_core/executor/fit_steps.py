"""Fit an additive step-time profile to measured engine steps (bounded least squares).

Each row of a steps ledger (a real run's, on any device) is one equation

    duration = (t_m M + t_p P + t_a A + K + mixed_s X) (1 + x [S1/S2]) + step_s + seq_s B
               + page_s V + chunk_s C + gemm_s G + row_s R

where M, P and A are the step's memory, prefill-token (dense and scan) and attention-pair
seconds under the starting profile (serving_core.executor.simulated.AdditiveStepModel), K the
compressed-KV codec seconds at the profile's per-element constants (0 for bf16; a fixed term), X
marks a step mixing prefill and decode, B is the number of scheduled sequences and x the
paged organizations' indirection, V the KV pages the decode sequences' attention visits
(AdditiveStepModel.kv_pages: the organization's block size decides how many) and C the
prefill chunks: a real executor that attends page by page and runs a forward per chunk
(serving_core.executor.torch_executor) pays per page and per chunk, so those counts, not
only tokens, set a step's time. G counts the passes over the LM head's weight and R its
rows (AdditiveStepModel.logit_counts: one product per step over the num_sampling items that
sample, padded to a multiple of logit_block_rows; bench/logits_bench.py measures that form;
a ledger without num_sampling keeps the earlier per-forward counts, ledger_logit_counts).
Where no step samples more than one block of rows, R is logit_block_rows x G and row_s
cannot be told from gemm_s: `omit=` holds such terms at 0. The scales t_m, t_p,
t_a divide the starting profile's efficiencies (dense and scan share t_p: both grow with
prefill tokens alone, so the data cannot tell them apart); they are bounded so every
efficiency stays in (0, 1], and the seconds terms and x are bounded at 0. Rows of several
organizations fit one profile. `predict_steps` gives a profile's durations of a steps
table by the same equation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from serving_core.executor.profiles import DeviceProfile, load_device_profile
from serving_core.executor.simulated import AdditiveStepModel
from serving_core.geometry import Geometry

STEP_COLUMNS = ("num_scheduled", "num_decode_seqs", "decode_context_tokens",
                "prefill_tokens_initial", "prefill_tokens_resume", "decode_tokens",
                "prefill_attention_pairs", "checkpoint_writes", "num_sampling", "duration_s")
PARAMETERS = ("memory_scale", "prefill_scale", "attention_scale", "mixed_step_s",
              "per_step_overhead_s", "per_seq_overhead_s", "indirection_overhead", "kv_page_s",
              "prefill_chunk_s", "logit_gemm_s", "logit_row_s")
# Parameters `omit=` may hold at 0 (the scales divide efficiencies: they have no zero).
OMITTABLE = PARAMETERS[3:]


@dataclass(frozen=True)
class StepFit:
    """A fitted profile with its parameters, residuals and the data it came from."""

    profile: DeviceProfile
    parameters: dict
    rows: int
    rms_rel_error: float
    total_rel_error: dict  # per org: (sum of fitted - sum of measured) / sum of measured
    data: dict


def design(model: AdditiveStepModel, steps: Mapping[str, Sequence]) -> dict[str, np.ndarray]:
    """Per-row feature columns of a steps table under `model`'s starting profile."""
    f = model.ledger_features(steps)
    return {
        "memory": f["memory"] * model._inv_mem,
        "prefill": f["dense"] * model._inv_mm + f["scan"],
        "attention": f["attention"],
        "codec": f["codec"],
        "mixed": f["mixed"],
        "seqs": np.asarray(steps["num_scheduled"], dtype=np.float64),
        "pages": f["kv_pages"],
        "chunks": f["prefill_chunks"],
        "passes": f["logit_passes"],
        "rows": f["logit_rows"],
        "duration": np.asarray(steps.get("duration_s", np.zeros(len(f["mixed"]))),
                               dtype=np.float64),
    }


def _predict(theta: np.ndarray, f: Mapping[str, np.ndarray], paged: np.ndarray) -> np.ndarray:
    t_m, t_p, t_a, mixed, step_s, seq_s, x, page_s, chunk_s, gemm_s, row_s = theta
    device = (t_m * f["memory"] + t_p * f["prefill"] + t_a * f["attention"] + f["codec"]
              + mixed * f["mixed"])
    return (device * (1.0 + x * paged) + step_s + seq_s * f["seqs"] + page_s * f["pages"]
            + chunk_s * f["chunks"] + gemm_s * f["passes"] + row_s * f["rows"])


def predict_steps(geometry: Geometry, profile: DeviceProfile | str, org: str,
                  steps: Mapping[str, Sequence]) -> np.ndarray:
    """Durations of the rows of a steps table under an additive `profile` (the fitted
    equation above; its paged-state gathers, state_page_s and conv_slot_s, per scheduled
    sequence). Where the table holds what the simulator ran (no KV page term), it returns
    the simulated durations."""
    model = AdditiveStepModel(geometry, replace(load_device_profile(profile),
                                                step_model="additive"), org)
    dev = model.device
    f = design(model, steps)
    theta = np.array([1.0, 1.0, 1.0, dev.mixed_step_s,
                      dev.per_step_overhead_s, dev.per_seq_overhead_s + model.paged_s_per_seq,
                      model.indirection, dev.kv_page_s, dev.prefill_chunk_s, dev.logit_gemm_s,
                      dev.logit_row_s])
    return _predict(theta, f, np.ones_like(f["seqs"]))


def fit_steps(geometry: Geometry, start: DeviceProfile | str,
              runs: Sequence[tuple[str, Mapping[str, Sequence]]], *, name: str | None = None,
              source: str = "steps ledgers",
              omit: Sequence[str] = ("logit_row_s",)) -> StepFit:
    """Fit one additive profile to the steps of `runs`, a list of (org, steps table);
    the parameters named in `omit` (of OMITTABLE) are held at 0 (by default logit_row_s,
    which no steps ledger tells apart from per_seq_overhead_s)."""
    from scipy.optimize import least_squares

    bad = sorted(set(omit) - set(OMITTABLE))
    if bad:
        raise ValueError(f"fit_steps: omit={bad}: allowed values are {', '.join(OMITTABLE)}")
    prior = replace(load_device_profile(start), step_model="additive", indirection_overhead=0.0,
                    mixed_step_s=0.0, kv_page_s=0.0, prefill_chunk_s=0.0, state_page_s=0.0,
                    conv_slot_s=0.0, logit_gemm_s=0.0, logit_row_s=0.0)
    if not runs:
        raise ValueError("fit_steps: no runs to fit")
    cols: dict[str, list] = {}
    paged, orgs = [], []
    for org, steps in runs:
        model = AdditiveStepModel(geometry, prior, org)
        f = design(model, steps)
        for key, value in f.items():
            cols.setdefault(key, []).append(value)
        n = len(f["duration"])
        paged.append(np.full(n, float(model.indirect)))
        orgs.extend([model.org] * n)
    f = {k: np.concatenate(v) for k, v in cols.items()}
    paged_arr = np.concatenate(paged)
    y = f["duration"]
    free = np.array([p not in omit for p in PARAMETERS])
    if len(y) < int(free.sum()):
        raise ValueError(f"fit_steps: {len(y)} steps cannot identify {int(free.sum())} "
                         "parameters")
    # Scales divide efficiencies: eff / t <= 1 needs t >= eff.
    lower = np.array([prior.memory_efficiency,
                      max(prior.matmul_efficiency, prior.scan_efficiency),
                      prior.attention_efficiency, *[0.0] * len(OMITTABLE)])
    x0 = np.maximum(lower, [1.0, 1.0, 1.0, 0.0, prior.per_step_overhead_s,
                            prior.per_seq_overhead_s, *[0.0] * (len(OMITTABLE) - 3)])
    # Columns differ by orders of magnitude: scale by each parameter's typical contribution.
    typical = np.array([f["memory"].mean(), f["prefill"].mean(), f["attention"].mean(),
                        f["mixed"].mean(), 1.0, f["seqs"].mean(), 0.1 * y.mean(),
                        f["pages"].mean(), f["chunks"].mean(), f["passes"].mean(),
                        f["rows"].mean()])
    x_scale = np.where(typical > 0, y.mean() / np.maximum(typical, 1e-300), 1.0)

    def full(th_free: np.ndarray) -> np.ndarray:
        theta = np.zeros(len(PARAMETERS))
        theta[free] = th_free
        return theta

    res = least_squares(lambda th: _predict(full(th), f, paged_arr) - y, x0[free],
                        bounds=(lower[free], np.full(int(free.sum()), np.inf)),
                        x_scale=x_scale[free], method="trf", xtol=1e-12, ftol=1e-12,
                        gtol=1e-12, max_nfev=2000)
    theta = full(res.x)
    pred = _predict(theta, f, paged_arr)
    rel = (pred - y) / np.maximum(y, 1e-12)
    org_arr = np.array(orgs)
    totals = {str(org): float(pred[org_arr == org].sum() / y[org_arr == org].sum() - 1.0)
              for org in sorted(set(orgs))}
    params = dict(zip(PARAMETERS, (float(v) for v in theta), strict=True))
    digest = hashlib.sha256(np.round(theta, 12).tobytes()).hexdigest()[:8]
    profile = replace(
        prior,
        name=name or f"{prior.name}-fit-{digest}",
        memory_efficiency=float(min(1.0, prior.memory_efficiency / theta[0])),
        matmul_efficiency=float(min(1.0, prior.matmul_efficiency / theta[1])),
        scan_efficiency=float(min(1.0, prior.scan_efficiency / theta[1])),
        attention_efficiency=float(min(1.0, prior.attention_efficiency / theta[2])),
        mixed_step_s=params["mixed_step_s"],
        per_step_overhead_s=params["per_step_overhead_s"],
        per_seq_overhead_s=params["per_seq_overhead_s"],
        indirection_overhead=params["indirection_overhead"],
        kv_page_s=params["kv_page_s"],
        prefill_chunk_s=params["prefill_chunk_s"],
        logit_gemm_s=params["logit_gemm_s"],
        logit_row_s=params["logit_row_s"],
        calibration=f"fitted to {len(y)} steps of {len(runs)} runs ({source})"
        + (f"; held at 0: {', '.join(omit)}" if omit else ""),
    )
    return StepFit(profile=profile, parameters=params, rows=len(y),
                   rms_rel_error=float(np.sqrt(np.mean(rel ** 2))), total_rel_error=totals,
                   data={"runs": len(runs), "source": source, "start": prior.name,
                         "omit": list(omit)})


@dataclass(frozen=True)
class CodecFit:
    """TQ4 codec seconds per K/V element fitted to compressed-KV steps over a fixed profile."""

    kv_decode_s_per_element: float
    kv_encode_s_per_element: float
    rows: int
    rms_rel_error_before: float  # the profile's prediction with no codec term
    rms_rel_error: float  # with the fitted codec term
    codec_share: float  # fitted codec seconds / measured seconds, summed over the steps


def fit_codec(geometry: Geometry, profile: DeviceProfile | str,
              runs: Sequence[tuple[str, Mapping[str, Sequence]]]) -> CodecFit:
    """Fit the two codec constants to the steps of compressed-KV `runs` (org, steps table).

    Every other constant stays `profile`'s (fitted beforehand to the same engine's bf16
    steps): each row's residual duration - (the profile's prediction without the codec) is
    a D + b N, times the row's indirection factor, with D the K/V elements the decode
    sequences read ((c + 1) tokens each) and N those every new token writes, E = 2 Hkv d L
    elements per token (AdditiveStepModel's codec term); a, b >= 0 by non-negative least
    squares on relative errors (each row weighted by 1 / duration)."""
    from scipy.optimize import nnls

    if geometry.kv_codec == "bf16":
        raise ValueError("fit_codec: the geometry stores bf16 KV (no codec term to fit)")
    base = replace(load_device_profile(profile), step_model="additive")
    unit = {"decode": replace(base, kv_decode_s_per_element=1.0, kv_encode_s_per_element=0.0),
            "encode": replace(base, kv_decode_s_per_element=0.0, kv_encode_s_per_element=1.0)}
    cols: dict[str, list] = {}
    for org, steps in runs:
        model = AdditiveStepModel(geometry, base, org)
        f = design(model, steps)
        x = base.indirection_overhead if model.indirect else 0.0
        theta = np.array([1.0, 1.0, 1.0, base.mixed_step_s, base.per_step_overhead_s,
                          base.per_seq_overhead_s, x, base.kv_page_s, base.prefill_chunk_s,
                          base.logit_gemm_s, base.logit_row_s])
        no_codec = dict(f, codec=np.zeros_like(f["duration"]))
        cols.setdefault("pred", []).append(_predict(theta, no_codec, np.ones_like(f["seqs"])))
        cols.setdefault("y", []).append(f["duration"])
        for kind, prof in unit.items():
            elems = AdditiveStepModel(geometry, prof, org).ledger_features(steps)["codec"]
            cols.setdefault(kind, []).append(elems * (1.0 + x))
    c = {k: np.concatenate(v) for k, v in cols.items()}
    if not len(c["y"]):
        raise ValueError("fit_codec: no steps to fit")
    w = 1.0 / np.maximum(c["y"], 1e-12)
    a = np.stack([c["decode"] * w, c["encode"] * w], axis=1)
    (dec, enc), _ = nnls(a, (c["y"] - c["pred"]) * w)
    fitted = c["pred"] + dec * c["decode"] + enc * c["encode"]
    return CodecFit(
        kv_decode_s_per_element=float(dec), kv_encode_s_per_element=float(enc),
        rows=len(c["y"]),
        rms_rel_error_before=float(np.sqrt(np.mean(((c["pred"] - c["y"]) * w) ** 2))),
        rms_rel_error=float(np.sqrt(np.mean(((fitted - c["y"]) * w) ** 2))),
        codec_share=float((dec * c["decode"] + enc * c["encode"]).sum() / c["y"].sum()),
    )


__all__ = ["OMITTABLE", "PARAMETERS", "STEP_COLUMNS", "CodecFit", "StepFit", "design",
           "fit_codec", "fit_steps", "predict_steps"]
