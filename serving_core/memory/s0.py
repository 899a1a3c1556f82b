"""S0 coarse shared pages: every attention block and every composite takes one large page.

The page is sized for the recurrent composite, so an attention block leaves most
of its page unused; the price of keeping one uniform page size.
"""

from serving_core.geometry import Geometry
from serving_core.layout import PAGED_BLOCK_TOKENS, OrgLayout, paged_page_bytes
from serving_core.memory.base import MemoryOrganization


class S0CoarsePages(MemoryOrganization):
    org = "S0"
    conv_addressing = "unit"

    @classmethod
    def unit_layout(cls, geometry: Geometry) -> OrgLayout:
        """One page of max(paged attention block, composite) bytes per block or composite."""
        rec = geometry.has_recurrent
        page = max(paged_page_bytes(geometry), geometry.composite_bytes)
        return OrgLayout(org=cls.org, block_tokens=PAGED_BLOCK_TOKENS,
                         checkpoint_interval=PAGED_BLOCK_TOKENS if rec else 0, page_bytes=page,
                         units_per_composite=1 if rec else 0, recurrent_unit_bytes=page)
