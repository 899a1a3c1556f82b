"""What the engine learns of prefix sharing online, and the optimal sparse placement.

`PrefixTree`: the prefix tree (radix) of the requests seen so far, held as the set of
their block chain keys (a key names the whole token prefix [0, (i+1) B) it closes, so the
set is prefix-closed: a radix tree over blocks whose edges are hashed token ids). It
answers, without reading any workload label, how deep a new request overlaps any earlier
one (its branch point, `overlap_blocks`), and keeps the histogram of those overlap depths
on the checkpoint grid (the distribution the optimal placement is fed).

`optimal_positions`: the exact dynamic program of sparse prefix caching (arXiv
2605.05219; docs/engine_rules.md section 8.5 derives it): choose at most M of the N grid
positions to maximise the expected reused tokens when a request of overlap depth d
resumes from the deepest chosen position <= d. O(N M) with a monotone convex-hull queue.
"""

from __future__ import annotations

from collections import deque


class PrefixTree:
    """The block chain keys of the requests seen so far and their overlap-depth
    histogram on a grid of `interval` tokens (`block` tokens per key)."""

    def __init__(self, block: int, interval: int) -> None:
        self.block = block
        self.interval = interval
        self.seen: set[int] = set()
        self.depths: dict[int, int] = {}  # grid index floor(depth / C) -> requests
        self.requests = 0

    def overlap_blocks(self, keys: list[int]) -> int:
        """Blocks of `keys` shared with some earlier request (binary search: the set is
        prefix-closed)."""
        lo, hi = 0, len(keys)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if keys[mid - 1] in self.seen:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def overlap_tokens(self, keys: list[int], num_prompt: int) -> int:
        """Tokens of a prompt of `num_prompt` tokens a checkpoint could serve from its
        overlap with earlier requests (at most num_prompt - 1: one token is computed)."""
        return min(self.overlap_blocks(keys) * self.block, num_prompt - 1)

    def record(self, depth_tokens: int) -> None:
        """Count one request's overlap depth in the histogram."""
        j = depth_tokens // self.interval
        self.depths[j] = self.depths.get(j, 0) + 1
        self.requests += 1

    def insert(self, keys: list[int]) -> None:
        """Add a sequence's block keys to the tree."""
        self.seen.update(keys)

    def tail_mass(self) -> list[float]:
        """T[j] = share of requests whose overlap depth reaches grid position j, for
        j = 0 .. the deepest seen (T[0] = 1)."""
        if not self.requests:
            return [1.0]
        deepest = max(self.depths)
        out, above = [0.0] * (deepest + 1), 0
        for j in range(deepest, -1, -1):
            above += self.depths.get(j, 0)
            out[j] = above / self.requests
        return out


def placement_value(positions, tail: list[float]) -> float:
    """Expected reused grid units of the chosen positions (sorted grid indices >= 1):
    sum over them of (q_t - q_{t-1}) T[q_t], q_0 = 0 (telescoped E[max{q <= d}])."""
    value, prev = 0.0, 0
    for q in sorted(positions):
        value += (q - prev) * (tail[q] if q < len(tail) else 0.0)
        prev = q
    return value


def optimal_positions(tail: list[float], m: int) -> list[int]:
    """At most `m` grid positions in 1 .. len(tail) - 1 maximising placement_value.

    f[k][i]: best value with k positions, the deepest at i: f[k][i] = i T[i] +
    max_{j < i} (f[k-1][j] - j T[i]), f[0][0] = 0. Lines of slope -j arrive with j
    increasing and are queried at T[i], non-increasing in i, so one monotone hull per
    layer answers each layer in O(N): O(N M) in all."""
    n = len(tail) - 1
    if n <= 0 or m <= 0:
        return []
    if m >= n:  # every position with mass helps (T >= 0): take those with T > 0
        return [i for i in range(1, n + 1) if tail[i] > 0]
    neg = float("-inf")
    prev = [0.0] + [neg] * n  # f[k-1][.]
    choice: list[list[int]] = []
    best_value, best = 0.0, (0, 0)
    for k in range(1, m + 1):
        cur, arg = [neg] * (n + 1), [0] * (n + 1)
        hull: deque[int] = deque()
        for i in range(1, n + 1):
            _add_line(hull, i - 1, prev)
            x = tail[i]
            while len(hull) > 1 and _at(hull[1], prev, x) >= _at(hull[0], prev, x):
                hull.popleft()
            if hull:
                j = hull[0]
                cur[i], arg[i] = i * x + _at(j, prev, x), j
                if cur[i] > best_value + 1e-12:
                    best_value, best = cur[i], (k, i)
        choice.append(arg)
        prev = cur
    return _trace(choice, *best)


def _at(j: int, f: list[float], x: float) -> float:
    return f[j] - j * x


def _add_line(hull: deque, j: int, f: list[float]) -> None:
    """Add line y = f[j] - j x (slopes decrease as j grows) to an upper hull queried at
    non-increasing x; a line made useless by its neighbours leaves."""
    if f[j] == float("-inf"):
        return
    while len(hull) >= 2:
        a, b = hull[-2], hull[-1]
        # b is useless when the intersection of a and j lies at or right of a and b's
        if (f[j] - f[a]) * (b - a) >= (f[b] - f[a]) * (j - a):
            hull.pop()
        else:
            break
    hull.append(j)


def _trace(choice: list[list[int]], k: int, i: int) -> list[int]:
    out = []
    while k > 0 and i > 0:
        out.append(i)
        i = choice[k - 1][i]
        k -= 1
    return sorted(out)
