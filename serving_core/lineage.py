"""Checkpoint lineage of a traced run: every checkpoint's publication, each adoption, its
end with the cause and its age, and the depth events of the waiting episodes (the
reference paper's C.1 lineage; definitions in docs/engine_rules.md section 19).

Rows (LINEAGE_COLUMNS), one per event in engine order:
- PUBLISH: a checkpoint published (request_id: its producer); `same_step` = 1 when a
  request whose chain holds the key was admitted in the same engine step (at step
  resolution, whether the publication preceded that lookup is ambiguous);
- ADOPT: a checkpoint adopted at an admission (request_id: the adopter; age since its
  publication);
- END: a checkpoint's cache entry ended (cause: `lru` eviction of a member page by an
  allocation, `slab_reclaim` (S2 slab page reclaimed whole), `pool_pressure` (Jenga
  large page reclaimed for the other type), `reset` (prefix-cache reset), `run_end`
  (still cached when the run ended); cause_request_id: whose allocation took it);
- DEPTH_DOWN / DEPTH_UP: a waiting episode's joint depth (what it would adopt now) fell
  through a loss (attention or checkpoint) or rose through a publication; request_id and
  episode: the waiting one; depth_before / depth_after: its joint depth around the event.
Only an event that can change a waiting episode's depth triggers a lookup of it: an
attention loss inside its cached attention prefix, a checkpoint loss at its adopted
depth, a checkpoint published deeper than it, or the block its attention prefix lacks.
"""

from __future__ import annotations

from serving_core.memory.objects import Kind

LINEAGE_COLUMNS = (
    "seq", "t_s", "step", "event", "key", "boundary", "request_id", "episode", "cause",
    "cause_request_id", "age_s", "age_steps", "depth_before", "depth_after", "same_step",
)
END_CAUSES = ("lru", "slab_reclaim", "pool_pressure", "reset", "run_end")


class _Waiting:
    __slots__ = ("rid", "episode", "keys", "attention", "jadopt")

    def __init__(self, rid, episode, keys, hit) -> None:
        self.rid, self.episode, self.keys = rid, episode, keys
        self.attention, self.jadopt = hit.attention, hit.jadopt


class CheckpointLineage:
    """Lineage rows of one traced run (see the module doc)."""

    def __init__(self, block_tokens: int, lookup=None) -> None:
        self.B = block_tokens
        self.lookup = lookup  # keys -> PrefixHit (the organization's lookup)
        self.rows = {c: [] for c in LINEAGE_COLUMNS}
        self.born: dict[int, tuple[float, int]] = {}  # cached checkpoint key -> (t, step)
        self.watched: dict[int, _Waiting] = {}
        self.watch: dict[int, dict[int, int]] = {}  # key -> {waiting rid: block index}
        self.admitted_keys: set[int] = set()  # chain keys of this step's admissions
        self.step = -1

    def _row(self, t, step, event, key, boundary, rid, **extra) -> None:
        values = {"seq": len(self.rows["seq"]), "t_s": t, "step": step, "event": event,
                  "key": key, "boundary": boundary, "request_id": rid, "episode": 0,
                  "cause": "", "cause_request_id": -1, "age_s": float("nan"),
                  "age_steps": -1, "depth_before": -1, "depth_after": -1, "same_step": 0,
                  **extra}
        for column, value in values.items():
            self.rows[column].append(value)

    def _new_step(self, step: int) -> None:
        if step != self.step:
            self.step = step
            self.admitted_keys = set()

    # ----- checkpoints ----------------------------------------------------------------------
    def published(self, obj, t: float, step: int, key: str) -> None:
        self._new_step(step)
        if obj.kind == Kind.COMPOSITE:
            self.born[obj.key] = (t, step)
            self._row(t, step, "PUBLISH", key, obj.boundary, obj.producer,
                      same_step=int(obj.key in self.admitted_keys))
        self._touch(obj, t, step, gain=True, cause=-1)

    def lost(self, obj, t: float, step: int, key: str, reason: str, cause: int) -> None:
        self._new_step(step)
        if obj.kind == Kind.COMPOSITE:
            self._end(obj.key, obj.boundary, obj.producer, t, step, key, reason, cause)
        self._touch(obj, t, step, gain=False, cause=cause)

    def _end(self, raw_key, boundary, producer, t, step, key, reason, cause) -> None:
        t0, step0 = self.born.pop(raw_key, (t, step))
        self._row(t, step, "END", key, boundary, producer, cause=reason,
                  cause_request_id=cause, age_s=t - t0, age_steps=step - step0)

    def adoption(self, checkpoint, rid: int, episode: int, keys, t: float, step: int,
                key: str) -> None:
        """An admission: its adopted checkpoint (if any) and the end of its wait."""
        self._new_step(step)
        self.admitted_keys.update(keys)
        self._unwatch(rid)
        if checkpoint:
            t0, step0 = self.born.get(checkpoint.key, (t, step))
            self._row(t, step, "ADOPT", key, checkpoint.boundary, rid, episode=episode,
                      age_s=t - t0, age_steps=step - step0)

    def close(self, t: float, step: int, cached: dict, format_key) -> None:
        """Run end: every checkpoint still cached ends with cause run_end."""
        for raw_key, obj in cached.items():
            if raw_key in self.born:
                self._end(raw_key, obj.boundary, obj.producer, t, step, format_key(raw_key),
                          "run_end", -1)

    # ----- waiting episodes -----------------------------------------------------------------
    def entered(self, rid: int, episode: int, keys, hit) -> None:
        self._unwatch(rid)
        self.watched[rid] = _Waiting(rid, episode, keys, hit)
        for i, key in enumerate(keys):
            self.watch.setdefault(key, {})[rid] = i

    def left(self, rid: int) -> None:
        self._unwatch(rid)

    def _unwatch(self, rid: int) -> None:
        w = self.watched.pop(rid, None)
        if w is None:
            return
        for key in w.keys:
            watchers = self.watch.get(key)
            if watchers is not None:
                watchers.pop(rid, None)
                if not watchers:
                    del self.watch[key]

    def _touch(self, obj, t: float, step: int, gain: bool, cause: int) -> None:
        watchers = self.watch.get(obj.key)
        if not watchers:
            return
        checkpoint = obj.kind == Kind.COMPOSITE
        for rid, i in list(watchers.items()):
            w = self.watched[rid]
            end = (i + 1) * self.B
            if checkpoint:
                relevant = end > w.jadopt if gain else end == w.jadopt
            else:
                relevant = i == w.attention // self.B if gain else end <= w.attention
            if relevant:
                self._relook(w, t, step, obj, cause)

    def _relook(self, w: _Waiting, t, step, obj, cause) -> None:
        hit = self.lookup(w.keys)
        before, w.attention, w.jadopt = w.jadopt, hit.attention, hit.jadopt
        if hit.jadopt != before:
            event = "DEPTH_UP" if hit.jadopt > before else "DEPTH_DOWN"
            self._row(t, step, event, "", obj.boundary, w.rid, episode=w.episode,
                      cause="checkpoint" if obj.kind == Kind.COMPOSITE else "attention",
                      cause_request_id=cause if event == "DEPTH_DOWN" else obj.producer,
                      depth_before=before, depth_after=hit.jadopt)
