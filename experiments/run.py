"""Single-run entry point: `python -m experiments.run org=s2 budget=b63 seed=42000`.

Prints a short human summary and, as its last line, one JSON object.
"""

from __future__ import annotations

import json
import math
import sys

import hydra
from omegaconf import DictConfig

from experiments.cell import format_summary, run_cell


def _json_safe(summary: dict) -> dict:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in summary.items()}


def main_run(cfg: DictConfig) -> dict:
    result = run_cell(cfg)
    print(format_summary(result.summary))
    print(json.dumps(_json_safe(result.summary)), flush=True)
    return result.summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        main_run(cfg)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
