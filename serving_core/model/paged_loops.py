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

One loop is more than the same calls: `update_pieces_fused` updates each SSM member page in one
pass, state = fma(dt x, B, state * exp(dt A)) per element, instead of `mul_` then `addcmul_`
(two passes over a 512-KiB page; the update was 1.3x faster at S2 b8 and b53,
docs/benchmarks.md). It equals them where ATen's addcmul kernel computes self + t1 * t2 as one
fused multiply-add, as this torch build's does (GCC contracts it); a build or CPU where it
does not would give other bits, so `_check_fused` compares the two on probe pages when the
loops load and uses the fused pass only if every bit agrees (`settings()["ssm_update"]`).

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

// One member page's state = fma(dtx, B, state * dA) per element, in one pass over the page:
// what `mul_` then `addcmul_` (value 1) store on a build whose addcmul kernel contracts
// self + t1 * t2 into one fused multiply-add (`fused_matches_aten` checks this build at load).
#if defined(__x86_64__) || defined(__i386__)
#define HSL_FUSED_TARGET __attribute__((target("avx2,fma")))
#else
#define HSL_FUSED_TARGET
#endif
HSL_FUSED_TARGET
static void fused_piece(float* v, const float* a, const float* x, const float* b,
                        int64_t hp, int64_t p, int64_t n) {
  for (int64_t h = 0; h < hp; ++h) {
    const float ah = a[h];
    const float* bh = b + h * n;
    for (int64_t r = 0; r < p; ++r) {
      const float xr = x[h * p + r];
      float* row = v + (h * p + r) * n;
      for (int64_t c = 0; c < n; ++c) row[c] = __builtin_fmaf(xr, bh[c], row[c] * ah);
    }
  }
}

