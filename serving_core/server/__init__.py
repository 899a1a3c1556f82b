"""The real serving core behind HTTP: an OpenAI- and vLLM-compatible server (completions,
chat completions, tokenize, sampling in the engine) with vLLM's Prometheus metrics over one
Engine whose loop runs in its own thread (`python -m serving_core.server`)."""
