"""Run by the vLLM venv's interpreter: does the CPU Mamba2 scan return intermediate states?

MambaMixer2.forward (vLLM 0.32, mamba_mixer2.py) asks `mamba_chunk_scan_combined_varlen`
for per-chunk states when prefill checkpoints are on and then reads
`varlen_states[last_chunk_indices_p]`. On CPU the scan is
`ops/cpu/mamba_ssm._mamba_chunk_scan_combined_fwd_cpu`, which accepts the flag but returns
one final state per sequence. Prints one JSON object: which function runs, the shape it
returns for one 8-token sequence in two 4-token chunks, and whether that read fails.
"""

import json

import torch
from vllm.model_executor.layers.mamba.ops import ssd_combined
from vllm.model_executor.layers.mamba.ops.cpu import mamba_ssm

L, H, P, N = 8, 2, 4, 4
generator = torch.Generator().manual_seed(0)
last_chunk = torch.tensor([1])  # the sequence's last chunk is chunk 1
states = ssd_combined.mamba_chunk_scan_combined_varlen(
    torch.randn(L, H, P, generator=generator), torch.rand(L, H, generator=generator),
    -torch.rand(H, generator=generator), torch.randn(L, 1, N, generator=generator),
    torch.randn(L, 1, N, generator=generator), chunk_size=4,
    cu_seqlens=torch.tensor([0, L]), cu_chunk_seqlens=torch.tensor([0, 4, 8]),
    last_chunk_indices=last_chunk, seq_idx=torch.tensor([0, 0]),
    out=torch.zeros(L, H, P), return_intermediate_states=True,
)
try:
    states[last_chunk]
    error = ""
except IndexError as exc:
    error = str(exc)
print(json.dumps({
    "cpu_fallback": ssd_combined._mamba_chunk_scan_combined_fwd
    is mamba_ssm._mamba_chunk_scan_combined_fwd_cpu,
    "shape": list(states.shape),
    "index_error": error,
}))
