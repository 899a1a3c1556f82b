"""S0 coarse shared pages: every attention block and every composite takes one large page.

The page is sized for the recurrent composite, so an attention block leaves most
of its page unused; the price of keeping one uniform page size.
"""

from serving_core.memory.base import MemoryOrganization


class S0CoarsePages(MemoryOrganization):
    org = "S0"
    contiguous_composite = True
