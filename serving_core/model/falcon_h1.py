"""The Falcon-H1 decoder in torch, with its state held by the caller.

Per layer: RMSNorm, then attention and the Mamba2 mixer in parallel on the
normed input (each with Falcon-H1's in/out multipliers), their sum added to the
residual, then RMSNorm and the gated MLP. The model keeps no KV cache and no
recurrent state: every forward reads and writes them through a `StateIO`
(paged arenas in the executor, plain tensors in tests), so state lives only
where the memory organization put it.

A forward runs a batch of b segments of equal length T (one prefill segment,
or b decode tokens) starting at per-sequence positions.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from serving_core.model import mamba, packed_linear, split
from serving_core.model.config import head_dim, mamba_head_dim, mamba_inner, read_config
from serving_core.model.head_rows import pad_rows
from serving_core.model.paged_attention import fused_decode_attention

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16}
ATTENTION_QUERY_BLOCK = 512  # queries per attention block in long prefills (bounds memory)
MASK_KEPT_FLOATS = 1 << 20  # the largest causal mask kept across calls (4 MiB; 8 kept at most)
# Tokens per chunk of the prefill SSD scan. Only rounding depends on it; 128 was fastest for
# the tiny model on a CPU core (64: same, 256: 2-2.5x slower, bench/profile_bench.py).
SCAN_CHUNK = 128
# Vocabulary rows per block of the LM head's product. Blocks write straight into the logits
# (the same dot products, bit for bit): 64 decode rows x 128,256 took 38-42 ms a step against
# 43-47 ms for one product on a CPU core, and 2-3 rows 15 ms against 21-31 ms.
HEAD_VOCAB_BLOCK = 2048
# Vocabulary blocks per packed head piece (8,192 rows of the head): each piece's product is a
# temporary that is scaled into the logits, small enough for malloc to reuse piece after
# piece (two halves of 64,128 rows doubled the heap's growth in a first serve: 96,223 page
# faults against 41,662 unpacked; pieces of 8,192: 54,066; docs/real_path.md section 4).
HEAD_PACK_BLOCKS = 4
LINEAR_NAMES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mamba.in_proj", "mamba.out_proj", "feed_forward.gate_proj",
                "feed_forward.up_proj", "feed_forward.down_proj")  # the layers' _lin products


class StateIO(Protocol):
    """Where a forward finds and leaves the state of its b sequences, per layer."""

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Cached K and V before this segment (b, c, KVH, hd) and a (b, c) validity mask
        (None when every sequence has all c positions)."""

    def store_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """K and V (b, T, KVH, hd) of the segment's tokens (after RoPE)."""

    def recurrent(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Conv window (b, conv_dim, d_conv - 1) and SSM state (b, H, P, N), fp32."""

    def store_recurrent(self, layer: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """The updated window and state (the tensors `recurrent` returned, updated)."""

    # Optional: an IO with `packed_kv = True` (TQ4 pages) stores K/V and attends itself:
    # attend(layer, q (b, T, H, hd), k, v (b, T, KVH, hd)) -> (b, T, H hd) float32.


def _json_float(value) -> float:
    """A float as transformers writes it to config.json ({"__float__": "Infinity"} for inf)."""
    if isinstance(value, dict):
        value = value.get("__float__")
    return float(value)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def causal_mask(rows: int, span: int, first: int, device: torch.device) -> torch.Tensor:
    """The additive causal mask (1, 1, rows, span) of queries at positions first .. first +
    rows - 1 over keys 0 .. span - 1: 0 where the key is at or before the query, -inf after.
    It is what scaled_dot_product_attention makes of the boolean mask (where(~mask, -inf, 0),
    per call and per head split), the same kernel input. Masks of up to MASK_KEPT_FLOATS are
    made once per shape and shared (read only) by the layers, the steps and the split's two
    threads (8 kept at most); larger ones (long contexts) are made per call."""
    if rows * span > MASK_KEPT_FLOATS:
        return _new_causal_mask(rows, span, first, device)
    return _kept_causal_mask(rows, span, first, device)


def _new_causal_mask(rows: int, span: int, first: int, device: torch.device) -> torch.Tensor:
    return torch.full((1, 1, rows, span), -torch.inf, device=device).triu_(first + 1)


_kept_causal_mask = functools.lru_cache(maxsize=8)(_new_causal_mask)


def causal_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, c: int,
                     valid: torch.Tensor | None, scale: float, gqa: bool) -> torch.Tensor:
    """Causal attention of t new queries q (b, H, t, d) over keys and values (b, KVH, c + t,
    d) whose first c positions are context; valid (b, c) masks context padding (None: all
    valid). Queries go in blocks of ATTENTION_QUERY_BLOCK, each over the keys it can see.
    Returns (b, H, t, d)."""
    b, _, t, _ = q.shape
    keep = None
    if valid is not None:
        pad = torch.ones(b, t, dtype=torch.bool, device=q.device)
        keep = torch.cat([valid, pad], dim=1)[:, None, None, :]  # (b, 1, 1, c + t)
    outs = []
    for s in range(0, t, ATTENTION_QUERY_BLOCK):
        e = min(t, s + ATTENTION_QUERY_BLOCK)
        span = c + e
        if keep is None:  # the additive form SDPA makes of the boolean mask, kept
            mask = causal_mask(e - s, span, c + s, q.device)
        else:
            qpos = torch.arange(s, e, device=q.device)[:, None] + c
            mask = (torch.arange(span, device=q.device)[None, :] <= qpos)[None, None]
            mask = mask & keep[..., :span]
        outs.append(F.scaled_dot_product_attention(
            q[:, :, s:e], keys[:, :, :span].to(q.dtype), vals[:, :, :span].to(q.dtype),
            attn_mask=mask, scale=scale, enable_gqa=gqa))
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


def vocab_product(rows: torch.Tensor, w: torch.Tensor, lo: int, hi: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """rows (n, D) @ w[lo:hi].T written into out[:, lo:hi] (out (n, V), new when None) in
    HEAD_VOCAB_BLOCK blocks, each straight into the logits (the same dot products, bit for
    bit); returns out[:, lo:hi]."""
    if out is None:
        out = torch.empty(rows.shape[0], w.shape[0], dtype=rows.dtype, device=rows.device)
    for v in range(lo, hi, HEAD_VOCAB_BLOCK):
        e = min(v + HEAD_VOCAB_BLOCK, hi)
        torch.matmul(rows, w[v:e].t(), out=out[:, v:e])
    return out[:, lo:hi]


def pack_weights(w: dict[str, torch.Tensor], num_layers: int) -> packed_linear.ModelPacks:
    """Packed copies of the layers' linear weights and of the head's pieces of
    HEAD_PACK_BLOCKS vocabulary blocks, each kept only where it gives the plain bits."""
    names = [f"model.layers.{i}.{n}.weight" for i in range(num_layers) for n in LINEAR_NAMES]
    head = w["lm_head.weight"]
    vocab = head.shape[0]
    step = HEAD_PACK_BLOCKS * HEAD_VOCAB_BLOCK
    pieces = [(v, min(v + step, vocab)) for v in range(0, vocab, step)]
    return packed_linear.ModelPacks(w, names, "lm_head.weight", pieces,
                                    lambda x, lo, hi: vocab_product(x, head, lo, hi))


def model_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a `dtype` config value; ValueError names the allowed ones."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: allowed values are {sorted(DTYPES)}")
    return DTYPES[dtype]


def scan_chunk_tokens(scan_chunk: int | None) -> int:
    """The SSD scan's chunk: `scan_chunk`, else SCAN_CHUNK (not the checkpoint's GPU chunk)."""
    chunk = int(scan_chunk or SCAN_CHUNK)
    if chunk < 1:
        raise ValueError(f"scan_chunk={scan_chunk!r}: expected an integer >= 1")
    return chunk


def rope_inv_freq(cfg: dict, head_dim: int, device: torch.device) -> torch.Tensor:
    """Default RoPE inverse frequencies of a config's rope_theta."""
    rope = cfg.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    return 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    ).to(device)