bool fused_supported() {  // x86 with AVX2 and FMA only (elsewhere: the ATen calls)
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

static bool fusable(const at::Tensor& v, const at::Tensor& a, const at::Tensor& x,
                    const at::Tensor& b) {
  for (const at::Tensor* t : {&v, &a, &x, &b})
    if (t->scalar_type() != at::kFloat || !t->is_contiguous() || !t->device().is_cpu())
      return false;
  int64_t hp = v.size(0), p = v.size(1), n = v.size(2);
  return v.dim() == 3 && a.numel() == hp && x.numel() == hp * p && b.numel() == hp * n;
}

// update_pieces with each page's multiply and multiply-add in one pass (`fused_piece`);
// a piece it cannot take (not fp32, not contiguous) runs update_pieces' two calls.
void update_pieces_fused(const std::vector<at::Tensor>& views,
                         const std::vector<at::Tensor>& matrices, const at::Tensor& dA,
                         const at::Tensor& dtx, const at::Tensor& Bh, const at::Tensor& cs,
                         const at::Tensor& y) {
  for (size_t i = 0; i < views.size(); ++i) {
    at::Tensor v = views[i], o = y.select(0, i);
    at::Tensor a = dA.select(0, i), x = dtx.select(0, i), b = Bh.select(0, i);
    if (fusable(v, a, x, b))
      fused_piece(v.data_ptr<float>(), a.data_ptr<float>(), x.data_ptr<float>(),
                  b.data_ptr<float>(), v.size(0), v.size(1), v.size(2));
    else
      v.mul_(a).addcmul_(x, b);
    at::mv_out(o, matrices[i], cs.select(0, i));
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("attention_scores", &attention_scores, nogil);
  m.def("attention_outputs", &attention_outputs, nogil);
  m.def("update_pieces", &update_pieces, nogil);
  m.def("update_pieces_fused", &update_pieces_fused, nogil);
  m.def("fused_supported", &fused_supported);
}
"""

# No contraction in our own code (the fused pass states its one fma); -O3 vectorizes it.
CFLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno"]
_KEY = hashlib.sha256(f"{SOURCE}{CFLAGS}{torch.__version__}{sys.version_info[:2]}"
                      .encode()).hexdigest()
NAME = f"hsl_paged_loops_{_KEY[:12]}"  # a new source, flags, torch or Python: its own build

_mode: str | None = None  # None: not yet read from the environment
_loops = None
_lock = threading.Lock()  # the engine thread and the split worker may both load first
_fused = False  # the SSM update's fused pass in use (`fused_update`)
_state = {"loops": "python", "reason": "not loaded", "ssm_update": "aten"}


def install(mode: str) -> None:
    """Choose the loops (see the module docstring); loads or builds them now."""
    global _mode, _loops, _fused
    if mode not in MODES:
        raise ValueError(f"paged_loops={mode!r}: allowed values are {', '.join(MODES)}")
    _mode, _loops, _fused = mode, None, False
    _state["ssm_update"] = "aten"
    if mode == "python":
        _state.update(loops="python", reason="mode python")
        return
    if mode == "compiled":
        _loops = _build()
        _state.update(loops="compiled", reason="built")
        _check_fused()
        return
    path = CACHE / NAME / f"{NAME}.so"  # where load_inline writes it
    try:
        _loops = _import(path) if path.exists() else None
    except ImportError as err:  # a build this process cannot load: the Python loops
        _state.update(loops="python", reason=f"cached build not loadable: {err}")
        return
    _state.update(loops="compiled" if _loops else "python",
                  reason="cached build" if _loops else "no cached build")
    if _loops:
        _check_fused()


def loops():
    """The compiled loops module, or None for the Python loops."""
    if _mode is None:
        with _lock:
            if _mode is None:
                install(env_switches.value(ENV))
    return _loops


def fused_update() -> bool:
    """True when the compiled loops' one-pass SSM update (`update_pieces_fused`) is used:
    loaded, and found to store ATen's bits in this process (`_check_fused`)."""
    loops()
    return _fused


def _check_fused() -> None:
    """Use the fused SSM update only where it stores what `mul_` then `addcmul_` store here:
    the CPU has AVX2 and FMA, and on probe pages (vectorized and scalar-tail widths; values
    normal, spread over 2^+-60, subnormal, overflowing, zero) both loops give the same state
    and read-out bits. Whether ATen's addcmul kernel contracts to a fused multiply-add is a
    property of the torch build, so it is checked, not assumed."""
    global _fused
    if not _loops.fused_supported():
        _fused, _state["ssm_update"] = False, "aten (no avx2+fma)"
        return
    g = torch.Generator().manual_seed(46)
    for hp, p, n in ((4, 8, 512), (3, 5, 7), (2, 16, 24)):
        for scale in (1.0, 0.0, 1e-39, 1e30, None):
            def draw(*shape, scale=scale):
                t = torch.randn(*shape, generator=g)
                if scale is None:  # exponents spread over about 2^-60 .. 2^60
                    return t * torch.exp(30 * torch.randn(*shape, generator=g)).clamp(max=1e18)
                return t * scale
            k = 3
            ins = (draw(k, hp, 1, 1), draw(k, hp, p, 1), draw(k, hp, 1, n), draw(k, n))
            state = draw(k, hp, p, n)
            outs = []
            for update in (_loops.update_pieces, _loops.update_pieces_fused):
                s, y = state.clone(), torch.empty(k, hp * p)
                update(list(s.unbind(0)), list(s.view(k, hp * p, n).unbind(0)), *ins, y)
                outs.append((s.view(torch.int32), y.view(torch.int32)))
            (s0, y0), (s1, y1) = outs
            if not (torch.equal(s0, s1) and torch.equal(y0, y1)):
                _fused, _state["ssm_update"] = False, "aten (fused bits differ on this build)"
                return
    _fused, _state["ssm_update"] = True, "fused (bits checked at load)"


def settings() -> dict:
    """{"mode", "loops": "compiled" | "python", "reason", "ssm_update": "fused ..." |
    "aten ..."} in this process (runtime record)."""
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
    return load_inline(NAME, [SOURCE], build_directory=str(folder), extra_cflags=CFLAGS,
                       verbose=False)


if __name__ == "__main__":  # python -m serving_core.model.paged_loops: build the cache
    install("compiled")
    print(f"built {NAME} under {CACHE}")
