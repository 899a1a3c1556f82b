"""Build a random-weight Falcon-H1 checkpoint offline from a conf/model/ preset.

`python -m serving_core.model.make_tiny OUT [--model falcon_h1_tiny] [--seed 0]` writes
config.json and model.safetensors with transformers' own FalconH1ForCausalLM, so the
checkpoint is what the reference implementation loads, and (a model over Llama-3's
vocabulary) the llama3 tokenizer as Hugging Face files (serving_core/model/hf_tokenizer.py),
so clients that tokenize and vLLM serving text find it. Seeded; no network.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from serving_core.geometry import ARCHITECTURE_KEY, MODEL_CONF_DIR, available_models

DEFAULT_MODEL = "falcon_h1_tiny"
LLAMA3_VOCAB = 128_256


def preset(model: str) -> dict:
    path = MODEL_CONF_DIR / f"{model}.yaml"
    if not path.exists():
        raise ValueError(f"model={model!r}: allowed values are {available_models()}")
    data = yaml.safe_load(path.read_text())
    if ARCHITECTURE_KEY not in data:
        raise ValueError(
            f"model={model!r} has no '{ARCHITECTURE_KEY}' section to build weights from"
        )
    return data


def hf_config_kwargs(data: dict) -> dict:
    """FalconH1Config arguments from a preset's geometry fields and architecture section."""
    arch = dict(data[ARCHITECTURE_KEY])
    theta = arch.pop("rope_theta", 10000.0)
    inner = arch.get("mamba_d_ssm", data["mamba_heads"] * data["mamba_head_dim"])
    if inner != data["mamba_heads"] * data["mamba_head_dim"]:
        raise ValueError(
            f"model={data['name']!r}: mamba_d_ssm={inner} != mamba_heads x mamba_head_dim"
        )
    return {
        **arch,
        "hidden_size": data["hidden_size"],
        "num_hidden_layers": data["num_layers"],
        "num_attention_heads": data["num_attention_heads"],
        "num_key_value_heads": data["num_kv_heads"],
        "head_dim": data["head_dim"],
        "mamba_n_heads": data["mamba_heads"],
        "mamba_d_head": data["mamba_head_dim"],
        "mamba_d_state": data["d_state"],
        "mamba_n_groups": data["n_groups"],
        "mamba_d_conv": data["d_conv"],
        "max_position_embeddings": data["max_model_len"],
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
    }


def build(out: str | Path, model: str = DEFAULT_MODEL, seed: int = 0,
          tokenizer: bool = True) -> Path:
    """Write the checkpoint folder `out` and return it; `tokenizer=False` leaves out the
    tokenizer files (checks that feed token ids, on machines without quicktok)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import FalconH1Config, FalconH1ForCausalLM

    data = preset(model)
    dtype = {4: torch.float32, 2: torch.bfloat16}[int(data["dtype_bytes"])]
    config = FalconH1Config(**hf_config_kwargs(data))
    torch.manual_seed(seed)
    net = FalconH1ForCausalLM(config).to(dtype)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    net.save_pretrained(out)
    if tokenizer and config.vocab_size == LLAMA3_VOCAB:
        from serving_core.model.hf_tokenizer import write_tokenizer

        write_tokenizer(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving_core.model.make_tiny",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output folder")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"one of {available_models()}")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        out = build(args.out, args.model, args.seed)
    except ValueError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({args.model}, seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
