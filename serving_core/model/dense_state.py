"""Contiguous per-sequence state for the model: the reference the paged arenas must equal.

Each sequence owns a growing KV tensor per layer and a contiguous conv window and
SSM state per layer, as a single-request engine (or transformers' cache) keeps them.
"""

from __future__ import annotations

import torch


class DenseState:
    """KV and recurrent state of `batch` sequences advanced together (equal lengths)."""

    def __init__(self, model, batch: int = 1, state_dtype=torch.float32) -> None:
        dev = model.device
        self.k = [torch.zeros(batch, 0, model.kv_heads, model.head_dim, dtype=model.dtype,
                              device=dev) for _ in range(model.num_layers)]
        self.v = [t.clone() for t in self.k]
        self.conv = [torch.zeros(batch, model.conv_dim, model.d_conv - 1, dtype=state_dtype,
                                 device=dev) for _ in range(model.num_layers)]
        self.ssm = [torch.zeros(batch, model.m_heads, model.m_head_dim, model.d_state,
                                dtype=state_dtype, device=dev) for _ in range(model.num_layers)]
        self.length = 0

    def kv(self, layer):
        return self.k[layer], self.v[layer], None

    def store_kv(self, layer, k, v):
        self.k[layer] = torch.cat([self.k[layer], k], dim=1)
        self.v[layer] = torch.cat([self.v[layer], v], dim=1)

    def recurrent(self, layer):
        return self.conv[layer], self.ssm[layer]

    def store_recurrent(self, layer, conv, ssm):
        pass  # updated in place

    def run(self, model, ids: torch.Tensor, logits: bool = True):
        """Advance every sequence by ids (b, T); the last position's logits."""
        t = ids.shape[1]
        pos = torch.arange(self.length, self.length + t, device=ids.device).expand(ids.shape[0], t)
        out = model.forward(ids, pos, self, logits)
        self.length += t
        return out

