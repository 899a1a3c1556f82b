"""The device check's page: `python -m analysis.device RESULTS.json [--out reports/device.md]`.

Reads the JSON `python -m bench.device_check` writes (not a ledger: the check runs where
no ledger root travels) and states the device, its driver and torch version, then every
number the check measured: exactness per organization, the steps table with the fitted
and the datasheet predictions, the fitted profile and its residuals, paged versus
contiguous recurrent state per decode batch, and the real cell beside its simulation.
A stage that stopped at its time limit or failed is named with what it left.
Bad input: one line naming the argument, exit 2, nothing written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _ms(value) -> str:
    return "" if value is None else f"{1000 * float(value):.2f}"


def _num(value, digits: int = 3) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{float(value):.{digits}g}"


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out + [""]


def _status(stage: dict | None) -> str:
    if stage is None:
        return "not run"
    if "error" in stage:
        return f"failed: {stage['error']}"
    if stage.get("complete") is False:
        return f"partial: {stage.get('stopped')}"
    return "complete"


def _device(data: dict) -> list[str]:
    d = data.get("device", {})
    rows = [["device", d.get("device")], ["name", d.get("name")],
            ["driver", d.get("driver") or "n/a"], ["torch", d.get("torch")],
            ["CUDA runtime", d.get("cuda_runtime") or "n/a"],
            ["compute capability", d.get("capability", "n/a")],
            ["multiprocessors", d.get("multiprocessors", "n/a")],
            ["device memory (GiB)", _num(d["memory_bytes"] / 2**30) if d.get("memory_bytes")
             else "n/a"],
            ["python", d.get("python")], ["host", d.get("host")],
            ["plan", data.get("plan", {}).get("name")],
            ["CPU smoke", "yes" if data.get("cpu_smoke") else "no"],
            ["started (UTC)", data.get("started_utc")],
            ["total seconds", _num(data.get("total_s"))]]
    return _table(["", ""], rows)


def _stages(data: dict) -> list[str]:
    stages = data.get("stages", {})
    limits = data.get("plan", {}).get("limits_s", {})
    rows = [[name, _num(stages.get(name, {}).get("seconds")), limits.get(name, ""),
             _status(stages.get(name))]
            for name in ("exactness", "build", "steps", "paged", "fit", "cell")]
    return _table(["stage", "seconds", "limit (s)", "status"], rows)


def _exactness(stage: dict) -> list[str]:
    out = [f"Reference: {stage.get('reference')} "
           f"(transformers {stage.get('transformers') or 'absent: our contiguous path'}); "
           f"prompts of {stage.get('prompt_tokens')} tokens, {stage.get('output_tokens')} greedy "
           f"tokens each; our contiguous path equal to the reference: "
           f"{_num(stage.get('contiguous_equal'))}.", ""]
    rows = [[org, _num(v["equal"]), v.get("first_mismatch") or "", v.get("adopted_prefix_tokens"),
             v.get("decode_attention"), _num(v.get("seconds"))]
            for org, v in stage.get("orgs", {}).items()]
    return out + _table(["org", "tokens equal", "first mismatch (request, token)",
                         "adopted prefix tokens", "decode attention", "seconds"], rows)


def _steps(data: dict) -> list[str]:
    fit = data["stages"].get("fit", {})
    if "table" in fit:
        rows = [[r["org"], r["kind"], r["batch"], r["context"], r["prefill_tokens"],
                 _ms(r["measured_s"]), _ms(r["fitted_s"]), _num(r["fitted_rel_error"], 2),
                 _ms(r["datasheet_s"]), _num(r["datasheet_rel_error"], 2)]
                for r in fit["table"]]
        return _table(["org", "kind", "decode batch", "decode context", "prefill tokens",
                       "measured ms", "fitted ms", "fitted rel. error", "h200 datasheet ms",
                       "datasheet rel. error"], rows)
    steps = data["stages"].get("steps", {})
    rows = [[r["org"], r["kind"], r["num_decode_seqs"], r["decode_context_tokens"],
             r["prefill_tokens_initial"], _ms(r["duration_s"])] for r in steps.get("rows", [])]
    return _table(["org", "kind", "decode batch", "decode context tokens (sum)",
                   "prefill tokens", "measured ms"], rows)


def _syncs(data: dict) -> list[str]:
    audit = data["stages"].get("steps", {}).get("sync_audit", {})
    if not audit:
        return []
    rows = [[org, v.get("syncs") if v.get("syncs") is not None else "n/a",
             v.get("batch", ""), v.get("context", ""),
             "; ".join(v.get("messages", [])) or v.get("note", "")] for org, v in audit.items()]
    return ["Host synchronisations in one decode step (torch's CUDA sync debug mode; the "
            "sampler's read of the tokens is the one expected):", ""] + _table(
        ["org", "syncs", "batch", "context", "messages"], rows)


def _fit(stage: dict) -> list[str]:
    out = [f"Started from `{stage.get('start')}`; {stage.get('rows')} steps; RMS relative error "
           f"{_num(stage.get('rms_rel_error'))} (the `h200` datasheet profile on the same "
           f"steps: {_num(stage.get('datasheet_rms_rel_error'))}).", ""]
    out += _table(["parameter", "value"],
                  [[k, _num(v, 4)] for k, v in stage.get("parameters", {}).items()])
    out += _table(["org", "total relative error (sum fitted / sum measured - 1)"],
                  [[k, _num(v, 3)] for k, v in stage.get("total_rel_error", {}).items()])
    profile = stage.get("profile", {})
    keys = ("name", "memory_efficiency", "matmul_efficiency", "attention_efficiency",
            "scan_efficiency", "per_step_overhead_s", "per_seq_overhead_s", "mixed_step_s",
            "indirection_overhead", "calibration")
    out += ["Fitted profile (device_profile.yaml beside the JSON):", ""]
    return out + _table(["field", "value"], [[k, profile.get(k)] for k in keys if k in profile])


def _paged(stage: dict) -> list[str]:
    rows = [[r["org"], r["batch"], r["context"], _ms(r["paged_s"]), _ms(r["contiguous_s"]),
             _num(r["ratio"], 3), _num(r.get("ssm_in_place"))] for r in stage.get("rows", [])]
    return _table(["org", "batch", "context", "paged ms", "contiguous ms", "ratio",
                   "SSM updated in place"], rows)


def _cell(stage: dict) -> list[str]:
    out = [f"{stage.get('requests')} requests, budget {stage.get('budget')}, cap "
           f"{stage.get('cap')}; arrivals at {_num(stage.get('rate_rps'))} requests/s = "
           f"{stage.get('load')} x the capacity the {stage.get('profile')} profile predicts "
           f"({', '.join(f'{k} {_num(v)}' for k, v in stage.get('capacity_rps', {}).items())} "
           f"requests/s{'; raised to the span floor' if stage.get('rate_floor_applied') else ''}"
           f"); mean prompt {_num(stage.get('prompt_tokens_mean'))} tokens, mean "
           f"output {_num(stage.get('output_tokens_mean'))} tokens.", ""]
    rows = []
    for org, v in stage.get("orgs", {}).items():
        for metric in ("throughput_ledger", "c_once_tokens", "ttft_p99", "ttft_p50",
                       "completed", "preemptions", "engine_steps", "prefix_hit_tokens"):
            real, sim = v["real"].get(metric), v["simulated"].get(metric)
            ratio = sim / real if real else None
            rows.append([org, metric, _num(real, 4), _num(sim, 4), _num(ratio, 3)])
    out += _table(["org", "metric", "real", "simulated (fitted)", "simulated / real"], rows)
    rules = [[org, v["rules"].get("device"), v["rules"].get("dtype"),
              v["rules"].get("decode_attention"), v["rules"].get("clock"),
              v["rules"].get("pool_units")] for org, v in stage.get("orgs", {}).items()]
    return out + ["Effective rules of the real runs (read back from the engine):", ""] + _table(
        ["org", "device", "dtype", "decode attention", "clock", "pool units"], rules)


def render(data: dict) -> str:
    stages = data.get("stages", {})
    lines = ["# Device check", "",
             "Written by `python -m analysis.device` from the JSON of `python -m "
             "bench.device_check` (bench/device_check/).", "", "## Device", ""]
    lines += _device(data)
    lines += ["## Stages", ""] + _stages(data)
    sections = (("exactness", "1. Exactness: greedy tokens against the reference", _exactness),
                ("fit", "3. Fitted device profile", _fit),
                ("paged", "2b. Paged versus contiguous recurrent state (decode)", _paged),
                ("cell", "4. Real cell beside the simulated cell", _cell))
    for key, title, fn in sections:
        stage = stages.get(key)
        if key == "fit":
            build = stages.get("build", {})
            lines += ["## 2. Steps of the timing geometry", "",
                      f"Model {build.get('model')} ({_num(build.get('parameters'))} random "
                      f"parameters, {build.get('dtype')}, built on the device in "
                      f"{_num(build.get('build_s'))} s).", ""]
            ceil = build.get("ceilings")
            if ceil:
                lines += [f"Measured ceilings: bf16 {ceil['matmul_n']}^3 matrix product "
                          f"{_num(ceil['bf16_flops'] / 1e12)} TFLOP/s, device copy of "
                          f"{_num(ceil['copy_bytes'] / 2**30)} GiB "
                          f"{_num(ceil['copy_bytes_per_s'] / 1e12)} TB/s (read + written; "
                          "medians of 10 after 3 warm-ups).", ""]
            lines += _steps(data) if "steps" in stages else ["Not measured.", ""]
            lines += _syncs(data)
        lines += [f"## {title}", ""]
        if stage is None or ("error" in stage and len(stage) <= 4):
            lines += [_status(stage) + ".", ""]
            continue
        if "error" in stage or stage.get("complete") is False:
            lines += [f"Stage {_status(stage)}.", ""]
        lines += fn(stage)
    imports = data.get("imports", {})
    lines += ["## Imports of the real path", "",
              "Packages the check had loaded when it finished: "
              + ", ".join(k for k, v in imports.items() if v) + "; not loaded: "
              + ", ".join(k for k, v in imports.items() if not v) + ".", ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.device",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("results", help="device_check.json written by bench.device_check")
    parser.add_argument("--out", default=None, help="page path (default: device.md beside it)")
    args = parser.parse_args(argv)
    path = Path(args.results)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        print(f"{parser.prog}: error: results={args.results!r}: not a readable JSON file "
              f"({type(err).__name__})", file=sys.stderr)
        return 2
    if not isinstance(data, dict) or data.get("check") != "bench.device_check":
        print(f"{parser.prog}: error: results={args.results!r}: not a bench.device_check "
              "result (its 'check' field must be 'bench.device_check')", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else path.with_name("device.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(data))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
