"""Fit the TQ4 codec's step-model constants to real tiny-model steps (CPU).

`python -m experiments.studies.codec_fit --checkpoint DIR [--orgs d0,s2] [--requests 12]`:
the same synthetic workload (all requests at t = 0, greedy) served by the in-process torch
engine twice per organization, with bf16 KV (model falcon_h1_tiny) and with TQ4
(falcon_h1_tiny_tq4). The CPU profile's constants are fitted to the bf16 steps
(fit_steps); with them fixed, the codec's seconds per K/V element decoded and encoded are
fitted to the TQ4 steps (fit_codec). Prints both with their residuals; the last line is
JSON. Nothing is written: the constants are a CPU reading of the torch reference codec, not
the A100's (see conf/executor/cpu.yaml and serving_core/executor/profiles.py).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from hydra import compose, initialize_config_dir

from experiments.config.bad_input import EXIT_BAD_INPUT
from experiments.runners.spec import engine_spec
from experiments.studies import study_parser
from experiments.workloads.workload import RequestSpec
from ledgers.arms import ARMS
from serving_core.builder import build_engine
from serving_core.engine import serve
from serving_core.executor.fit_steps import fit_codec, fit_steps
from serving_core.geometry import MODEL_CONF_DIR, load_geometry

CONF_DIR = str(MODEL_CONF_DIR.parent)


def _specs(n: int, seed: int) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(300, 2500, n)
    return [RequestSpec(i, 0.0, rng.integers(1, 128_000, int(m)).astype(np.int32), 24, -1, "")
            for i, m in enumerate(lengths)]


def _steps(model, checkpoint: str, preset: str, org: str, specs) -> dict:
    with initialize_config_dir(version_base="1.3", config_dir=CONF_DIR):
        cfg = compose(config_name="config", overrides=[
            f"model={preset}", f"org={org}", "budget=b63", "executor=torch_inproc",
            f"executor.checkpoint={checkpoint}", "engine.cap=8"])
    engine = build_engine(engine_spec(cfg), model=model)
    return serve(engine, specs).tables["steps"]


def main(argv: list[str] | None = None) -> int:
    p = study_parser("codec_fit", __doc__, ledgers=False)
    p.add_argument("--checkpoint", required=True, help="tiny checkpoint (make tiny-model)")
    p.add_argument("--orgs", default="d0,s2")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    orgs = [o.strip() for o in args.orgs.split(",") if o.strip()]
    allowed = [a.name for a in ARMS.values() if not a.retention]
    if not orgs or any(o not in allowed for o in orgs):
        print(f"error: --orgs={args.orgs!r}: allowed values are {', '.join(allowed)}",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    import torch

    from serving_core.model.falcon_h1 import FalconH1

    torch.set_num_threads(1)
    model = FalconH1.load(args.checkpoint)
    specs = _specs(args.requests, args.seed)
    steps = {}
    for preset in ("falcon_h1_tiny", "falcon_h1_tiny_tq4"):
        for org in orgs:
            t = time.perf_counter()
            steps[preset, org] = _steps(model, args.checkpoint, preset, org, specs)
            print(f"{preset} {org}: {len(steps[preset, org]['duration_s'])} steps, "
                  f"{time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    base = fit_steps(load_geometry("falcon_h1_tiny"), "cpu",
                     [(o, steps["falcon_h1_tiny", o]) for o in orgs], source="codec_fit bf16")
    codec = fit_codec(load_geometry("falcon_h1_tiny_tq4"), base.profile,
                      [(o, steps["falcon_h1_tiny_tq4", o]) for o in orgs])
    out = {"bf16_rows": base.rows, "bf16_rms_rel_error": round(base.rms_rel_error, 4),
           "tq4_rows": codec.rows,
           "kv_decode_s_per_element": codec.kv_decode_s_per_element,
           "kv_encode_s_per_element": codec.kv_encode_s_per_element,
           "tq4_rms_rel_error_without_codec": round(codec.rms_rel_error_before, 4),
           "tq4_rms_rel_error": round(codec.rms_rel_error, 4),
           "codec_share": round(codec.codec_share, 4)}
    print(f"bf16 profile: {base.rows} steps, rms relative error {base.rms_rel_error:.3f}")
    print(f"tq4 codec: decode {codec.kv_decode_s_per_element:.3g} s/element, encode "
          f"{codec.kv_encode_s_per_element:.3g} s/element over {codec.rows} steps; rms "
          f"relative error {codec.rms_rel_error_before:.3f} without the codec term, "
          f"{codec.rms_rel_error:.3f} with it; codec {codec.codec_share:.1%} of step time")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
