"""A vLLM general plugin: on CPU, Mamba2 layers request no mid-prefill checkpoint states.

vLLM 0.32's CPU Mamba2 scan (ops/cpu/mamba_ssm.py) ignores
`return_intermediate_states`, so with prefix caching on, a prompt longer than one block
makes `MambaMixer2.forward` index states the scan never returned (IndexError at
`varlen_states[last_chunk_indices_p]`) and the engine dies. `MambaMixer2.get_kv_cache_spec`
asks for those states (`num_prefill_checkpoint_blocks=1`); the base `MambaBase` spec does
not, so the scheduler instead ends prefill chunks at block boundaries and the block-boundary
state is the chunk's final state, which the CPU scan does return.

vLLM loads general plugins in every process (API server, engine core, workers), hence the
registration is idempotent. Nothing changes on other platforms, or when the environment
variable HSL_VLLM_CPU_MAMBA2_FIX is "0". `VLLM_PLUGINS` can also exclude the plugin by name
(`hsl_cpu_mamba2_prefix`).
"""

from __future__ import annotations

import logging
import os

ENV_SWITCH = "HSL_VLLM_CPU_MAMBA2_FIX"
# The line the runner looks for in the server log to record that the workaround is on.
APPLIED_MESSAGE = "hsl: CPU Mamba2 prefix-caching workaround applied"

_log = logging.getLogger("vllm.hsl_plugin")


def register() -> None:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

    if MambaMixer2.get_kv_cache_spec is MambaBase.get_kv_cache_spec:
        return  # already registered in this process
    MambaMixer2.get_kv_cache_spec = MambaBase.get_kv_cache_spec
    _log.warning("%s (pid %d)", APPLIED_MESSAGE, os.getpid())
