"""N0 native uniform pages: vLLM's hybrid allocator, one page size for attention and Mamba.

The attention block is enlarged until one page holds a recurrent composite
(`layout.n0_block_tokens`), the composite is padded to that page, and both draw
from one block pool: an attention block takes one page, a checkpoint takes one
page. A checkpoint is kept at block boundaries only, so the checkpoint interval
equals the block, and a lookup is a strict prefix match over whole blocks (the
last prompt token is always computed).

Engine rules (decided here, once): every_boundary placement with unaligned
chunks. On the GPU, vLLM's Mamba2 prefill kernel returns the state at every
block boundary inside a chunk (mid-prefill checkpoints requested by the layer's
cache spec), and those states are cached: that is a checkpoint at each boundary
a chunk crosses, whatever the chunk's length. (vLLM's block-aligned split of the
prefill, `_mamba_block_aligned_split`, matters where the kernel cannot return
intermediate states: its CPU path with this project's workaround, which the
n0_validate page compares request by request.) vLLM 0.32 by default also retains
only "semantic" Mamba checkpoints (`--prefix-cache-retention-interval 0`); N0
retains one at every block boundary, which is what
`--prefix-cache-retention-interval <block tokens>` gives there.
"""

from serving_core.memory.base import MemoryOrganization


class N0UniformPages(MemoryOrganization):
    org = "N0"
    contiguous_composite = True
    checkpoint_placement = "every_boundary"
    align_chunks = False
