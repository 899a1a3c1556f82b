"""The tiny Falcon-H1 checkpoint a real-path benchmark runs on."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

MODEL = "falcon_h1_tiny"


@contextlib.contextmanager
def tiny_checkpoint(path: str | Path) -> Iterator[Path]:
    """`path` when it holds a checkpoint (config.json), else a random-weight tiny one built
    offline in a temporary folder that is removed when the block ends."""
    path = Path(path)
    if (path / "config.json").exists():
        if not (path / "tokenizer.json").exists():  # built before the tokenizer files were
            from serving_core.model.hf_tokenizer import write_tokenizer

            write_tokenizer(path)
        yield path
        return
    from serving_core.model.make_tiny import build

    with tempfile.TemporaryDirectory(prefix="hsl-tiny-") as tmp:
        yield Path(build(tmp, MODEL))
