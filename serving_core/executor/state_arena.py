"""Model state stored in a memory organization's physical units.

One torch arena per pool: (layers, units, unit elements), sized from the
planner's units and the organization's unit bytes, so the bytes the planner
budgets are the bytes the model uses. Typed views over it:

- attention KV: the first `block_tokens` x (K, V, KV heads, head dim) elements of a
  unit, addressed through the request's block table (one unit per block); with
  `kv_codec=tq4` the first `block_tokens` x (K, V, KV heads, packed bytes) bytes of the
  unit instead (uint8: each vector's codes then its fp16 norm, serving_core.kv_codec),
  so a unit is exactly the planner's TQ4 bytes and KV is never held decoded;
- recurrent composites, as the organization's class says (`conv_addressing`):
  `unit` (S0, D0, N0): SSM state then conv window, contiguous in one unit; an N0 composite
  of a group with k > 1 Mamba2 layers (vLLM's per-layer Mamba pages, serving_core/memory/n0.py)
  is k units, member j holding layer j's SSM state then conv window (`layer_pages`);
  `page` (S1) and `slot` (S2): the SSM state split over the composite's member pages in
  member order, address(b, j, u) = page_of(b, j) * page + offset(j, u), pages anywhere
  in the pool; `page`: the conv window is the first elements of its dedicated conv page;
  `slot`: a 32-KiB slot addressed by line id 16 p + s (the arena viewed as lines), the
  negative "no conv state" sentinel refused, never decoded.

Locations always come from the memory organization (`ssm_member_pages`,
`conv_line`); the arena keeps no mapping of its own, so an invalidated or
reassigned unit can never be read as a stale copy. The code names no organization.
"""

from __future__ import annotations

import torch

from serving_core.executor import huge_pages
from serving_core.executor.device import host_index
from serving_core.executor.state_encoding import StateEncoder
from serving_core.geometry import Geometry
from serving_core.memory import CONV_ADDRESSING, MemoryOrganization, org_class
from serving_core.memory.s2 import decode_conv_line
from serving_core.model.mamba import UpdateWorkspace
from serving_core.model.paged_attention import UnitMatrices
from serving_core.state_codec import transcodes

STORAGE_DTYPES = {4: torch.float32, 2: torch.bfloat16}


def storage_dtype(geometry: Geometry) -> torch.dtype:
    if geometry.dtype_bytes not in STORAGE_DTYPES:
        raise ValueError(
            f"model.dtype_bytes={geometry.dtype_bytes}: the torch executor stores 4 (fp32) "
            "or 2 (bf16)"
        )
    return STORAGE_DTYPES[geometry.dtype_bytes]


def group_members(geometry: Geometry) -> int:
    """Mamba2 layers per storage group of a model the arena holds: one attention layer and
    k Mamba2 layers per group (serving_core/layer_pattern.py; Falcon-H1: k = 1, its hybrid
    layer). Other patterns are refused in one line."""
    counts = geometry.state_layer_counts
    g = geometry.scope_layers
    if counts["gdn"] or counts["mamba1"] or counts["attention"] != g or not counts["mamba2"]:
        raise ValueError(f"model={geometry.name!r}: the torch arena holds storage groups of "
                         "one attention layer and Mamba2 layers; this pattern has "
                         f"{counts} over {g} groups")
    return counts["mamba2"] // g


class PagedSSM:
    """SSM states (b, H, P, N) of a batch held in their member pages, as a list of
    (H / members, P, N) views in (sequence, member) order: updated in place
    (`mamba.state_update`), never copied out and back."""

    def __init__(self, views: list[torch.Tensor], batch: int, heads_per_member: int,
                 matrices: list[torch.Tensor] | None = None,
                 workspace: UpdateWorkspace | None = None) -> None:
        self.views = views
        self.batch = batch
        self.heads_per_member = heads_per_member
        # the same pages as (H / members x P, N) matrices (the read-out's operand)
        self.matrices = matrices or [v.view(-1, v.shape[-1]) for v in views]
        self.workspace = workspace  # the update's operand buffers, kept by the arena

    def read(self) -> torch.Tensor:
        """A contiguous copy (b, H, P, N)."""
        v = self.views[0]
        return torch.stack(self.views).view(self.batch, -1, v.shape[1], v.shape[2])

    def copy_(self, state: torch.Tensor) -> None:
        k = len(self.views)
        torch._foreach_copy_(self.views, state.reshape(k, *self.views[0].shape).unbind(0))


