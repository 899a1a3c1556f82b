"""S1 recurrent paging: a composite is SSM member pages plus one dedicated conv page.

Member pages need not be adjacent; the kernel reaches member j of the checkpoint
at boundary b through page_of(b, j). Losing any one member page invalidates the
whole checkpoint (its other pages return to the free queue).
"""

from serving_core.memory.base import MemoryOrganization
from serving_core.memory.objects import NO_SLOT, Kind, StateObject


class S1RecurrentPaging(MemoryOrganization):
    org = "S1"
    indirect = True

    def conv_line(self, obj: StateObject) -> int:
        """The dedicated conv page follows the SSM members."""
        assert obj.kind == Kind.COMPOSITE
        members = self.layout.ssm_members
        return obj.units[members] if len(obj.units) > members else NO_SLOT
