"""Run by the vLLM venv's interpreter: vLLM's own hybrid block size for given geometries.

Reads a JSON list of cases {"geometry": {...}, "backend": "flash_attn" | "cpu",
"block_size": default cache block} from argv[1] and prints one JSON list of
{"block_size", "mamba_block_size", "mamba_page_size_padded", "version"}. It calls
`Platform._align_hybrid_block_size` (vLLM 0.32, platforms/interface.py) with minimal
stand-ins for the configs it reads and a Mamba2 model class (Falcon-H1's state-shape
calculator), so no model, weights or device is needed. Internal API: pinned version only.
"""

import contextlib
import json
import sys
from types import SimpleNamespace

import torch
import vllm
import vllm.config.vllm as vllm_config_module
import vllm.model_executor.models.registry as registry
from vllm.model_executor.models.falcon_h1 import FalconH1ForCausalLM
from vllm.platforms.interface import Platform
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

BACKENDS = {"flash_attn": FlashAttentionBackend, "cpu": CPUAttentionBackend}


def align(geometry: dict, backend_name: str, block_size: int) -> dict:
    backend = BACKENDS[backend_name]
    hf_config = SimpleNamespace(
        mamba_expand=None, hidden_size=geometry["hidden_size"],
        mamba_d_ssm=geometry["mamba_heads"] * geometry["mamba_head_dim"],
        mamba_n_groups=geometry["n_groups"], mamba_n_heads=geometry["mamba_heads"],
        mamba_d_head=geometry["mamba_head_dim"], mamba_d_state=geometry["d_state"],
        mamba_d_conv=geometry["d_conv"],
    )
    dtype = {2: torch.bfloat16, 4: torch.float32}[geometry["dtype_bytes"]]
    model_config = SimpleNamespace(
        use_mla=False, dtype=dtype, hf_config=hf_config, architecture="FalconH1ForCausalLM",
        get_num_kv_heads=lambda _: geometry["num_kv_heads"],
        get_head_size=lambda: geometry["head_dim"],
    )
    cache_config = SimpleNamespace(
        cache_dtype="auto", block_size=block_size, mamba_cache_mode="align",
        mamba_page_size_padded=None, mamba_block_size=None, mamba_cache_dtype="auto",
        mamba_ssm_cache_dtype="auto",
    )
    config = SimpleNamespace(
        cache_config=cache_config, model_config=model_config,
        parallel_config=SimpleNamespace(tensor_parallel_size=1), num_speculative_tokens=0,
    )
    Platform._align_hybrid_block_size(config, backend)
    return {
        "block_size": cache_config.block_size,
        "mamba_block_size": cache_config.mamba_block_size,
        "mamba_page_size_padded": cache_config.mamba_page_size_padded,
        "version": vllm.__version__,
    }


def main() -> None:
    # Stand-ins for what needs a built model: the attention layers' backends, the
    # current-config context and the architecture lookup.
    cases = json.loads(sys.argv[1])
    vllm_config_module.set_current_vllm_config = lambda _: contextlib.nullcontext()
    registry.ModelRegistry.resolve_model_cls = (
        lambda *_, **__: (FalconH1ForCausalLM, "FalconH1ForCausalLM")
    )
    results = []
    for case in cases:
        backend = BACKENDS[case["backend"]]
        Platform._find_non_ssm_backends = classmethod(lambda cls, _, b=backend: [b])
        results.append(align(case["geometry"], case["backend"], case["block_size"]))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
