"""Random Falcon-H1 weights drawn directly on a device, from a conf/model/ preset.

A timing run at the real geometry (Falcon-H1-7B: 7.6 G parameters, about 15 GB in bf16)
needs weights of the right shapes, not trained ones, and nothing may be downloaded: this
draws them on the target device in its dtype (no host copy, no checkpoint written), in
seconds. The shapes are transformers' FalconH1ForCausalLM state dict for the same config
(tests/test_device_check.py compares them on the meta device); the SSM parameters follow its
initialisation (A_log = log U(1, 16), dt_bias the inverse softplus of a log-uniform step in
[1e-3, 1e-1], D = 1) so the recurrence decays as a trained model's does; every matrix is
N(0, 0.02). The tiny checkpoint (serving_core/model/make_tiny.py) stays the reference for
exactness: these weights are for steps whose time, not tokens, is measured.
"""

from __future__ import annotations

import math

import torch

from serving_core.model.make_tiny import hf_config_kwargs, preset

INIT_STD = 0.02


def preset_config(model: str) -> dict:
    """The config.json fields (transformers' FalconH1Config names) of a preset."""
    cfg = hf_config_kwargs(preset(model))
    cfg.setdefault("mamba_conv_bias", True)
    cfg.setdefault("mamba_proj_bias", False)
    cfg.setdefault("attention_bias", False)
    cfg.setdefault("projectors_bias", False)
    return {"model_type": "falcon_h1", **cfg}


def weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the state dict and its shape (lm_head only when untied)."""
    hid = int(cfg["hidden_size"])
    heads, kvh, hd = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]), int(
        cfg["head_dim"])
    mh = int(cfg["mamba_n_heads"])
    inner = int(cfg.get("mamba_d_ssm") or mh * int(cfg["mamba_d_head"]))
    gs = int(cfg["mamba_n_groups"]) * int(cfg["mamba_d_state"])
    conv_dim = inner + 2 * gs
    inter = int(cfg["intermediate_size"])
    vocab = int(cfg["vocab_size"])
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hid),
                                          "model.final_layernorm.weight": (hid,)}
    for i in range(int(cfg["num_hidden_layers"])):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hid,), p + "pre_ff_layernorm.weight": (hid,),
            p + "self_attn.q_proj.weight": (heads * hd, hid),
            p + "self_attn.k_proj.weight": (kvh * hd, hid),
            p + "self_attn.v_proj.weight": (kvh * hd, hid),
            p + "self_attn.o_proj.weight": (hid, heads * hd),
            p + "mamba.in_proj.weight": (inner + conv_dim + mh, hid),
            p + "mamba.conv1d.weight": (conv_dim, 1, int(cfg["mamba_d_conv"])),
            p + "mamba.out_proj.weight": (hid, inner),
            p + "mamba.A_log": (mh,), p + "mamba.D": (mh,), p + "mamba.dt_bias": (mh,),
            p + "feed_forward.gate_proj.weight": (inter, hid),
            p + "feed_forward.up_proj.weight": (inter, hid),
            p + "feed_forward.down_proj.weight": (hid, inter),
        })
        if cfg.get("mamba_conv_bias", True):
            shapes[p + "mamba.conv1d.bias"] = (conv_dim,)
        if cfg.get("mamba_rms_norm"):
            shapes[p + "mamba.norm.weight"] = (inner,)
    if not cfg.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hid)
    return shapes


def random_weights(cfg: dict, device: torch.device | str, dtype: torch.dtype,
                   seed: int = 0) -> dict[str, torch.Tensor]:
    """The state dict of `cfg` drawn on `device` from one seeded generator there: matrices
    and conv filters N(0, INIT_STD) in `dtype`, norms 1 in `dtype`, SSM parameters fp32."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(cfg).items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            u = torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=gen)
            out[name] = u.log_()
        elif leaf == "dt_bias":
            dt = torch.empty(shape, device=device).uniform_(math.log(1e-3), math.log(1e-1),
                                                            generator=gen).exp_()
            out[name] = dt + torch.log(-torch.expm1(-dt))  # softplus(dt_bias) = dt
        elif leaf == "D":
            out[name] = torch.ones(shape, device=device)
        elif "norm" in name and len(shape) == 1:
            out[name] = torch.ones(shape, device=device, dtype=dtype)
        elif name.endswith(".bias"):
            out[name] = torch.zeros(shape, device=device, dtype=dtype)
        else:
            out[name] = torch.empty(shape, device=device, dtype=dtype).normal_(
                0.0, INIT_STD, generator=gen)
    return out


def random_model(model: str, device: torch.device | str = "cpu", dtype: str | None = None,
                 seed: int = 0, scan_chunk: int | None = None):
    """A FalconH1 of preset `model` with random weights on `device`; dtype defaults to the
    preset's storage dtype (bf16 for dtype_bytes 2, fp32 for 4)."""
    from serving_core.model.falcon_h1 import DTYPES, FalconH1

    cfg = preset_config(model)
    if dtype is None:
        dtype = {2: "bfloat16", 4: "float32"}[int(preset(model)["dtype_bytes"])]
    weights = random_weights(cfg, device, DTYPES[dtype], seed)
    return FalconH1(cfg, weights, device=device, dtype=dtype, scan_chunk=scan_chunk)


def write_checkpoint(out, model: str, seed: int = 0):
    """A Hugging Face-format folder (config.json + model.safetensors) of preset `model` with
    weights from `random_weights` on the CPU, written without transformers: the checkpoint
    where transformers' own builder (make_tiny.build) cannot run, for transformers or our
    loader to read."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from serving_core.model.falcon_h1 import DTYPES

    cfg = preset_config(model)
    dtype = {2: "bfloat16", 4: "float32"}[int(preset(model)["dtype_bytes"])]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = random_weights(cfg, "cpu", DTYPES[dtype], seed)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = {"architectures": ["FalconH1ForCausalLM"], "torch_dtype": dtype, **cfg}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