class StateArena:
    """The pools of one memory organization as torch tensors, with typed views."""

    def __init__(self, mem: MemoryOrganization, geometry: Geometry, device="cpu") -> None:
        self.members_per_group = group_members(geometry)
        self.mem = mem
        self.org = org_class(mem.org).org  # refuses an organization the registry lacks
        self.conv_addressing = type(mem).conv_addressing
        if self.conv_addressing not in CONV_ADDRESSING:
            raise ValueError(f"{type(mem).__name__}.conv_addressing={self.conv_addressing!r}: "
                             f"allowed values are {', '.join(CONV_ADDRESSING)}")
        self.contiguous = self.conv_addressing == "unit"  # one unit per composite
        self.slots = self.conv_addressing == "slot"  # conv windows in slab slots (line ids)
        self.dtype = storage_dtype(geometry)
        self.device = torch.device(device)
        elem = geometry.dtype_bytes
        self.layers = geometry.scope_layers  # storage groups (Falcon-H1: its layers)
        self.kv_heads, self.head_dim = geometry.num_kv_heads, geometry.head_dim
        self.token_elems = geometry.attention_bytes_per_token // elem
        self.block_tokens = mem.block_tokens
        self.ssm_elems = geometry.ssm_bytes // elem
        self.conv_elems = geometry.conv_bytes // elem
        # a group's Mamba2 layers stacked: SSM heads k x H, conv channels k x Cd
        k = self.members_per_group
        self.ssm_shape = (k * geometry.mamba_heads, geometry.mamba_head_dim, geometry.d_state)
        self.conv_shape = (k * (geometry.mamba_inner + 2 * geometry.n_groups * geometry.d_state),
                           geometry.d_conv - 1)
        self.kv_codec = geometry.kv_codec
        self.codec = None
        if self.kv_codec == "tq4":
            from serving_core.kv_codec import codec_for

            self.codec = codec_for(self.head_dim, device=self.device)
        self.kv_group_heads = geometry.kv_group_heads  # None: rebuild all KV heads at once
        self.state_codec = geometry.state_codec
        self.encoder = self._state_encoder(geometry, elem, k)
        self.token_bytes = geometry.attention_bytes_per_token
        # Every pool is one byte tensor (layers, units, unit bytes); `pools` views it in the
        # storage dtype, `raw` as bytes (the packed KV view reads it).
        self.raw: dict[str, torch.Tensor] = {}
        self.pools: dict[str, torch.Tensor] = {}
        for name, pool in mem.pools.items():
            if pool.unit_bytes % elem:
                raise ValueError(f"pool {name!r}: {pool.unit_bytes}-B unit is not whole elements")
            self.raw[name] = huge_pages.zeros((self.layers, pool.num_units, pool.unit_bytes),
                                              torch.uint8, self.device)
            self.pools[name] = self.raw[name].view(self.dtype)
        self.unit_elems = {name: t.shape[2] for name, t in self.pools.items()}
        if self.block_tokens * self.token_bytes > mem.pools[mem.attention_pool].unit_bytes:
            raise ValueError("an attention block does not fit its unit")
        self.layer_pages = False
        if mem.has_recurrent:
            self.rec_pool = mem.composite_pool
            self.members = max(1, mem.layout.ssm_members)
            unit = self.unit_elems[self.rec_pool]
            # `unit` addressing over several member pages: one page per Mamba2 layer of the group
            self.layer_pages = self.contiguous and self.members > 1
            if self.layer_pages and self.members != k:
                raise ValueError(f"{self.org}: {self.members} member pages per composite for "
                                 f"{k} Mamba2 layers per group; per-layer pages need one each")
            if self.layer_pages:
                fits = (self.ssm_elems + self.conv_elems) // k <= unit
            elif self.contiguous:
                fits = self.ssm_elems + self.conv_elems <= unit
            else:
                fits = self.ssm_elems <= self.members * unit and self.conv_elems <= unit
            if not fits:
                raise ValueError(f"{self.org}: a recurrent composite does not fit its units")
            if self.slots:
                self.slot_elems = mem.layout.conv_slot_bytes // elem
                self.slots_per_slab = mem.layout.slots_per_slab
        self._decode_caches()

    def _decode_caches(self) -> None:
        """What the decode path keeps across steps: views of the pools (a unit's views never
        change) and scratch buffers that each call overwrites, none of them state."""
        self._page_views: dict[int, tuple] = {}
        self._kv_units: dict[int, UnitMatrices] = {}
        self._update_workspace = UpdateWorkspace()  # the paged SSM update's operands
        self._conv_buffer: torch.Tensor | None = None  # gather_conv's windows, reused
        self._kv_scratch: torch.Tensor | None = None  # gather_kv_heads' buffer, reused

    def _state_encoder(self, geometry: Geometry, elem: int, k: int) -> StateEncoder | None:
        """The SSM state's codec (serving_core/state_codec.py): None stores it in the pool's
        dtype; otherwise its leading ssm_elems elements hold the encoded bytes."""
        if not transcodes(geometry.state_codec, elem):
            return None
        if geometry.ssm_bytes % elem:
            raise ValueError(f"model.state_codec={geometry.state_codec!r}: the encoded SSM "
                             f"state of {geometry.ssm_bytes} B is not whole {elem}-B elements "
                             "of the arena")
        return StateEncoder(geometry.state_codec, self.ssm_shape, k)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.pools.values())

    # ----- attention KV -----------------------------------------------------------------------
    @property
    def packed(self) -> bool:
        """True when attention KV is stored as TQ4 codes and norms (`kv_codec=tq4`)."""
        return self.codec is not None

    def kv_view(self, layer: int) -> torch.Tensor:
        """(units, block_tokens, 2, KV heads, head dim) view of the attention pool; packed:
        (units, block_tokens, 2, KV heads, bytes per vector) uint8.

        Plain KV is stored head-major within a unit, (2, KV heads, block_tokens, head dim)
        (vLLM's CPU page order), and viewed token-major: each KV head's keys and values of a
        block are one contiguous run, which the paged decode attention reads as whole
        matrices (paged_attention.py; strided per-token rows read 1.7x slower on CPU)."""
        if self.packed:
            raw = self.raw[self.mem.attention_pool][layer]
            return raw[:, : self.block_tokens * self.token_bytes].view(
                raw.shape[0], self.block_tokens, 2, self.kv_heads, self.codec.bytes_per_vector)
        arena = self.pools[self.mem.attention_pool][layer]
        n = self.block_tokens * self.token_elems
        return arena[:, :n].view(arena.shape[0], 2, self.kv_heads, self.block_tokens,
                                 self.head_dim).permute(0, 3, 1, 2, 4)

    def kv_units(self, layer: int) -> UnitMatrices:
        """Plain KV: per unit of the layer its (K^T, V) views, kept across steps (the paged
        decode attention's operands, made once per unit rather than per step and layer)."""
        units = self._kv_units.get(layer)
        if units is None:
            units = self._kv_units[layer] = UnitMatrices(self.kv_view(layer))
        return units

    def gather_kv(self, layer: int, units: torch.Tensor, length: int):
        """K and V of the first `length` tokens of each row of block units (b, nb)."""
        if self.packed:
            raise RuntimeError("packed (tq4) KV is read through decode/prefill_attention")
        view = self.kv_view(layer)
        b, nb = units.shape
        kv = view.index_select(0, units.reshape(-1)).view(b, nb * self.block_tokens, 2,
                                                          self.kv_heads, self.head_dim)
        kv = kv[:, :length]
        return kv[:, :, 0], kv[:, :, 1]

    def gather_kv_heads(self, layer: int, units: torch.Tensor, length: int):
        """K and V (b, KV heads, length, head dim) of each row of block units (b, nb): whole
        units copied (one indexed copy for the batch) into a scratch buffer the arena keeps,
        so a decode step allocates nothing large; the views are strided, which attention
        reads as they are. Valid until the next call. The gathered decode attention of an
        accelerator reads it (serving_core/executor/torch_executor.py, `_DecodeIO`)."""
        if self.packed:
            raise RuntimeError("packed (tq4) KV is read through decode/prefill_attention")
        view = self.kv_view(layer)
        b, nb = units.shape
        n = b * nb
        buf = self._kv_scratch
        if buf is None or buf.shape[0] < n:
            buf = torch.empty((max(n, 2 * (0 if buf is None else buf.shape[0])), *view.shape[1:]),
                              dtype=view.dtype, device=view.device)
            self._kv_scratch = buf
        kv = torch.index_select(view, 0, units.reshape(-1), out=buf[:n])
        kv = kv.view(b, nb * self.block_tokens, 2, self.kv_heads, self.head_dim)[:, :length]
        return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)

    def store_kv(self, layer: int, units: torch.Tensor, offsets: torch.Tensor, k, v):
        """Write K, V (n, KVH, hd) at (unit, token offset) pairs. Packed: encoded, and the
        rows as stored are returned decoded ((n, 2, KVH, hd) float32) for the chunk's own
        attention; plain: returns None."""
        view = self.kv_view(layer)
        if self.packed:
            rows = self.codec.encode_packed(torch.stack([k, v], dim=1))
            view[units, offsets] = rows
            return self.codec.decode_packed(rows)
        view[units, offsets] = torch.stack([k, v], dim=1).to(self.dtype)
        return None

    def decode_attention(self, layer: int, q: torch.Tensor, units: torch.Tensor,
                         seq_lens: torch.Tensor) -> torch.Tensor:
        """Packed: one query per sequence q (b, H, hd) over its pages (block table `units`
        (b, pages), `seq_lens` (b,) tokens including the query's own), page by page
        (serving_core.kv_pages.decode_attention); (b, H, hd) float32."""
        from serving_core import kv_pages

        return kv_pages.decode_attention(q, self.kv_view(layer), self.codec, units, seq_lens)

    def prefill_attention(self, layer: int, q: torch.Tensor, kv_new: torch.Tensor,
                          units: torch.Tensor, cached: int):
        """Packed: a chunk q (n, H, hd) after `cached` tokens on pages `units`, with its own
        rows `kv_new` (n, 2, KVH, hd) as stored; K/V rebuilt `kv_group_heads` KV heads at a
        time. Returns (out (n, H, hd) float32, peak temporary bytes)."""
        from serving_core import kv_pages

        return kv_pages.prefill_attention(q, kv_new[:, 0], kv_new[:, 1], self.kv_view(layer),
                                          self.codec, units, cached, self.kv_group_heads)

    # ----- recurrent composites ---------------------------------------------------------------
    def locate(self, objs) -> dict[str, torch.Tensor]:
        """Physical addresses of composites, from the organization's mapping."""
        mem = self.mem
        pages = [mem.ssm_member_pages(obj) for obj in objs]
        if any(len(p) != self.members for p in pages):
            raise RuntimeError("a composite without all its SSM member pages was addressed")
        # The host list stays beside the device tensor: views of the pages are picked on the
        # host (`ssm_views`) without reading the device back.
        loc = {"pages": host_index(pages, self.device), "page_ids": [u for p in pages for u in p]}
        if self.conv_addressing == "page":  # conv_line: the conv page's id
            loc["conv"] = host_index([mem.conv_line(o) for o in objs], self.device)
        elif self.slots:  # conv_line: the slot's line id
            lines = [mem.conv_line(obj) for obj in objs]
            if lines:
                decode_conv_line(min(lines), self.slots_per_slab)  # refuses the sentinel
            loc["conv"] = host_index(lines, self.device)
        return loc

    def _conv_rows(self, layer: int) -> torch.Tensor:
        arena = self.pools[self.rec_pool][layer]
        if self.slots:
            return arena.view(-1, self.slot_elems)  # row = line id 16 p + s
        return arena

    @property
    def _slots_dense(self) -> bool:
        """Slab pages hold whole slots only (line id = row of the arena viewed as slots);
        not under TQ4, whose smaller pages leave a tail after their slots."""
        return self.unit_elems[self.rec_pool] == self.slots_per_slab * self.slot_elems

    def _slot_index(self, layer: int, lines: torch.Tensor):
        arena = self.pools[self.rec_pool][layer]
        slots = arena[:, : self.slots_per_slab * self.slot_elems].view(
            arena.shape[0], self.slots_per_slab, self.slot_elems)
        return slots, lines // self.slots_per_slab, lines % self.slots_per_slab

    def _conv_read(self, layer: int, rows: torch.Tensor, n: int | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """Copies of conv rows (conv pages, or slots by line id), their first `n` elements
        only when given (into `out` where the rows are read by one index_select)."""
        if self.slots and not self._slots_dense:
            slots, page, slot = self._slot_index(layer, rows)
            return slots[page, slot] if n is None else slots[page, slot, :n]
        conv_rows = self._conv_rows(layer)
        return torch.index_select(conv_rows if n is None else conv_rows[:, :n], 0, rows,
                                  out=out)

    def _conv_write(self, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Write the first values.shape[1] elements of conv rows."""
        if self.slots and not self._slots_dense:
            slots, page, slot = self._slot_index(layer, rows)
            slots[page, slot, : values.shape[1]] = values
        else:
            self._conv_rows(layer)[:, : values.shape[1]].index_copy_(0, rows, values)

    def conv_slot(self, line: int) -> torch.Tensor:
        """Every layer's conv slot of one line id, a (layers, slot elements) view (slots)."""
        page, slot = decode_conv_line(line, self.slots_per_slab)
        return self.pools[self.rec_pool][:, page, slot * self.slot_elems:(slot + 1)
                                         * self.slot_elems]

    @property
    def ssm_in_place(self) -> bool:
        """True when a decode can update the SSM state through views of its units, with no
        copy in or out: fp32 storage, and S0/D0 (the state leads its composite's unit) or
        S1/S2 member pages that hold whole heads."""
        if (not self.mem.has_recurrent or self.dtype != torch.float32
                or self.members_per_group != 1  # a model slices a group's stacked state
                or self.encoder is not None):  # an encoded state is decoded into a copy
            return False
        if self.contiguous:
            return True
        h, p, n = self.ssm_shape
        per_page, rem = divmod(self.unit_elems[self.rec_pool], p * n)
        return rem == 0 and per_page * self.members == h

    def ssm_views(self, layer: int, loc: dict[str, torch.Tensor]) -> PagedSSM:
        """The batch's SSM states as views of their units (see `ssm_in_place`): one
        (H / members, P, N) view per member page (S0/D0: one (H, P, N) view per composite)."""
        h, p, n = self.ssm_shape
        hpm = h // self.members
        if layer not in self._page_views:
            arena = self.pools[self.rec_pool][layer][:, : hpm * p * n]
            self._page_views[layer] = (arena.view(arena.shape[0], hpm, p, n).unbind(0),
                                       arena.view(arena.shape[0], hpm * p, n).unbind(0))
        views, matrices = self._page_views[layer]
        pages = loc["page_ids"]
        return PagedSSM([views[u] for u in pages], loc["pages"].shape[0], hpm,
                        [matrices[u] for u in pages], self._update_workspace)

    def gather_conv(self, layer: int, loc: dict[str, torch.Tensor]) -> torch.Tensor:
        """A copy of the batch's conv windows (b, Cd, K-1) from conv pages / S2 slots (the
        window's elements only: copying S1's whole 512-KiB conv page per sequence was most of
        its paged decode overhead)."""
        b = loc["pages"].shape[0]
        if self.layer_pages:
            conv = self.gather(layer, loc)[0]
            return conv.reshape(b, *self.conv_shape)
        if self.contiguous:
            rows = self.pools[self.rec_pool][layer][:, self.ssm_elems : self.ssm_elems
                                                    + self.conv_elems]
            conv = rows.index_select(0, loc["pages"].reshape(-1))
        else:  # only the window's elements, not the whole conv page / slab slot
            conv = self._conv_read(layer, loc["conv"], self.conv_elems, self._conv_scratch(b))
        return conv.reshape(b, *self.conv_shape)

    def _conv_scratch(self, b: int) -> torch.Tensor:
        """A (b, conv elements) buffer the arena keeps for `gather_conv` (valid until its next
        call: the layer's update writes it back first), so a decode step allocates none."""
        buf = self._conv_buffer
        if buf is None or buf.shape[0] < b:
            buf = self._conv_buffer = torch.empty(b, self.conv_elems, dtype=self.dtype,
                                                  device=self.device)
        return buf[:b]

    def scatter_conv(self, layer: int, loc: dict[str, torch.Tensor], conv: torch.Tensor) -> None:
        """Write the batch's conv windows back in one indexed copy (S2: all slab slots of
        the step together)."""
        b = conv.shape[0]
        flat = conv.reshape(b, -1).to(self.dtype)
        if self.layer_pages:
            _, ssm, gathered = self.gather(layer, loc)
            self.scatter(layer, loc, gathered, conv.to(self.dtype), ssm)
            return
        if self.contiguous:
            rows = self.pools[self.rec_pool][layer]
            rows[loc["pages"].reshape(-1), self.ssm_elems : self.ssm_elems + self.conv_elems] = flat
        else:
            self._conv_write(layer, loc["conv"], flat)

    def gather(self, layer: int, loc: dict[str, torch.Tensor]):
        """Copies of (conv (b, Cd, K-1), ssm (b, H, P, N)) and the rows they came from."""
        arena = self.pools[self.rec_pool][layer]
        pages = loc["pages"]
        b = pages.shape[0]
        rows = arena.index_select(0, pages.reshape(-1))
        if self.layer_pages:  # member j: layer j's SSM state then conv window
            k = self.members
            rows = rows.view(b, k, -1)
            s, c = self.ssm_elems // k, self.conv_elems // k
            ssm = self._ssm_out(rows[:, :, :s], b)
            conv = rows[:, :, s : s + c].reshape(b, *self.conv_shape)
            return conv, ssm, rows
        if self.contiguous:
            ssm = self._ssm_out(rows[:, : self.ssm_elems], b)
            conv = rows[:, self.ssm_elems : self.ssm_elems + self.conv_elems]
            return conv.view(b, *self.conv_shape), ssm, rows
        ssm = self._ssm_out(rows.view(b, -1)[:, : self.ssm_elems], b)
        conv_rows = self._conv_read(layer, loc["conv"])
        conv = conv_rows[:, : self.conv_elems].view(b, *self.conv_shape)
        return conv, ssm, (rows, conv_rows)

    def _ssm_out(self, raw: torch.Tensor, b: int) -> torch.Tensor:
        """The SSM states (b, k H, P, N) of their stored elements: a view of them as they
        are, or their decoded copy under a state codec."""
        if self.encoder is None:
            return raw.reshape(b, *self.ssm_shape) if raw.dim() == 3 else raw.view(
                b, *self.ssm_shape)
        return self.encoder.decode(raw.reshape(b, -1).contiguous().view(torch.uint8))

    def _ssm_in(self, ssm: torch.Tensor, keys, layer: int) -> torch.Tensor:
        """(b, ssm elements) to store of states (b, k H, P, N): encoded under a codec
        (`keys`: per row (request seed, token position) of its stochastic rounding)."""
        b = ssm.shape[0]
        if self.encoder is None:
            return ssm.reshape(b, -1)
        return self.encoder.encode(ssm, keys, layer).view(self.dtype)

    def scatter(self, layer: int, loc, gathered, conv: torch.Tensor, ssm: torch.Tensor,
                keys=None) -> None:
        """Write conv and ssm (as returned by `gather`, updated) back to their units
        (`keys`: the rows' stochastic-rounding keys under a state codec, `_ssm_in`)."""
        arena = self.pools[self.rec_pool][layer]
        pages = loc["pages"]
        b = pages.shape[0]
        if self.layer_pages:
            k, rows = self.members, gathered
            s, c = self.ssm_elems // k, self.conv_elems // k
            rows[:, :, :s] = self._ssm_in(ssm, keys, layer).reshape(b, k, s)
            rows[:, :, s : s + c] = conv.reshape(b, k, c)
            arena.index_copy_(0, pages.reshape(-1), rows.view(b * k, -1))
            return
        if self.contiguous:
            rows = gathered
            if ssm.data_ptr() != rows.data_ptr():
                rows[:, : self.ssm_elems] = self._ssm_in(ssm, keys, layer)
                conv_rows = rows[:, self.ssm_elems : self.ssm_elems + self.conv_elems]
                if conv.data_ptr() != conv_rows.data_ptr():  # not updated where it lies
                    conv_rows[...] = conv.reshape(b, -1)
            arena.index_copy_(0, pages.reshape(-1), rows)
            return
        rows, conv_rows = gathered
        flat = rows.view(b, -1)
        if ssm.data_ptr() != flat.data_ptr():
            flat[:, : self.ssm_elems] = self._ssm_in(ssm, keys, layer)
        arena.index_copy_(0, pages.reshape(-1), rows)
        if conv.data_ptr() != conv_rows.data_ptr():
            conv_rows[:, : self.conv_elems] = conv.reshape(b, -1)
        self._conv_write(layer, loc["conv"], conv_rows)

    def read(self, obj) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (conv (1, Cd, K-1), ssm (1, H, P, N)) copies of one composite (fp32)."""
        loc = self.locate([obj])
        return [self.read_layer(loc, layer) for layer in range(self.layers)]

    def read_layer(self, loc, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`read`'s (conv, ssm) copies of one layer of the composite at `loc`
        (`locate([obj])`)."""
        conv, ssm, _ = self.gather(layer, loc)
        return conv.float().clone(), ssm.float().clone()

    def write(self, obj, states: list[tuple[torch.Tensor, torch.Tensor]], key=None) -> None:
        """Store per-layer (conv, ssm) into one composite's units (`key`: its (request seed,
        token position) under a state codec)."""
        self.write_layers(self.locate([obj]), states, key, 0, len(states))

    def write_layers(self, loc, states: list[tuple[torch.Tensor, torch.Tensor]], key,
                     first: int, end: int) -> None:
        """`write` of the layers [first, end) of `states` to the composite at `loc`
        (`locate([obj])`); layers are disjoint units, so two threads may write two ranges."""
        keys = None if key is None else [key]
        for layer in range(first, end):
            conv, ssm = states[layer]
            c, s, gathered = self.gather(layer, loc)
            self.scatter(layer, loc, gathered, conv.to(self.dtype),
                         ssm if self.encoder is not None else ssm.to(self.dtype), keys)
