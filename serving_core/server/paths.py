"""The actual path of each served request, read from the engine after its first step.

A request's path is what happened, never what it was sent for: `host_reload` when the
host tier restored a prefix for it and it adopted exactly that prefix (B tokens),
`device_reuse` when it adopted a prefix the device cache held (tokens), `recompute`
when it adopted nothing. With it, the first batch: the tokens already computed when the
request was first scheduled (its adopted prefix) and the tokens that batch scheduled
for it. The runtime reads these once per request, right after the step that admitted it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

PATHS = ("recompute", "device_reuse", "host_reload")


@dataclass(frozen=True, slots=True)
class RequestPath:
    path: str  # one of PATHS
    reused_tokens: int  # device_reuse: adopted tokens; host_reload: B; recompute: 0
    first_batch_computed: int  # tokens computed before the first batch (= reused_tokens)
    first_batch_scheduled: int  # tokens the first batch scheduled for the request
    restored_tokens: int  # what the tier restored for it (0: no restore)

    def to_dict(self) -> dict:
        return asdict(self)


def classify(adopted: int, restored: int) -> str:
    if restored and adopted == restored:
        return "host_reload"
    return "device_reuse" if adopted else "recompute"


class PathRecorder:
    """Scans the engine's requests after each step (driver thread only)."""

    def __init__(self) -> None:
        self.paths: dict[int, RequestPath] = {}
        self._pending: list = []  # requests entered but not admitted yet
        self._seen = 0  # engine.requests[:_seen] have been picked up
        self._counts = {p: 0 for p in PATHS}
        self.device_hit_tokens = 0  # tokens adopted from the device cache (no restore)

    def update(self, engine) -> list[int]:
        """Record every request admitted since the last call; returns their ids."""
        reqs = engine.requests
        if self._seen < len(reqs):
            self._pending.extend(reqs[self._seen:])
            self._seen = len(reqs)
        if not self._pending:
            return []
        tier = engine.host_tier
        done, left = [], []
        for req in self._pending:
            if not req.episodes:
                left.append(req)
                continue
            adopted = int(req.adopted_first)
            restored = int(tier.restored.get(req.rid, 0)) if tier is not None else 0
            path = classify(adopted, restored)
            self.paths[req.rid] = RequestPath(
                path, adopted, adopted,
                int(req.num_computed) - adopted if req.episodes == 1 else -1, restored)
            self._counts[path] += 1
            if path == "device_reuse":
                self.device_hit_tokens += adopted
            done.append(req.rid)
        self._pending = left
        return done

    def counts(self) -> dict[str, int]:
        return dict(self._counts)
