"""The real model: Falcon-H1 in torch, loaded from a Hugging Face-format folder."""
