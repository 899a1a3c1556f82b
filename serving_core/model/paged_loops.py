"""The paged decode's per-page loops run from C++ instead of Python: the same ATen calls.

A paged decode step calls small ATen ops per page: per sequence and layer, one `bmm` per KV
page for the scores and one `bmm` / `baddbmm_` per page for the output
(serving_core/model/paged_attention.py), and per SSM member page `mul_`, `addcmul_` and
`mv` (mamba._update_pieces). At b = 53 that is about 1,500 calls a step more than the
contiguous path makes, each paying Python's argument parsing. Here the same loops are a C++
extension that makes the same calls (`at::bmm_out`, `baddbmm_`, `mul_`, `addcmul_`,
`at::mv_out`) on the same views (`select` / `narrow` of the same tensors: the sizes, strides
and offsets of Python's indexing) in the same order, so the same kernels and the same bits by
construction (tests/test_paged_loops.py checks them against the Python loops). The GIL is
released while a loop runs (the split worker's mixer runs beside the engine thread's
attention).

Modes (`HSL_PAGED_LOOPS`, or `install(mode)`):
- `auto` (default): the compiled loops when their build is already in the cache
  (`.cache/paged_loops/` under the repository; `python -m serving_core.model.paged_loops`
  builds it), else the Python loops. A clean clone's test suite never compiles.
- `compiled`: build (g++ and ninja, about a minute once) or load the cached build.
- `python`: the Python loops.
`settings()` says which loops this process runs (read back, for the runtime record).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import threading
from pathlib import Path

import torch

from serving_core import env_switches

ENV = env_switches.PAGED_LOOPS
MODES = env_switches.ALLOWED[ENV]
CACHE = Path(__file__).resolve().parents[2] / ".cache" / "paged_loops"

SOURCE = r"""
#include <torch/extension.h>
#include <vector>

using Ids = std::vector<int64_t>;

// paged_attention.decode_attention's score loop: per row i, one bmm per page into the
// page's columns of the row's scores (the last page cut to its valid tokens).
void attention_scores(const at::Tensor& qs, const at::Tensor& keys_t, const at::Tensor& s,
                      const Ids& units, const Ids& starts, const Ids& lasts, int64_t bt) {
  for (size_t i = 0; i + 1 < starts.size(); ++i) {
    at::Tensor qi = qs.select(0, i), row = s.select(0, i);
    int64_t first = starts[i], n = starts[i + 1] - first - 1, last = lasts[i];
    for (int64_t j = 0; j < n; ++j) {
      at::Tensor col = row.narrow(-1, j * bt, bt);
      at::bmm_out(col, qi, keys_t.select(0, units[first + j]));
    }
    at::Tensor col = row.narrow(-1, n * bt, last);
    at::bmm_out(col, qi, keys_t.select(0, units[first + n]).narrow(-1, 0, last));
  }
}

// Its output loop: per row, the first page's product, then one baddbmm_ per further page.
void attention_outputs(const at::Tensor& p, const at::Tensor& vals, const at::Tensor& out,
                       const Ids& units, const Ids& starts, const Ids& lasts, int64_t bt) {
  for (size_t i = 0; i + 1 < starts.size(); ++i) {
    at::Tensor o = out.select(0, i), row = p.select(0, i);
    int64_t first = starts[i], n = starts[i + 1] - first - 1, last = lasts[i];
    if (n == 0) {
      at::bmm_out(o, row.narrow(-1, 0, last), vals.select(0, units[first]).narrow(1, 0, last));
      continue;
    }
    at::bmm_out(o, row.narrow(-1, 0, bt), vals.select(0, units[first]));
    for (int64_t j = 1; j < n; ++j)
      o.baddbmm_(row.narrow(-1, j * bt, bt), vals.select(0, units[first + j]));
    o.baddbmm_(row.narrow(-1, n * bt, last), vals.select(0, units[first + n]).narrow(1, 0, last));
  }
}

// mamba._update_pieces's loop: per piece, state *= dA; state += dtx B; y = state C.
void update_pieces(const std::vector<at::Tensor>& views, const std::vector<at::Tensor>& matrices,
                   const at::Tensor& dA, const at::Tensor& dtx, const at::Tensor& Bh,
                   const at::Tensor& cs, const at::Tensor& y) {
  for (size_t i = 0; i < views.size(); ++i) {
    at::Tensor v = views[i], o = y.select(0, i);
    v.mul_(dA.select(0, i)).addcmul_(dtx.select(0, i), Bh.select(0, i));
    at::mv_out(o, matrices[i], cs.select(0, i));
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("attention_scores", &attention_scores, nogil);
  m.def("attention_outputs", &attention_outputs, nogil);
  m.def("update_pieces", &update_pieces, nogil);
}
"""

_KEY = hashlib.sha256(f"{SOURCE}{torch.__version__}{sys.version_info[:2]}".encode()).hexdigest()
NAME = f"hsl_paged_loops_{_KEY[:12]}"  # a new source, torch or Python: its own build

_mode: str | None = None  # None: not yet read from the environment
_loops = None
_lock = threading.Lock()  # the engine thread and the split worker may both load first
_state = {"loops": "python", "reason": "not loaded"}


def install(mode: str) -> None:
    """Choose the loops (see the module docstring); loads or builds them now."""
    global _mode, _loops
    if mode not in MODES:
        raise ValueError(f"paged_loops={mode!r}: allowed values are {', '.join(MODES)}")
    _mode, _loops = mode, None
    if mode == "python":
        _state.update(loops="python", reason="mode python")
        return
    if mode == "compiled":
        _loops = _build()
        _state.update(loops="compiled", reason="built")
        return
    path = CACHE / NAME / f"{NAME}.so"  # where load_inline writes it
    try:
        _loops = _import(path) if path.exists() else None
    except ImportError as err:  # a build this process cannot load: the Python loops
        _state.update(loops="python", reason=f"cached build not loadable: {err}")
        return
    _state.update(loops="compiled" if _loops else "python",
                  reason="cached build" if _loops else "no cached build")


def loops():
    """The compiled loops module, or None for the Python loops."""
    if _mode is None:
        with _lock:
            if _mode is None:
                install(env_switches.value(ENV))
    return _loops


def settings() -> dict:
    """{"mode", "loops": "compiled" | "python", "reason"} in this process (runtime record)."""
    loops()
    return {"mode": _mode, **_state}


def _import(path: Path):
    if NAME in sys.modules:  # loaded before in this process
        return sys.modules[NAME]
    spec = importlib.util.spec_from_file_location(NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[NAME] = module
    return module


def _build():
    """Build (or reuse) the extension under CACHE; raises if it cannot be built."""
    from torch.utils.cpp_extension import load_inline

    folder = CACHE / NAME
    folder.mkdir(parents=True, exist_ok=True)
    return load_inline(NAME, [SOURCE], build_directory=str(folder), extra_cflags=["-O2"],
                       verbose=False)


if __name__ == "__main__":  # python -m serving_core.model.paged_loops: build the cache
    install("compiled")
    print(f"built {NAME} under {CACHE}")
