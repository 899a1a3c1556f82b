"""S1 recurrent paging: a composite is SSM member pages plus one dedicated conv page.

Member pages need not be adjacent; the kernel reaches member j of the checkpoint
at boundary b through page_of(b, j). Losing any one member page invalidates the
whole checkpoint (its other pages return to the free queue).
"""

import math

from serving_core.geometry import Geometry
from serving_core.layout import PAGED_BLOCK_TOKENS, OrgLayout, paged_page_bytes
from serving_core.memory.base import MemoryOrganization
from serving_core.memory.objects import NO_SLOT, Kind, StateObject


class S1RecurrentPaging(MemoryOrganization):
    org = "S1"
    indirect = True
    conv_addressing = "page"

    @classmethod
    def unit_layout(cls, geometry: Geometry) -> OrgLayout:
        """Paged-attention-block pages; ceil(SSM / page) member pages and one conv page per
        composite."""
        rec = geometry.has_recurrent
        page = paged_page_bytes(geometry)
        members = math.ceil(geometry.ssm_bytes / page) if rec else 0
        conv_pages = 1 if rec else 0
        return OrgLayout(org=cls.org, block_tokens=PAGED_BLOCK_TOKENS,
                         checkpoint_interval=PAGED_BLOCK_TOKENS if rec else 0, page_bytes=page,
                         units_per_composite=members + conv_pages, ssm_members=members,
                         conv_pages=conv_pages)

    def conv_line(self, obj: StateObject) -> int:
        """The dedicated conv page follows the SSM members."""
        assert obj.kind == Kind.COMPOSITE
        members = self.layout.ssm_members
        return obj.units[members] if len(obj.units) > members else NO_SLOT
