"""D0 native dual pools: 16-token attention units and native composites in two static pools.

Capacity never moves between the pools; each is checked and evicted alone.
"""

from serving_core.memory.base import MemoryOrganization


class D0DualPools(MemoryOrganization):
    org = "D0"
    contiguous_composite = True
    # The native path publishes at every boundary a chunk crosses; chunks are not aligned.
    checkpoint_placement = "every_boundary"
    align_chunks = False
    attention_pool = "attention"
    composite_pool = "recurrent"

    def _unit_bytes(self, pool: str) -> int:
        return self.layout.page_bytes if pool == "attention" else self.layout.recurrent_unit_bytes

    def units_per_composite(self) -> int:
        return 1 if self.has_recurrent else 0

    def ssm_member_pages(self, obj):
        """A native composite is one contiguous unit: its only member."""
        return list(obj.units[:1])
