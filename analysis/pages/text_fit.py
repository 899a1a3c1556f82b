"""Figure text kept on the canvas: long titles wrapped to the width their anchor leaves.

A title states a figure's conditions and n, so it can run wider than the figure; centred
on its axes (or the figure), it would be cut at both edges. `fit_text` lays the figure out,
wraps every horizontal title and figure text (suptitle, stage note) that is wider than the
room on its anchor's sides, at word boundaries, and lays it out again until nothing moves.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable

MARGIN_PX = 4  # kept free at each edge of the canvas
_ROUNDS = 4


def _texts(fig) -> list:
    """Axes titles (centre, left, right) and the figure's own texts (suptitle included)."""
    out = []
    for ax in fig.axes:
        out += [ax.title, getattr(ax, "_left_title", None), getattr(ax, "_right_title", None)]
    out += list(fig.texts)
    return [t for t in out if t is not None and t.get_visible() and t.get_text()
            and not t.get_rotation()]


def _room(fig, text, renderer) -> float:
    """Width (px) the text may take on the canvas from where its alignment anchors it."""
    box = text.get_window_extent(renderer)
    width = fig.bbox.width
    align = text.get_horizontalalignment()
    if align == "left":
        return width - MARGIN_PX - box.x0
    if align == "right":
        return box.x1 - MARGIN_PX
    middle = (box.x0 + box.x1) / 2
    return 2 * min(middle - MARGIN_PX, width - MARGIN_PX - middle)


def _wrap(text, room: float, renderer) -> bool:
    """Re-fill the text's lines narrower until it fits `room`; True if it changed."""
    original = text.get_text()
    width = text.get_window_extent(renderer).width
    if width <= room or room <= 0:
        return False
    lines = original.split("\n")
    chars = int(max(len(line) for line in lines) * room / width) + 1
    while chars > 8:
        candidate = "\n".join(textwrap.fill(line, chars, break_long_words=False) if line
                              else line for line in lines)
        text.set_text(candidate)
        if text.get_window_extent(renderer).width <= room:
            return candidate != original
        chars -= 1
    return text.get_text() != original  # the narrowest fill (a single word may stay wide)


def fit_text(fig, layout: Callable[[], None]) -> None:
    """`layout()` (the figure's tight_layout), wrapping what overflows, until stable."""
    for _ in range(_ROUNDS):
        layout()
        renderer = fig.canvas.get_renderer()
        changed = [_wrap(t, _room(fig, t, renderer), renderer) for t in _texts(fig)]
        if not any(changed):
            return
    layout()
