"""Figure text kept on the canvas: long titles wrapped to the width their anchor leaves.

A title states a figure's conditions and n, so it can run wider than the figure; centred
on its axes (or the figure), it would be cut at both edges. `fit_text` lays the figure out,
wraps every horizontal title and figure text (suptitle, stage note) that is wider than the
room on its anchor's sides, at word boundaries, and lays it out again until nothing moves.
A phrase in `keep` (a stage note, which must read whole) is never broken; a line that no
break can narrow enough is set in a smaller font, down to MIN_FONT.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence

MARGIN_PX = 4  # kept free at each edge of the canvas
MIN_FONT = 6.0
_ROUNDS = 4
_GLUE = "\ue000"  # stands for a space inside a kept phrase while lines are filled


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


def _fill(lines: list[str], chars: int) -> str:
    return "\n".join(textwrap.fill(line, chars, break_long_words=False,
                                   break_on_hyphens=False) if line else line
                     for line in lines).replace(_GLUE, " ")


def _wrap(text, room: float, renderer, keep: Sequence[str]) -> bool:
    """Re-fill the text's lines narrower until it fits `room` (then shrink its font if no
    break is left); True if it changed."""
    original = text.get_text()
    width = text.get_window_extent(renderer).width
    if width <= room or room <= 0:
        return False
    glued = original
    for phrase in keep:
        glued = glued.replace(phrase, phrase.replace(" ", _GLUE))
    lines = glued.split("\n")
    narrowest = max(len(word) for line in lines for word in line.split() or [""])
    estimate = int(max(len(line) for line in lines) * room / width) + 1
    for chars in range(max(estimate, narrowest), narrowest - 1, -1):
        text.set_text(_fill(lines, chars))
        if text.get_window_extent(renderer).width <= room:
            return text.get_text() != original
    size = text.get_fontsize()
    while text.get_window_extent(renderer).width > room and size > MIN_FONT:
        size = max(MIN_FONT, size - 0.5)
        text.set_fontsize(size)
    return True


def fit_text(fig, layout: Callable[[], None], keep: Sequence[str] = ()) -> None:
    """`layout()` (the figure's tight_layout), wrapping what overflows, until stable."""
    keep = [phrase for phrase in keep if phrase]
    for _ in range(_ROUNDS):
        layout()
        renderer = fig.canvas.get_renderer()
        changed = [_wrap(t, _room(fig, t, renderer), renderer, keep) for t in _texts(fig)]
        if not any(changed):
            return
    layout()
