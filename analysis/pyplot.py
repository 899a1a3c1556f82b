"""pyplot on the Agg backend, imported on first use.

matplotlib costs about a second of CPU to import; command lines that only
refuse bad input or write tables should not pay it.
"""

from __future__ import annotations


class _LazyPyplot:
    """Stands in for `matplotlib.pyplot`; imports it (Agg backend) on first attribute use."""

    def __getattr__(self, name: str):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot

        return getattr(matplotlib.pyplot, name)


plt = _LazyPyplot()