def device_weights(weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                   mamba_layers) -> dict[str, torch.Tensor]:
    """The weights on `device` in `dtype`, but each Mamba2 layer's SSM parameters (A_log, D,
    dt_bias) in fp32; an absent lm_head is tied to the embedding."""
    w = {k: v.to(device, dtype) for k, v in weights.items()}
    for i in mamba_layers:
        for k in ("A_log", "D", "dt_bias"):
            name = f"model.layers.{i}.mamba.{k}"
            w[name] = weights[name].to(device, torch.float32)
    if "lm_head.weight" not in w:
        w["lm_head.weight"] = w["model.embed_tokens.weight"]  # tied
    return w


def load_checkpoint(folder: str | Path, required: list[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's *.safetensors; ValueError when there are none or one of
    `required` is missing."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"checkpoint={str(folder)!r}: no *.safetensors weights next to config.json"
        )
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    missing = [k for k in required if k not in weights]
    if missing:
        raise ValueError(
            f"checkpoint={str(folder)!r}: weights missing {len(missing)} tensors "
            f"(first: {missing[0]})"
        )
    return weights


class FalconH1:
    """Weights and forward of a Falcon-H1 causal LM (inference only)."""

    def __init__(self, cfg: dict, weights: dict[str, torch.Tensor], device="cpu", dtype="float32",
                 scan_chunk: int | None = None):
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = model_dtype(dtype)
        self.num_layers = int(cfg["num_hidden_layers"])
        self.hidden = int(cfg["hidden_size"])
        self.heads = int(cfg["num_attention_heads"])
        self.kv_heads = int(cfg.get("num_key_value_heads") or self.heads)
        self.head_dim = head_dim(cfg)
        self.m_heads = int(cfg["mamba_n_heads"])
        self.m_head_dim = mamba_head_dim(cfg)
        self.d_inner = mamba_inner(cfg)
        self.d_state = int(cfg["mamba_d_state"])
        self.n_groups = int(cfg["mamba_n_groups"])
        self.d_conv = int(cfg["mamba_d_conv"])
        self.conv_dim = self.d_inner + 2 * self.n_groups * self.d_state
        self.chunk = scan_chunk_tokens(scan_chunk)
        self.eps = float(cfg.get("rms_norm_eps", 1e-5))
        self.rms_gated = bool(cfg.get("mamba_rms_norm", False))
        self.norm_before_gate = bool(cfg.get("mamba_norm_before_gate", True))
        limit = cfg.get("time_step_limit") or (0.0, float("inf"))
        self.dt_limit = (_json_float(limit[0]), _json_float(limit[1]))
        self.mult = {
            k: float(cfg.get(k, 1.0) if cfg.get(k) is not None else 1.0)
            for k in ("embedding_multiplier", "lm_head_multiplier", "key_multiplier",
                      "attention_in_multiplier", "attention_out_multiplier",
                      "ssm_in_multiplier", "ssm_out_multiplier")
        }
        self.mlp_mult = [float(v) for v in (cfg.get("mlp_multipliers") or [1.0, 1.0])]
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type={rope.get('rope_type')!r}: only 'default' is supported")
        self.inv_freq = rope_inv_freq(cfg, self.head_dim, self.device)
        self.w = device_weights(weights, self.device, self.dtype, range(self.num_layers))
        self.mup = self._mup_vector().to(self.device, self.dtype)
        self.A = [
            -torch.exp(self.w[f"model.layers.{i}.mamba.A_log"]) for i in range(self.num_layers)
        ]
        self.packs = pack_weights(self.w, self.num_layers)

    # ----- construction -----------------------------------------------------------------------
    def _mup_vector(self) -> torch.Tensor:
        m = [float(v) for v in (self.cfg.get("ssm_multipliers") or [1.0] * 5)]
        i, gs = self.d_inner, self.n_groups * self.d_state
        sizes = [i, i, gs, gs, self.m_heads]
        return torch.cat([torch.full((n,), v) for n, v in zip(sizes, m, strict=True)])

    @classmethod
    def load(cls, folder: str | Path, device="cpu", dtype="float32",
             scan_chunk: int | None = None) -> FalconH1:
        """Load a Hugging Face-format folder (config.json + *.safetensors)."""
        cfg = read_config(folder)
        weights = load_checkpoint(folder, cls.required_weights(cfg))
        return cls(cfg, weights, device, dtype, scan_chunk)

    @staticmethod
    def required_weights(cfg: dict) -> list[str]:
        names = ["model.embed_tokens.weight", "model.final_layernorm.weight"]
        for i in range(int(cfg["num_hidden_layers"])):
            p = f"model.layers.{i}."
            names += [p + n for n in (
                "input_layernorm.weight", "pre_ff_layernorm.weight",
                "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mamba.in_proj.weight", "mamba.conv1d.weight",
                "mamba.out_proj.weight", "mamba.A_log", "mamba.D", "mamba.dt_bias",
                "feed_forward.gate_proj.weight", "feed_forward.up_proj.weight",
                "feed_forward.down_proj.weight")]
            if cfg.get("mamba_rms_norm"):
                names.append(p + "mamba.norm.weight")
        if not cfg.get("tie_word_embeddings", False):
            names.append("lm_head.weight")
        return names

    # ----- forward ----------------------------------------------------------------------------
    def _lin(self, x: torch.Tensor, name: str, scale: torch.Tensor | None = None
             ) -> torch.Tensor:
        return split.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"),
                            self.packs.linear.get(name + ".weight"), scale)

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, io: StateIO, logits: bool = True,
        hidden: bool = False,
    ) -> torch.Tensor | None:
        """ids (b, T) at positions (b, T); returns the last position's logits (b, V) fp32
        (`hidden`: every position's final hidden states (b, T, D) instead, for `head`)."""
        h = F.embedding(ids, self.w["model.embed_tokens.weight"])
        h = h * self.mult["embedding_multiplier"]
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(self.dtype)[:, :, None], emb.sin().to(self.dtype)[:, :, None]
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            residual = h
            x = rms_norm(h, self.w[p + "input_layernorm.weight"], self.eps)
            m, a = split.layer_pair(  # independent: on two threads with the split worker
                lambda x=x, i=i: self._mamba(i, x, io) * self.mult["ssm_out_multiplier"],
                lambda x=x, i=i: self._attention(i, x * self.mult["attention_in_multiplier"],
                                                 cos, sin, io), *ids.shape)
            h = residual + (m + a * self.mult["attention_out_multiplier"])
            residual = h
            x = rms_norm(h, self.w[p + "pre_ff_layernorm.weight"], self.eps)
            # In place on the products' fresh outputs: the same operations, no temporaries.
            gate = F.silu(self._lin(x, p + "feed_forward.gate_proj").mul_(self.mlp_mult[0]),
                          inplace=True)
            y = self._lin(x, p + "feed_forward.up_proj").mul_(gate)
            y = self._lin(y, p + "feed_forward.down_proj")
            h = residual + y.mul_(self.mlp_mult[1])
        if not logits:
            return None
        return h if hidden else self.head(h[:, -1])

    @torch.inference_mode()
    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits (..., V) fp32 of final hidden states (..., D)."""
        last = rms_norm(h, self.w["model.final_layernorm.weight"], self.eps)
        rows = pad_rows(last.reshape(-1, last.shape[-1]))  # batch-invariant rows
        w, n = self.w["lm_head.weight"], last[..., 0].numel()
        scale = self.mult["lm_head_multiplier"]
        pieces = self.packs.head_for(w, rows.shape[0])
        if pieces:  # each piece's product scaled straight into the logits (the same bits)
            out = torch.empty(n, w.shape[0], dtype=rows.dtype, device=rows.device)

            def packed(first: int, end: int) -> None:
                for e in pieces[first:end]:
                    torch.mul(e.product(rows)[:n], scale, out=out[:, e.lo : e.hi])

            split.head_blocks(rows.shape[0], len(pieces), packed)
            return out.view(*last.shape[:-1], w.shape[0]).float()
        out = torch.empty(rows.shape[0], w.shape[0], dtype=rows.dtype, device=rows.device)
        split.head_blocks(rows.shape[0], -(-w.shape[0] // HEAD_VOCAB_BLOCK), lambda first, end:
                          vocab_product(rows, w, first * HEAD_VOCAB_BLOCK,
                                        min(end * HEAD_VOCAB_BLOCK, w.shape[0]), out))
        out = out[:n].view(*last.shape[:-1], w.shape[0])
        return out.mul_(scale).float()

    def _attention(self, i, x, cos, sin, io: StateIO) -> torch.Tensor:
        p = f"model.layers.{i}.self_attn."
        b, t, _ = x.shape

        def query():
            q = self._lin(x, p + "q_proj").view(b, t, self.heads, self.head_dim)
            return q * cos + rotate_half(q) * sin

        def key_value():
            k = self._lin(x, p + "k_proj").view(b, t, self.kv_heads, self.head_dim)
            k = k * self.mult["key_multiplier"]
            v = self._lin(x, p + "v_proj").view(b, t, self.kv_heads, self.head_dim)
            return k * cos + rotate_half(k) * sin, v

        # Independent: the key and value side on the split worker in a long prefill.
        q, (k, v) = split.tasks(query, key_value) if split.projections(t) \
            else (query(), key_value())
        if getattr(io, "packed_kv", False):  # compressed pages: the IO attends over them
            return self._lin(io.attend(i, q, k, v).to(x.dtype), p + "o_proj")
        if t == 1 and hasattr(io, "decode_attention"):  # plain KV pages read in place
            return self._lin(io.decode_attention(i, q, k, v, self.head_dim ** -0.5),
                             p + "o_proj")
        if t == 1 and hasattr(io, "decode_kv"):
            return self._lin(self._decode_attention(q, *io.decode_kv(i, k, v)), p + "o_proj")
        k_ctx, v_ctx, valid = io.kv(i)
        io.store_kv(i, k, v)
        c = k_ctx.shape[1]
        keys = torch.cat([k_ctx.to(k.dtype), k], dim=1) if c else k
        vals = torch.cat([v_ctx.to(v.dtype), v], dim=1) if c else v
        # Fused attention (torch's CPU flash kernel, GQA without repeating K/V) over each block
        # of queries against the context and the block's own causal prefix.
        keys = keys.transpose(1, 2)  # (b, KVH, c + t, d)
        vals = vals.transpose(1, 2)
        q = q.transpose(1, 2)  # (b, H, t, d)
        scale = self.head_dim ** -0.5
        out = split.attention_heads(causal_attention, q, keys, vals, c, valid, scale,
                                    self.heads != self.kv_heads)
        out = out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return self._lin(out, p + "o_proj")

    def _decode_attention(self, q, keys, vals, valid) -> torch.Tensor:
        """One query per sequence q (b, 1, H, d) over K, V (b, KVH, S, d) (any strides) that
        include the query's own token; valid (b, S) masks padding (None: all valid)."""
        return fused_decode_attention(q, keys, vals, valid, self.head_dim ** -0.5)

    def _mamba(self, i, x, io: StateIO) -> torch.Tensor:
        p = f"model.layers.{i}.mamba."
        b, t, _ = x.shape
        # mup scaled in place on each half of a split product (split.linear's `scale`)
        proj = self._lin(x * self.mult["ssm_in_multiplier"], p + "in_proj", self.mup)
        gate, xbc, dt = proj.split([self.d_inner, self.conv_dim, self.m_heads], dim=-1)
        conv, ssm = io.recurrent(i)
        w = self.w[p + "conv1d.weight"].squeeze(1)
        xbc, window = mamba.conv_scan(conv, xbc, w, self.w.get(p + "conv1d.bias"),
                                      rows=split.token_halves)
        conv.copy_(window.to(conv.dtype))
        gs = self.n_groups * self.d_state
        xs, B, C = xbc.split([self.d_inner, gs, gs], dim=-1)
        dt = mamba.discretize_dt(dt, self.w[p + "dt_bias"], self.dt_limit)
        D = self.w[p + "D"]
        if t == 1:
            y = mamba.state_update(
                ssm, xs.view(b, self.m_heads, self.m_head_dim), dt.view(b, self.m_heads),
                self.A[i], B.view(b, self.n_groups, self.d_state),
                C.view(b, self.n_groups, self.d_state), D,
            )[:, None]
        else:
            initial = ssm if isinstance(ssm, torch.Tensor) else ssm.read()  # paged: copy in
            # The final state is written over the initial one (read first); a plain state
            # tensor is then updated where it is (copy_ of a tensor onto itself does nothing).
            y, final = split.scan_heads(
                mamba.chunk_scan, xs.view(b, t, self.m_heads, self.m_head_dim), dt, self.A[i],
                B.view(b, t, self.n_groups, self.d_state),
                C.view(b, t, self.n_groups, self.d_state),
                D, self.chunk, initial, final=initial,
            )
            ssm.copy_(final)
        io.store_recurrent(i, conv, ssm)
        y = y.reshape(b, t, self.d_inner)
        if self.rms_gated:
            y = self._gated_norm(y, gate, self.w[p + "norm.weight"])
        else:
            y = y * F.silu(gate.float())
        return self._lin(y.to(self.dtype), p + "out_proj")

    def _gated_norm(self, y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor):
        """The gated RMS norm of y (b, T, d) per group, by rows: in two halves of the tokens
        over the worker where split.token_halves cuts them (the bits of the whole)."""
        dtype = y.dtype
        b, t, d = y.shape
        out = torch.empty(b, t, d, dtype=torch.float32, device=y.device)

        def run(first: int, end: int) -> None:
            self._gated_norm_rows(y[:, first:end], gate[:, first:end], weight,
                                  out[:, first:end])

        split.token_halves(t, d, run)
        return out.to(dtype)

    def _gated_norm_rows(self, y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                         out: torch.Tensor) -> None:
        """`_gated_norm` of rows y, gate (b, n, d), written into out (b, n, d) fp32."""
        if not self.norm_before_gate:
            y = y * F.silu(gate.float())
        b, n, d = y.shape
        h = y.float().view(b, n, self.n_groups, d // self.n_groups)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        w = weight.view(self.n_groups, d // self.n_groups)
        if self.norm_before_gate:
            torch.mul((w * h).view(b, n, d), F.silu(gate.float()), out=out)
        else:
            torch.mul(w, h, out=out.view(b, n, self.n_groups, d // self.n_groups))
