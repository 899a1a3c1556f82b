"""The device check's sizes and per-stage time limits: the H200 plan and the CPU smoke.

The H200 plan, from first principles (measured ceilings of that machine, as the device
notes record them: ~790 TFLOP/s dense bf16 and ~4.3 TB/s device-to-device copy):

- start: interpreter, torch import and CUDA context, ~30 s (outside the stages).
- exactness: the tiny checkpoint (17.7 M parameters) built with transformers on the device
  (seconds), transformers' greedy 2 x (prompt + 32 tokens) and our engine for S0/S1/S2/D0:
  a tiny model is launch-bound (~2 layers x 100 kernels a step), well under 60 s.
- the 7B geometry: 7.57 G random bf16 parameters drawn on the device (15.1 GB written at
  HBM speed: well under a second; allocator and generator setup a few seconds) and, per
  organization, an arena big enough for 64 sequences of 8,001 tokens (S0, the coarsest:
  64 x 17 pages of 1.59 MB x 44 layers ~ 76 GB; S1/S2 ~ 30 GB) filled with random values.
  A decode step at batch 64 and 8k context reads the weights (15.1 GB: 3.5 ms), the KV
  (64 x 8,000 x 45 KiB = 23.6 GB: 5.5 ms, twice more for the gathered copy) and the
  recurrent state (64 x 66 MB in and out in fp32: ~4 ms): ~25 ms of bandwidth, plus ~44 x
  60 launches (~20 ms) of host work: ~50 ms. A 2,048-token prefill chunk is 3.1e13 FLOP
  of projections (39 ms at the matrix rate) plus the scan and launches: ~0.2 s. The grid
  (4 orgs x 16 decode shapes + 6 prefill shapes, 2 warm-ups + 5 timed each) is ~7 x (64 x
  0.05 + 24 x 0.2) ~ 60 s of device work; limit 180 s. Paged vs contiguous recurrent state
  (4 orgs x 4 batches at 4k context, alternated, 2 x 6 steps each): ~10 s; limit 60 s.
- fit: scipy's bounded least squares on ~90 rows: seconds; limit 30 s.
- the cell: S1 and S2, 60 requests (~1.9k prompt, ~100 output tokens each) on a wall
  clock, arrivals at 0.7 of the capacity the fitted profile predicts: ~6k output tokens at
  batch ~20-40 (~40 ms a step) and ~110k prefill tokens (~55 chunks of 2,048, ~0.2 s
  each): ~20-30 s each, the arrival span at most 30 s; limit 170 s for both.
Sum of limits: 60 + 30 (build) + 180 + 60 + 30 + 170 = 530 s, with the start 560 s worst
case, ~4 minutes expected; a stage that reaches its limit stops, says so, and the stages
after it still run. The device command (DEVICE_COMMAND, below) wraps the check in `timeout
560` under the run tool's timeout_s 600, with nothing carried: the H200 image has every
package the real path imports (torch, numpy, safetensors, transformers, scipy, PyYAML,
pyarrow), and the tracked tree is a few MB. Its files come back from $OUT: the JSON, the
fitted profile, the page (written from the JSON even after a timeout), the log and
nvidia-smi's report.
"""

from __future__ import annotations

from dataclasses import dataclass

from serving_core.memory import ORG_TO_CLASS

# The organizations the check measures: every registered one but N0 (vLLM's native page,
# which vLLM's own arm serves) and JENGA (a literature arm whose whole-large-page pools the
# sized plan does not cover); today the paper's four, S0, S1, S2 and D0.
NOT_MEASURED = ("N0", "JENGA")
ORGS = tuple(org for org in ORG_TO_CLASS if org not in NOT_MEASURED)


DEVICE_TIMEOUT_S = 600  # the run tool's timeout_s
DEVICE_COMMAND = (
    "export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false; "
    "nvidia-smi > $OUT/nvidia_smi.txt 2>&1; "
    "timeout -k 10 560 python3 -m bench.device_check $OUT --device cuda 2>&1 "
    "| tee $OUT/device_check.log; "
    "python3 -m analysis.device $OUT/device_check.json --out $OUT/device.md; "
    "tail -c 9000 $OUT/device.md")


@dataclass(frozen=True)
class Plan:
    name: str
    model: str  # the timing geometry (conf/model/)
    exact_model: str  # the checkpoint checked against transformers
    exact_prompt: int  # shared-document tokens of the exactness prompts
    exact_suffixes: tuple[int, ...]
    exact_output: int
    exact_budget: str
    orgs: tuple[str, ...]
    prefill_chunks: tuple[int, ...]
    prefill_decodes: int  # decodes beside a prefill chunk in the mixed steps
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    paged_context: int  # context of the paged-vs-contiguous decode steps
    warmup: int
    repeats: int
    cell_orgs: tuple[str, ...]
    cell_requests: int
    cell_budget: str
    cell_cap: int
    cell_context_tokens: int  # shared context length (4 contexts, half the requests)
    cell_suffix: tuple[int, int]  # own prompt tokens, uniform range
    cell_output: tuple[int, int]  # output tokens, uniform range
    cell_load: float  # offered load as a fraction of the fitted profile's capacity
    cell_max_span_s: float  # arrivals span at most this (a rate floor, if the fit is slow)
    max_num_batched_tokens: int
    limits_s: dict  # per stage


H200 = Plan(
    name="h200", model="falcon_h1_7b_random", exact_model="falcon_h1_tiny",
    exact_prompt=1000, exact_suffixes=(10, 15), exact_output=32, exact_budget="b12",
    orgs=ORGS, prefill_chunks=(512, 1536, 2048), prefill_decodes=15,
    decode_batches=(1, 8, 32, 64), decode_contexts=(1000, 2000, 4000, 8000),
    paged_context=4000, warmup=2, repeats=5,
    cell_orgs=("S1", "S2"), cell_requests=60, cell_budget="b63", cell_cap=63,
    cell_context_tokens=1500, cell_suffix=(50, 800), cell_output=(32, 160), cell_load=0.7,
    cell_max_span_s=30.0,
    max_num_batched_tokens=2048,
    limits_s={"exactness": 60, "build": 30, "steps": 180, "paged": 60, "fit": 30,
              "cell": 170},
)

CPU_SMOKE = Plan(
    name="cpu-smoke", model="falcon_h1_tiny", exact_model="falcon_h1_tiny",
    exact_prompt=520, exact_suffixes=(5, 9), exact_output=4, exact_budget="b12",
    orgs=ORGS, prefill_chunks=(16, 40), prefill_decodes=2,
    decode_batches=(1, 2), decode_contexts=(100, 600), paged_context=100, warmup=1,
    repeats=1, cell_orgs=("S1", "S2"), cell_requests=5, cell_budget="b12", cell_cap=8,
    cell_context_tokens=520, cell_suffix=(5, 30), cell_output=(2, 5), cell_load=0.7,
    cell_max_span_s=3.0,
    max_num_batched_tokens=512,
    limits_s={"exactness": 60, "build": 30, "steps": 60, "paged": 30, "fit": 30,
              "cell": 60},
)
