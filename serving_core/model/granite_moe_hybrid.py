"""A Granite-4.0-H-style interleaved hybrid (GraniteMoeHybrid) in torch, state held by the caller.

Each layer is either attention or a Mamba2 mixer (its `layer_types`), then a MoE block (top-k
routed experts plus a shared MLP): RMSNorm, mixer, residual add scaled by
`residual_multiplier`, RMSNorm, experts + shared MLP, scaled residual add. Attention scales
its scores by `attention_multiplier` and has no positional embedding unless
`position_embedding_type` is "rope"; logits are divided by `logits_scaling`; embeddings are
multiplied by `embedding_multiplier` (transformers'
models/granitemoehybrid/modeling_granitemoehybrid.py defines the model this equals).

State goes through the same `StateIO` as Falcon-H1 (serving_core/model/falcon_h1.py), indexed
by storage group (serving_core/layer_pattern.py): the model is g groups of one attention layer
and k Mamba2 layers (g = the attention layers, k = Mamba2 layers / g). The j-th attention
layer's KV is `io.kv(j)`; the j-th Mamba2 layer is member j % k of group j // k, whose state
`io.recurrent(j // k)` holds the k members' states stacked (conv channels k x Cd, SSM heads
k x H), so that one composite carries the group's whole recurrent state. The attributes a
StateIO sizes state by (`num_layers`, `conv_dim`, `m_heads`) are the group's; the per-layer
ones are `layer_conv_dim` and `layer_heads`. The Mamba2 kernels are Falcon-H1's
(serving_core/model/mamba.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from serving_core.model import mamba, packed_linear
from serving_core.model.config import read_config
from serving_core.model.falcon_h1 import (
    StateIO,
    _json_float,
    causal_attention,
    device_weights,
    load_checkpoint,
    model_dtype,
    rms_norm,
    rope_inv_freq,
    rotate_half,
    scan_chunk_tokens,
)
from serving_core.model.head_rows import pad_rows

MAMBA, ATTENTION = "linear_attention", "full_attention"


class GraniteMoeHybrid:
    """Weights and forward of a GraniteMoeHybrid causal LM (inference only)."""

    def __init__(self, cfg: dict, weights: dict[str, torch.Tensor], device="cpu", dtype="float32",
                 scan_chunk: int | None = None):
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = model_dtype(dtype)
        self.num_layers = int(cfg["num_hidden_layers"])
        self.layer_types = [str(t) for t in cfg["layer_types"]]
        unknown = sorted(set(self.layer_types) - {MAMBA, ATTENTION})
        if unknown or len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types={self.layer_types!r}: {self.num_layers} entries of "
                             f"{MAMBA!r} or {ATTENTION!r} expected")
        # ordinal of each layer among its kind: the StateIO index
        counts = {MAMBA: 0, ATTENTION: 0}
        self.ordinal = []
        for t in self.layer_types:
            self.ordinal.append(counts[t])
            counts[t] += 1
        self.attention_layers, self.mamba_layers = counts[ATTENTION], counts[MAMBA]
        if not self.attention_layers or self.mamba_layers % self.attention_layers:
            raise ValueError(f"layer_types: {self.mamba_layers} Mamba2 layers over "
                             f"{self.attention_layers} attention layers; the storage groups "
                             "need one attention layer and the same Mamba2 count each")
        self.total_layers = self.num_layers
        self.num_layers = self.attention_layers  # storage groups: what a StateIO indexes
        self.members = self.mamba_layers // self.attention_layers  # Mamba2 layers per group
        self.hidden = int(cfg["hidden_size"])
        self.heads = int(cfg["num_attention_heads"])
        self.kv_heads = int(cfg.get("num_key_value_heads") or self.heads)
        self.head_dim = int(cfg.get("head_dim") or self.hidden // self.heads)
        self.m_heads = int(cfg["mamba_n_heads"])
        self.d_inner = int(cfg["mamba_expand"]) * self.hidden
        self.m_head_dim = int(cfg["mamba_d_head"])
        self.d_state = int(cfg["mamba_d_state"])
        self.n_groups = int(cfg["mamba_n_groups"])
        self.d_conv = int(cfg["mamba_d_conv"])
        self.layer_conv_dim = self.d_inner + 2 * self.n_groups * self.d_state
        self.layer_heads = self.m_heads
        self.conv_dim = self.members * self.layer_conv_dim  # a group's stacked state
        self.m_heads = self.members * self.layer_heads
        self.top_k = int(cfg["num_experts_per_tok"])
        self.num_experts = int(cfg["num_local_experts"])
        self.chunk = scan_chunk_tokens(scan_chunk)
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        limit = cfg.get("time_step_limit") or (0.0, float("inf"))
        self.dt_limit = (_json_float(limit[0]), _json_float(limit[1]))
        self.embedding_multiplier = float(cfg.get("embedding_multiplier", 1.0))
        self.attention_multiplier = float(cfg.get("attention_multiplier", 1.0))
        self.residual_multiplier = float(cfg.get("residual_multiplier", 1.0))
        self.logits_scaling = float(cfg.get("logits_scaling", 1.0))
        self.rope = cfg.get("position_embedding_type") == "rope"
        if self.rope:
            self.inv_freq = rope_inv_freq(cfg, self.head_dim, self.device)
        self.w = device_weights(weights, self.device, self.dtype,
                                [i for i, t in enumerate(self.layer_types) if t == MAMBA])
        self.A = {i: -torch.exp(self.w[f"model.layers.{i}.mamba.A_log"])
                  for i, t in enumerate(self.layer_types) if t == MAMBA}
        self.packs = packed_linear.ModelPacks(
            self.w, self._linear_names(), "lm_head.weight",
            [(0, self.w["lm_head.weight"].shape[0])])

    @classmethod
    def load(cls, folder: str | Path, device="cpu", dtype="float32",
             scan_chunk: int | None = None) -> GraniteMoeHybrid:
        """Load a Hugging Face-format folder (config.json + *.safetensors)."""
        cfg = read_config(folder, "granitemoehybrid")
        weights = load_checkpoint(folder, cls.required_weights(cfg))
        return cls(cfg, weights, device, dtype, scan_chunk)

    @staticmethod
    def required_weights(cfg: dict) -> list[str]:
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        for i, t in enumerate(cfg["layer_types"]):
            p = f"model.layers.{i}."
            names += [p + n for n in (
                "input_layernorm.weight", "post_attention_layernorm.weight",
                "block_sparse_moe.input_linear.weight", "block_sparse_moe.output_linear.weight",
                "block_sparse_moe.router.layer.weight", "shared_mlp.input_linear.weight",
                "shared_mlp.output_linear.weight")]
            if t == MAMBA:
                names += [p + "mamba." + n for n in (
                    "in_proj.weight", "conv1d.weight", "out_proj.weight", "A_log", "D",
                    "dt_bias", "norm.weight")]
            else:
                names += [p + "self_attn." + n + ".weight" for n in ("q_proj", "k_proj",
                                                                      "v_proj", "o_proj")]
        if not cfg.get("tie_word_embeddings", False):
            names.append("lm_head.weight")
        return names

    def _linear_names(self) -> list[str]:
        """The weights `_lin` multiplies by (packed where that gives the plain bits)."""
        names = []
        for i, t in enumerate(self.layer_types):
            own = ("mamba.in_proj", "mamba.out_proj") if t == MAMBA else tuple(
                f"self_attn.{n}_proj" for n in "qkvo")
            names += [f"model.layers.{i}.{n}.weight"
                      for n in (*own, "shared_mlp.input_linear", "shared_mlp.output_linear")]
        return names

    # ----- forward ----------------------------------------------------------------------------
    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return packed_linear.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"),
                                    self.packs.linear.get(name + ".weight"))

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, io: StateIO,
                logits: bool = True, hidden: bool = False) -> torch.Tensor | None:
        """ids (b, T) at positions (b, T); returns the last position's logits (b, V) fp32
        (`hidden`: every position's final hidden states (b, T, D) instead, for `head`)."""
        h = F.embedding(ids, self.w["model.embed_tokens.weight"]) * self.embedding_multiplier
        cos = sin = None
        self._group_state: dict[int, tuple] = {}
        if self.rope:
            freqs = positions[..., None].float() * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos().to(self.dtype)[:, :, None], emb.sin().to(self.dtype)[:, :, None]
        for i, kind in enumerate(self.layer_types):
            p = f"model.layers.{i}."
            residual = h
            x = rms_norm(h, self.w[p + "input_layernorm.weight"], self.eps)
            if kind == MAMBA:
                y = self._mamba(i, x, io)
            else:
                y = self._attention(i, x, cos, sin, io)
            h = residual + y * self.residual_multiplier
            residual = h
            x = rms_norm(h, self.w[p + "post_attention_layernorm.weight"], self.eps)
            y = self._moe(p, x) + self._shared_mlp(p, x)
            h = residual + y * self.residual_multiplier
        if not logits:
            return None
        return h if hidden else self.head(h[:, -1])

    @torch.inference_mode()
    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits (..., V) fp32 of final hidden states (..., D)."""
        last = rms_norm(h, self.w["model.norm.weight"], self.eps)
        rows = pad_rows(last.reshape(-1, last.shape[-1]))  # batch-invariant rows
        w = self.w["lm_head.weight"]
        pieces = self.packs.head_for(w, rows.shape[0])  # one piece: the whole head
        out = (pieces[0].product(rows) if pieces else F.linear(rows, w))[: last[..., 0].numel()]
        return (out.view(*last.shape[:-1], -1) / self.logits_scaling).float()

    def _shared_mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._lin(x, p + "shared_mlp.input_linear").chunk(2, dim=-1)
        return self._lin(F.silu(gate) * up, p + "shared_mlp.output_linear")

    def _moe(self, p: str, x: torch.Tensor) -> torch.Tensor:
        """Top-k routing (softmax over the k largest router logits) and the experts' gated
        MLPs, weighted and summed per token."""
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        logits = F.linear(flat, self.w[p + "block_sparse_moe.router.layer.weight"]).float()
        top, index = logits.topk(self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1).type_as(flat)
        gate_up = self.w[p + "block_sparse_moe.input_linear.weight"]  # (E, 2 I, d)
        down = self.w[p + "block_sparse_moe.output_linear.weight"]  # (E, d, I)
        out = torch.zeros_like(flat)
        for e in torch.unique(index).tolist():
            tokens, slot = torch.where(index == e)
            gate, up = F.linear(flat[tokens], gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, down[e]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out.view(b, t, d)

    def _attention(self, i, x, cos, sin, io: StateIO) -> torch.Tensor:
        p = f"model.layers.{i}.self_attn."
        j = self.ordinal[i]
        b, t, _ = x.shape
        q = self._lin(x, p + "q_proj").view(b, t, self.heads, self.head_dim)
        k = self._lin(x, p + "k_proj").view(b, t, self.kv_heads, self.head_dim)
        v = self._lin(x, p + "v_proj").view(b, t, self.kv_heads, self.head_dim)
        if self.rope:
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        scale = self.attention_multiplier
        if t == 1 and hasattr(io, "decode_attention"):  # plain KV pages read in place
            return self._lin(io.decode_attention(j, q, k, v, scale), p + "o_proj")
        k_ctx, v_ctx, valid = io.kv(j)
        io.store_kv(j, k, v)
        c = k_ctx.shape[1]
        keys = (torch.cat([k_ctx.to(k.dtype), k], dim=1) if c else k).transpose(1, 2)
        vals = (torch.cat([v_ctx.to(v.dtype), v], dim=1) if c else v).transpose(1, 2)
        q = q.transpose(1, 2)  # (b, H, t, d)
        out = causal_attention(q, keys, vals, c, valid, scale, self.heads != self.kv_heads)
        out = out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return self._lin(out, p + "o_proj")

    def _mamba(self, i, x, io: StateIO) -> torch.Tensor:
        p = f"model.layers.{i}.mamba."
        j = self.ordinal[i]
        b, t, _ = x.shape
        proj = self._lin(x, p + "in_proj")
        heads, cd = self.layer_heads, self.layer_conv_dim
        gate, xbc, dt = proj.split([self.d_inner, cd, heads], dim=-1)
        group, member = divmod(j, self.members)
        if member == 0:
            self._group_state[group] = io.recurrent(group)
        conv_g, ssm_g = self._group_state[group]
        conv = conv_g[:, member * cd:(member + 1) * cd]  # views: updates land in the group's
        ssm = ssm_g[:, member * heads:(member + 1) * heads]
        w = self.w[p + "conv1d.weight"].squeeze(1)
        xbc, window = mamba.conv_scan(conv, xbc, w, self.w.get(p + "conv1d.bias"))
        conv.copy_(window.to(conv.dtype))
        gs = self.n_groups * self.d_state
        xs, B, C = xbc.split([self.d_inner, gs, gs], dim=-1)
        dt = mamba.discretize_dt(dt, self.w[p + "dt_bias"], self.dt_limit)
        D = self.w[p + "D"]
        if t == 1:
            y = mamba.state_update(
                ssm, xs.view(b, heads, self.m_head_dim), dt.view(b, heads),
                self.A[i], B.view(b, self.n_groups, self.d_state),
                C.view(b, self.n_groups, self.d_state), D,
            )[:, None]
        else:
            y, final = mamba.chunk_scan(
                xs.view(b, t, heads, self.m_head_dim), dt, self.A[i],
                B.view(b, t, self.n_groups, self.d_state),
                C.view(b, t, self.n_groups, self.d_state), D, self.chunk, ssm,
            )
            ssm.copy_(final)
        if member == self.members - 1:
            io.store_recurrent(group, conv_g, ssm_g)
        y = y.reshape(b, t, self.d_inner).float() * F.silu(gate.float())
        hg = y.view(b, t, self.n_groups, self.d_inner // self.n_groups)
        hg = hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.w[p + "norm.weight"] * hg.view(b, t, self.d_inner).to(self.dtype)
        return self._lin(y, p + "out_proj")
