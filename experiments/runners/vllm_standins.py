"""What stands in for a built vLLM model in the virtual-clock arm (runs in the vLLM venv only).

vLLM derives its KV cache from a built model: the attention layers name their backend,
every attention and Mamba layer reports its own KV cache spec, the workers report the
layouts their backends support, and the engine core sizes the cache from a profiled byte
count. The virtual arm (experiments/runners/vllm_virtual_worker.py) builds no model, so
this module does those few things the way vLLM's code does them, and nothing else; the
scheduler, KV cache manager, block pool and every config function are vLLM's own, unpatched.

Each function names the vLLM functions it mirrors; `MIRRORED` records a hash of their
source at the pinned version, and tests/test_vllm_virtual.py fails when an upgrade changes
one (read the new source, update the stand-in, then the hash).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from dataclasses import replace
from pathlib import Path

DEFINITIONS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)

# vLLM function -> sha256[:16] of its source (source_hash) at the pinned version (vllm 0.32.0).
MIRRORED = {
    # the attention-backend lookup walks the built model's attention layers
    "vllm.platforms.interface:Platform._find_non_ssm_backends": "f3b42ade2ede8f19",
    # per-layer specs: as the layers report them, through the GPU model runner
    "vllm.model_executor.layers.attention.attention:Attention.get_kv_cache_spec":
        "2b66919f6a191bc6",
    "vllm.model_executor.layers.mamba.abstract:MambaBase.get_kv_cache_spec": "d91e0862ffbd989a",
    "vllm.model_executor.layers.mamba.mamba_mixer2:MambaMixer2.get_kv_cache_spec":
        "a9b61d12d214da15",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.get_kv_cache_spec": "cd02ed8d19e8350c",
    # the layouts the workers report, and the engine core's KV cache set-up
    "vllm.v1.worker.worker_base:WorkerBase.get_supported_kv_cache_layouts": "62db9e36bc5f67b8",
    "vllm.v1.engine.core:EngineCore._initialize_kv_caches": "47b605622969996d",
    # the CPU platform's config changes a GPU-geometry arm undoes
    "vllm.platforms.cpu:CpuPlatform.check_and_update_config": "d2960ad5d1836767",
    # the layer names the models register (layer order and names group the KV cache)
    "vllm.model_executor.models.falcon_h1:FalconH1ParallelHybrid.__init__": "077ac3db34b45f95",
    "vllm.model_executor.models.falcon_h1:FalconH1AttentionDecoderLayer.__init__":
        "b5b38051b25e5784",
    "vllm.model_executor.models.falcon_h1:FalconH1SSMDecoderLayer.__init__": "9cf2201b24213200",
    # (the Model classes whole: @support_torch_compile replaces their __init__ with a
    # wrapper whose source is the same for every model)
    "vllm.model_executor.models.granitemoehybrid:GraniteMoeHybridModel": "01ef055f9012a7af",
    "vllm.model_executor.models.granitemoehybrid:GraniteMoeHybridMambaDecoderLayer.__init__":
        "c543084b569d8151",
    "vllm.model_executor.models.granitemoehybrid:GraniteMoeHybridAttentionDecoderLayer.__init__":
        "16e2814a43bff4b2",
    "vllm.model_executor.models.granitemoehybrid:GraniteMoeHybridAttention.__init__":
        "26d7f4c7897bda7a",
    "vllm.model_executor.models.nemotron_h:NemotronHModel": "b93dae320992f151",
    "vllm.model_executor.models.nemotron_h:NemotronHMambaDecoderLayer.__init__":
        "4ba96c43361a6789",
    "vllm.model_executor.models.nemotron_h:NemotronHAttentionDecoderLayer.__init__":
        "a75f12aeb644d5a9",
    "vllm.model_executor.models.nemotron_h:NemotronHAttention.__init__": "513c1b25d9a13966",
    # what the model runner returns for a step (sampled tokens per scheduled request)
    "vllm.v1.outputs:ModelRunnerOutput": "b936f7c6940fc6ea",
}


def _source_file(module_name: str, package_dir: Path | None) -> Path:
    """The file of `module_name`, found without importing it or its packages: under
    `package_dir` (the top-level package's folder; None: where this interpreter finds it)."""
    top, *rest = module_name.split(".")
    if package_dir is None:
        spec = importlib.util.find_spec(top)  # a top-level name: nothing is imported
        if spec is None or spec.origin is None:
            raise ModuleNotFoundError(module_name)
        if not rest:
            return Path(spec.origin)
        package_dir = Path(spec.origin).parent
    base = package_dir.joinpath(*rest)
    return base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"


def source_hash(qualified: str, package_dir: Path | None = None) -> str:
    """sha256[:16] of the source of `module:Class.attr` in the installed vLLM, as
    inspect.getsource gives it (decorators included), read from the module's file with
    `ast`: nothing of vLLM is imported (its import was ~9 CPU s of the guard test)."""
    module_name, _, path = qualified.partition(":")
    text = _source_file(module_name, package_dir).read_text()
    node: ast.AST = ast.parse(text)
    for part in path.split("."):
        node = next(n for n in node.body if isinstance(n, DEFINITIONS) and n.name == part)
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    source = "".join(text.splitlines(keepends=True)[start - 1:node.end_lineno])
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def source_hashes(package_dir: Path | None = None) -> dict[str, str]:
    """The current hash of every mirrored function (the guard test compares them)."""
    return {name: source_hash(name, package_dir) for name in MIRRORED}


# ----- the attention backend --------------------------------------------------------------
def attention_backend(platform: str):
    """The backend the model's attention layers would select: FlashAttention on a GPU
    (the A100 geometry), vLLM's CPU backend on a CPU host."""
    if platform == "gpu":
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

        return FlashAttentionBackend
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return CPUAttentionBackend


def align_block_size(vllm_config, platform: str) -> None:
    """`update_block_size_for_backend` of the platform, its backend lookup answered.

    Mirrors `Platform._find_non_ssm_backends` (the distinct non-SSM backends of the built
    model's attention layers: one backend here). For the GPU arm it first undoes what the
    CPU platform's `check_and_update_config` set on this host: the 128-token CPU default
    block (a GPU starts from CacheConfig.DEFAULT_BLOCK_SIZE) and the float32 SSM state it
    forces on AVX512-BF16 hosts (a CUDA host keeps the model dtype, "auto").
    """
    from vllm.config import CacheConfig
    from vllm.platforms import current_platform
    from vllm.platforms.interface import Platform

    backend = attention_backend(platform)
    cache = vllm_config.cache_config
    if platform == "gpu":
        cache.mamba_ssm_cache_dtype = "auto"
        if not cache.user_specified_block_size:
            cache.block_size = CacheConfig.DEFAULT_BLOCK_SIZE
        owner = Platform
    else:
        owner = type(current_platform)
    saved = owner.__dict__.get("_find_non_ssm_backends")
    owner._find_non_ssm_backends = classmethod(lambda cls, _config: [backend])
    try:
        owner.update_block_size_for_backend(vllm_config)
    finally:
        if saved is None:
            del owner._find_non_ssm_backends
        else:
            owner._find_non_ssm_backends = saved


# ----- per-layer specs ----------------------------------------------------------------------
def layer_names(hf_config) -> list[tuple[str, str]]:
    """(layer name, "attention" | "mamba") in the order the model constructs its layers.

    FalconH1ParallelHybrid: layer i registers "model.layers.{i}.attn" and then its SSM
    branch under "model.{L + i}.mixer"; GraniteMoeHybridModel: "model.layers.{i}.mixer"
    (linear_attention) or "model.layers.{i}.self_attn.attn" (full_attention);
    NemotronHModel: "model.layers.{i}.mixer" (M) or "model.layers.{i}.mixer.attn" (*), no
    KV cache for its MLP layers (-)."""
    arch = hf_config.architectures[0]
    n = hf_config.num_hidden_layers
    if arch == "FalconH1ForCausalLM":
        out = []
        for i in range(n):
            out += [(f"model.layers.{i}.attn", "attention"), (f"model.{n + i}.mixer", "mamba")]
        return out
    if arch == "GraniteMoeHybridForCausalLM":
        return [(f"model.layers.{i}.mixer", "mamba") if kind == "linear_attention"
                else (f"model.layers.{i}.self_attn.attn", "attention")
                for i, kind in enumerate(hf_config.layer_types)]
    if arch == "NemotronHForCausalLM":
        return [(f"model.layers.{i}.mixer", "mamba") if kind == "M"
                else (f"model.layers.{i}.mixer.attn", "attention")
                for i, kind in enumerate(hf_config.hybrid_override_pattern) if kind in "M*"]
    raise ValueError(f"architecture {arch!r}: the virtual arm names the layers of "
                     "FalconH1ForCausalLM, GraniteMoeHybridForCausalLM, NemotronHForCausalLM")


def layer_specs(vllm_config, model_cls, platform: str) -> dict:
    """Each layer's KV cache spec as the layer reports it and the GPU model runner keeps it.

    Attention: `Attention.get_kv_cache_spec` (full attention: FullAttentionSpec at the
    cache block, the model's KV heads and head size, the KV cache dtype) through
    `customize_attention_spec` with the layer's backend. Mamba2:
    `MambaBase.get_kv_cache_spec` with the shapes and dtypes of the model class's
    `get_mamba_state_shape_from_config` / `get_mamba_state_dtype_from_config` (what
    MambaMixer2 computes from the same config), then `MambaMixer2.get_kv_cache_spec`'s
    one prefill checkpoint block at alignment 1.
    """
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, get_kv_quant_mode
    from vllm.v1.worker.utils import customize_attention_spec

    cache, model = vllm_config.cache_config, vllm_config.model_config
    backend = attention_backend(platform)
    kv_dtype = (model.dtype if cache.cache_dtype == "auto"
                else STR_DTYPE_TO_TORCH_DTYPE[cache.cache_dtype])
    heads = model.get_num_kv_heads(vllm_config.parallel_config)
    head = model.get_head_size()
    attention = customize_attention_spec(backend, FullAttentionSpec(
        block_size=cache.block_size, num_kv_heads=heads, head_size=head, head_size_v=head,
        dtype=kv_dtype, kv_quant_mode=get_kv_quant_mode(cache.cache_dtype)))
    mamba = replace(MambaSpec(
        shapes=tuple(model_cls.get_mamba_state_shape_from_config(vllm_config)),
        dtypes=tuple(model_cls.get_mamba_state_dtype_from_config(vllm_config)),
        block_size=cache.mamba_block_size, page_size_padded=cache.mamba_page_size_padded,
        mamba_type=MambaAttentionBackendEnum.MAMBA2, tp_replicated=False,
        mamba_cache_mode=cache.mamba_cache_mode,
        num_speculative_blocks=vllm_config.num_speculative_tokens,
    ), num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)
    return {name: attention if kind == "attention" else mamba
            for name, kind in layer_names(model.hf_config)}


def supported_layouts(platform: str) -> list[str]:
    """`WorkerBase.get_supported_kv_cache_layouts` over the model's backends (its attention
    backend and the Mamba2 backend)."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.attention.selector import get_mamba_attn_backend

    backends = [attention_backend(platform),
                get_mamba_attn_backend(MambaAttentionBackendEnum.MAMBA2)]
    return [layout.name for layout in get_supported_kv_cache_layouts(backends)]


# ----- the engine core's KV cache set-up ----------------------------------------------------
def initialize_kv_caches(vllm_config, specs: dict, kv_cache_bytes: int, platform: str):
    """`EngineCore._initialize_kv_caches` without an executor: the specs and layouts come
    from the stand-ins above, the available memory is the budget's bytes (what
    `--kv-cache-memory-bytes` gives), nothing is allocated, compiled or warmed up.
    Returns (scheduler KV cache config, scheduler block size, hash block size)."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_configs,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
        update_kv_cache_capacity,
    )
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    register_all_kvcache_specs(vllm_config)
    resolve_kv_cache_layout(vllm_config, [supported_layouts(platform)], list(specs.values()))
    configs = get_kv_cache_configs(vllm_config, [specs], [int(kv_cache_bytes)])
    for config in configs:
        config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    scheduler_config = generate_scheduler_kv_cache_config(configs)
    cache = vllm_config.cache_config
    cache.num_gpu_blocks = scheduler_config.num_blocks
    groups = scheduler_config.kv_cache_groups
    participating = [g.kv_cache_spec.block_size for g in groups
                     if g.kv_cache_spec.prefix_cacheable]
    cache.block_size = min(participating or [g.kv_cache_spec.block_size for g in groups])
    update_kv_cache_capacity(vllm_config, scheduler_config)
    vllm_config.validate_block_size()
    block, hash_block = resolve_kv_cache_block_sizes(scheduler_config, vllm_config)
    alignment = resolve_cache_hit_alignment_tokens(scheduler_config, vllm_config, block,
                                                   hash_block)
    for config in (*configs, scheduler_config):
        config.hash_block_size = hash_block
        config.cache_hit_alignment_tokens = alignment
    return scheduler_config, block, hash_block


# ----- the model runner's output ------------------------------------------------------------
def model_runner_output(scheduler, scheduler_output, token_of):
    """What a model runner returns for a scheduled step, without a model: one sampled token
    for each request whose chunk reaches its last token (`not request.is_prefill_chunk`,
    set by the scheduler's `_update_after_schedule`), none for a partial prefill chunk;
    no logprobs, no spec tokens. `token_of(request)` gives the token id."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(scheduler_output.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        request = scheduler.requests[rid]
        sampled.append([] if request.is_prefill_chunk else [token_of(request)])
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=sampled)
