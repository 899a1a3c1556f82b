"""The real serving core behind HTTP: an OpenAI-compatible completions server with
Prometheus metrics over one Engine whose loop runs in its own thread
(`python -m serving_core.server`)."""
