"""The torch executor under every checkpoint placement: the same greedy tokens as transformers
while requests adopt each other's checkpoints, are preempted and resume, and prefill in
chunks that do not align with the grid (the tiny Falcon-H1 and Granite-4.0-H-style models).

Checkpoint positions are the scheduler's (serving_core/placement.py): the executor keeps the
state at every boundary inside a chunk and writes those published, so a placement changes
only which states exist. The matrix is slow; by default, one cheap case: align's prefill
checkpoint (inside the prompt's one chunk) adopted by a second request."""

from __future__ import annotations

import engines
import pytest
from test_engine_rules import ConstantStep

from serving_core.geometry import load_geometry
from serving_core.model.granite_moe_hybrid import GraniteMoeHybrid
from serving_core.model.make_tiny import build
from serving_core.planner import plan_budget, units_for
from serving_core.scheduler import SchedulerConfig

OUTPUT_TOKENS = 40  # 980 + 20 + 40 crosses 1,024: decodes need a block, and some preempt
# a shared 980-token document and four questions: r0-r2 at once on a budget that preempts
# (first-chunk admission), r3 after they finished (it adopts what is left)
PROMPTS = engines.prompt_set(2044, 980, (8, 12, 16, 20))
ARRIVALS = (0.0, 0.0, 0.0, 1e4)
CHUNK = 300  # prefill chunks of 300 tokens: the boundary 512 falls inside one
PLACEMENTS = ("align", "all", "junction", "periodic:2", "optimal")
MODELS = {"falcon_h1_tiny": "FalconH1ForCausalLM", "granite_hybrid_tiny":
          "GraniteMoeHybridForCausalLM"}
BUDGET = {"falcon_h1_tiny": "p13", "granite_hybrid_tiny": "p10"}  # each preempts here
DEFAULT: set = set()  # the matrix is slow; the cheap default case is the last test


@pytest.fixture(scope="module")
def granite_checkpoint(tmp_path_factory):
    return build(tmp_path_factory.mktemp("granite_placement"), "granite_hybrid_tiny", seed=1)


@pytest.fixture(scope="module")
def served(request, tiny_model, tiny_checkpoint, granite_checkpoint):
    """preset -> (loaded model, transformers' greedy tokens for PROMPTS)."""
    out = {}

    def get(preset):
        if preset not in out:
            ckpt = tiny_checkpoint if preset == "falcon_h1_tiny" else granite_checkpoint
            model = tiny_model if preset == "falcon_h1_tiny" else GraniteMoeHybrid.load(ckpt)
            ref = engines.transformers_generate(MODELS[preset], ckpt, PROMPTS, OUTPUT_TOKENS)[0]
            out[preset] = (model, ref)
        return out[preset]

    return get


CASES = [pytest.param(preset, placement, id=f"{preset}-{placement}",
                      marks=() if (preset, placement) in DEFAULT else (pytest.mark.slow,))
         for preset in MODELS for placement in PLACEMENTS]


@pytest.mark.parametrize("preset, placement", CASES)
def test_greedy_tokens_equal_transformers_under_each_placement(served, preset, placement):
    """Every request's tokens are transformers'; the torch engine makes the simulated
    engine's decisions (adopted prefixes, preemptions) under the placement."""
    model, reference = served(preset)
    specs = [engines.Spec(i, a, PROMPTS[i], OUTPUT_TOKENS) for i, a in enumerate(ARRIVALS)]
    rules = {"admission": "first_chunk", "checkpoint_placement": placement}
    result, produced = engines.serve_greedy(model, preset, "S2", BUDGET[preset], specs,
                                            max_tokens=CHUNK, **rules)
    geometry = load_geometry(preset)
    simulated = engines.run_simulated(
        geometry, "S2", units_for(plan_budget(geometry, BUDGET[preset]), "S2"),
        SchedulerConfig(cap=4, max_num_batched_tokens=CHUNK, **rules), specs, ConstantStep())
    requests = result.tables["requests"]
    assert result.summary["preemptions"] >= 1
    assert max(result.tables["steps"]["prefill_tokens_initial"]) == CHUNK
    for column in ("adopted_prefix_tokens", "preemptions"):
        assert requests[column] == simulated.tables["requests"][column], column
    for i in range(len(specs)):
        assert produced[i] == reference[i], f"request {i}"


SHORT = engines.prompt_set(2045, 520, (8, 12))  # one chunk each; align publishes 512 inside


@pytest.fixture(scope="module")
def short_reference(tiny_checkpoint):
    return engines.transformers_generate(MODELS["falcon_h1_tiny"], tiny_checkpoint, SHORT, 4)[0]


def test_align_prefill_checkpoint_is_adopted_exactly(tiny_model, short_reference):
    """Falcon-H1 tiny, S2, align: the first prompt (528 tokens, one chunk) publishes the state
    at 512 inside its chunk (vLLM's prefill checkpoint); the second adopts it and computes
    16 tokens; both continue as transformers does."""
    specs = [engines.Spec(i, a, SHORT[i], 4) for i, a in enumerate((0.0, 1e4))]
    result, produced = engines.serve_greedy(tiny_model, "falcon_h1_tiny", "S2", "b12", specs,
                                            checkpoint_placement="align")
    assert result.tables["requests"]["adopted_prefix_tokens"] == [0, 512]
    assert [produced[0], produced[1]] == short_reference
