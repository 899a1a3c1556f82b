"""N0 native uniform pages: vLLM's hybrid allocator, one page size for attention and Mamba.

The attention block is enlarged until one page holds a recurrent composite
(`layout.n0_block_tokens`), the composite is padded to that page, and both draw
from one block pool: an attention block takes one page, a checkpoint takes one
page. Mamba prefix caching in vLLM's "align" mode keeps a state only at block
boundaries, so the checkpoint interval equals the block, and a lookup is a strict
prefix match over whole blocks (the last prompt token is always computed).

What vLLM does that this class leaves to the engine: its scheduler ends every
prefill chunk on a block boundary (`_mamba_block_aligned_split`), so a state is
written at a step end; `checkpoint_placement` and `align_chunks` name that
behaviour for an engine that offers the choice. vLLM 0.32 by default also retains
only "semantic" Mamba checkpoints (`--prefix-cache-retention-interval 0`: the
prompt's replay boundary and a detected shared-prefix junction); N0 retains one at
every block boundary, which is what `--prefix-cache-retention-interval <block
tokens>` gives there.
"""

from serving_core.memory.base import MemoryOrganization


class N0UniformPages(MemoryOrganization):
    org = "N0"
    checkpoint_placement = "step_end"  # vLLM "align": a state is kept where a step ends
    align_chunks = True  # prefill chunks end on block boundaries (the prompt tail excepted)
