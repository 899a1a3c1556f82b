"""Shared fixtures: compose the project's Hydra config without a command line; build the
expensive things (the tiny checkpoint, the analysis ledger) once per test run.

Under pytest-xdist (`make test` runs `-n <workers>`) every worker is its own process with
its own session fixtures; `build_once` lets the first worker that needs a build make it
in the directory the workers share, under a file lock, and the others read it back.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import pickle
import resource
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from run_order import load_costs, order_items

from serving_core.geometry import load_geometry

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
T = TypeVar("T")

# One compute thread per test process (and per process a test starts): xdist's workers
# already fill the cores, the tests' models are tiny, and torch's spinning OpenMP threads on
# a loaded machine cost many times the work itself (the reference-model tests: 45 s of CPU
# with one thread, minutes with two under load). Set before any test imports torch.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")


# Ledger writes without fsync (ledgers/writer.py `HSL_LEDGER_SYNC`), here and in every process
# a test starts: the files still land by temp-then-rename, and a test never loses power. Each
# fsync waited 1-4 ms on this machine's disk, a dozen per run written, thousands of runs.
os.environ.setdefault("HSL_LEDGER_SYNC", "off")


# Bytecode written and reused even where the environment sets PYTHONDONTWRITEBYTECODE: without
# it every test process and every interpreter a test starts (servers, `python -m` commands,
# make targets) compiles the project's modules from source again, and pytest rewrites the
# asserts of every test module again in each worker (about 0.3 CPU s per interpreter start,
# 2.6 per worker's collection). The files go to the usual __pycache__ folders (gitignored).
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


# Fewer cyclic garbage collections per test process: the suite keeps large live heaps (composed
# campaign plans, torch modules, pandas frames), and at Python's default thresholds (700, 10,
# 10) each full collection walks all of it: a quarter of the CPU of the config-heavy files
# (test_campaign_plans, test_one_engine, test_memory_invariants: 28 of 104 CPU s in the
# collector, 11 at these thresholds; peak memory +8 %). What the tests compute is unchanged.
gc.set_threshold(50_000, 20, 100)


def pytest_configure(config):
    """xdist keeps the files in collection order (`pytest_collection_modifyitems` below puts
    the costliest first) instead of reordering them by their number of tests."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """Costliest files first (tests/run_order.py), so the cheap ones fill the workers' tail."""
    order_items(items, load_costs())


CPU_LOG_ENV = "HSL_TEST_CPU_LOG"


def _cpu_seconds() -> tuple[float, float]:
    """CPU seconds of this process, and of the children it has waited for."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """`HSL_TEST_CPU_LOG=<file>`: append each test's CPU seconds (setup, call and teardown,
    its subprocesses included) as a JSON line: on a shared, loaded machine wall durations
    say more about the neighbours than about the test. `children_cpu_s`: the part spent in
    the processes it started and waited for (servers, `python -m` commands, make)."""
    path = os.environ.get(CPU_LOG_ENV)
    if not path:
        return (yield)
    start, wall = _cpu_seconds(), time.perf_counter()
    try:
        return (yield)
    finally:
        (me, kids), (me0, kids0) = _cpu_seconds(), start
        row = {"test": item.nodeid, "cpu_s": round(me + kids - me0 - kids0, 3),
               "children_cpu_s": round(kids - kids0, 3),
               "wall_s": round(time.perf_counter() - wall, 3),
               "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


_YAML_LOADS: dict[tuple[str, int, int], bytes] = {}  # the parsed file, pickled
_omegaconf_load = OmegaConf.load


def _memo_load(file_):
    """OmegaConf.load with each YAML file parsed once per test process (keyed by real path,
    mtime and size, so an edited file is parsed again), returning a fresh copy (unpickled:
    a third of the CPU of `copy.deepcopy` on OmegaConf nodes).

    Hydra parses every file of the defaults tree again for every composition, with the
    pure-Python YAML parser: a third of a composition's CPU, and the suite composes
    thousands of configs. What a composition returns is unchanged."""
    name = file_ if isinstance(file_, (str, Path)) else getattr(file_, "name", None)
    at_start = isinstance(file_, (str, Path)) or getattr(file_, "tell", lambda: -1)() == 0
    try:
        stat = os.stat(name) if isinstance(name, (str, Path)) and at_start else None
    except OSError:
        stat = None
    if stat is None:  # a stream without a named file behind it, or read part-way
        return _omegaconf_load(file_)
    key = (os.path.realpath(name), stat.st_mtime_ns, stat.st_size)
    if key not in _YAML_LOADS:
        _YAML_LOADS[key] = pickle.dumps(_omegaconf_load(key[0]),
                                        protocol=pickle.HIGHEST_PROTOCOL)
    return pickle.loads(_YAML_LOADS[key])


OmegaConf.load = staticmethod(_memo_load)


def call_sites(paths, name: str) -> list[str]:
    """The files among `paths` (relative to the repository) that call `name(...)` by its
    bare name, once per call."""
    import ast

    repo = Path(__file__).resolve().parent.parent
    return [str(path.relative_to(repo)) for path in paths
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == name]


@contextlib.contextmanager
def saved_figures(record: Callable = lambda fig: fig):
    """Within the block, each figure the paper figures save is kept, as record(fig), under
    its file name in the dict yielded (read before the figure is closed)."""
    from analysis.pages import paper_figures as pf

    seen = {}
    original = pf.save

    def recording_save(fig, path):
        seen[path.name] = record(fig)
        return original(fig, path)

    pf.save = recording_save
    try:
        yield seen
    finally:
        pf.save = original


def crash_before_runs_row(monkeypatch) -> Callable:
    """Make the ledger writer die (KeyboardInterrupt) before it writes a runs row, as a
    killed run would; returns the real `write_atomic` (set it back to write again)."""
    from ledgers import writer

    real = writer.write_atomic

    def crash_on_runs(table, path, **kwargs):
        if path.parent.parent.name == "runs":
            raise KeyboardInterrupt("killed before the runs row")
        return real(table, path, **kwargs)

    monkeypatch.setattr(writer, "write_atomic", crash_on_runs)
    return real


_COMPOSED_BASES: dict[tuple[str, ...], bytes] = {}  # group overrides -> pickled config


def compose_config(*overrides: str):
    """The primary config with `overrides`, as the runner would see it.

    Hydra's own steps, fewer times: a full composition (~70 ms) once per set of group
    overrides (model=, org=, ...), kept pickled; each call unpickles it and applies the
    value overrides with Hydra's own override code, as Hydra's compose does after the
    defaults (~3 ms; experiments.campaigns.composer does the same for campaigns). Sweep and
    hydra.* overrides, and any override the shortcut cannot apply, go through Hydra's
    compose, so errors are Hydra's. The conf directory is read-only during tests."""
    with initialize_config_dir(version_base="1.3", config_dir=CONF_DIR):
        fast = _compose_from_base(list(overrides))
        if fast is None:
            return compose(config_name="config", overrides=list(overrides))
        return fast


def _compose_from_base(overrides: list[str]) -> DictConfig | None:
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    loader = GlobalHydra.instance().config_loader()
    try:
        parsed = OverridesParser.create(config_loader=loader).parse_overrides(overrides)
        if any(o.is_sweep_override() or o.is_hydra_override() for o in parsed):
            return None
        # Hydra's split (hydra/_internal/defaults_list.py, Overrides): a dict value or a key
        # that is no config group is a value override, applied after the defaults
        is_group = [not isinstance(o.value(), dict)
                    and loader.repository.group_exists(o.key_or_group) for o in parsed]
        groups = tuple(o.input_line for o, g in zip(parsed, is_group, strict=True) if g)
        if groups not in _COMPOSED_BASES:
            base = compose(config_name="config", overrides=list(groups))
            _COMPOSED_BASES[groups] = pickle.dumps(base, protocol=pickle.HIGHEST_PROTOCOL)
        cfg = pickle.loads(_COMPOSED_BASES[groups])
        ConfigLoaderImpl._apply_overrides_to_config(
            [o for o, g in zip(parsed, is_group, strict=True) if not g], cfg)
    except Exception:  # noqa: BLE001 - Hydra's compose below raises its own error
        return None
    if os.environ.get("HSL_CHECK_COMPOSE"):  # the shortcut against Hydra's compose
        full = compose(config_name="config", overrides=overrides)
        assert OmegaConf.to_yaml(cfg) == OmegaConf.to_yaml(full), overrides
        assert OmegaConf.is_struct(cfg) == OmegaConf.is_struct(full), overrides
    return cfg


def shared_dir(tmp_path_factory) -> Path:
    """A directory every process of this test run sees: the xdist workers' common base
    (each worker's own base is `<run base>/popen-gwN`), else this session's base."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_once(tmp_path_factory, name: str, builder: Callable[[Path], T]) -> T:
    """`builder(directory)` run once per test run, whatever the number of workers.

    The first caller builds into `<shared>/<name>` under an exclusive lock and pickles the
    result; later callers (other workers) wait on the lock, then unpickle it. A build that
    raised leaves no result, so the next caller tries again (and reports its own error).
    """
    root = shared_dir(tmp_path_factory)
    target, result = root / name, root / f"{name}.pickle"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held until the build is complete
        if result.exists():
            return pickle.loads(result.read_bytes())
        if target.exists():  # a build that raised half-way: start it afresh
            target.rename(root / f"{name}.failed-{time.time_ns()}")
        target.mkdir()
        value = builder(target)
        tmp = result.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(value))
        tmp.replace(result)
        return value


@pytest.fixture
def make_cfg(tmp_path):
    """Compose a config whose ledger root points into tmp_path."""

    def _make(*overrides: str):
        return compose_config(f"ledger_root={tmp_path / 'ledgers'}", *overrides)

    return _make


@pytest.fixture(scope="session")
def falcon():
    """Falcon-H1-7B geometry (conf/model/falcon_h1_7b.yaml)."""
    return load_geometry("falcon_h1_7b")


@pytest.fixture(scope="session")
def granite():
    return load_geometry("granite")


@pytest.fixture(scope="session")
def attention_only():
    return load_geometry("attention_only")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _build_tiny_checkpoint(tmp_path_factory, name: str, preset: str) -> Path:
    """`make_tiny.build(<shared>/<name>/<preset>, preset, seed=0)` once per test run, its
    llama3 tokenizer files copied from one build shared by every tiny checkpoint (the same
    files `build` writes itself: building the tokenizer is about 2 CPU s a checkpoint)."""
    from serving_core.model.make_tiny import LLAMA3_VOCAB, build

    def make(directory: Path) -> Path:
        out = build(directory / preset, preset, seed=0, tokenizer=False)
        if json.loads((out / "config.json").read_text())["vocab_size"] == LLAMA3_VOCAB:
            tokenizer = build_once(tmp_path_factory, "llama3_tokenizer", _build_tokenizer)
            for file in TOKENIZER_FILES:
                shutil.copyfile(tokenizer / file, out / file)
        return out

    return build_once(tmp_path_factory, name, make)


def _build_tokenizer(directory: Path) -> Path:
    from serving_core.model.hf_tokenizer import write_tokenizer

    return write_tokenizer(directory)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A random-weight tiny Falcon-H1 checkpoint (conf/model/falcon_h1_tiny.yaml), built
    offline with transformers' FalconH1 classes once per test run (shared by the workers;
    read-only: a test that needs a changed copy makes one)."""
    return _build_tiny_checkpoint(tmp_path_factory, "tiny_checkpoint", "falcon_h1_tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint):
    """Our torch Falcon-H1 (fp32) loaded from the tiny checkpoint."""
    from serving_core.model.falcon_h1 import FalconH1

    return FalconH1.load(tiny_checkpoint)


@pytest.fixture(scope="session")
def granite_tiny_checkpoint(tmp_path_factory):
    """A random-weight tiny Granite-4.0-H-style checkpoint (conf/model/granite_hybrid_tiny.yaml:
    attention in one layer of four, Mamba2 in three, MoE), built offline with transformers'
    GraniteMoeHybridForCausalLM once per test run (shared by the workers; read-only)."""
    return _build_tiny_checkpoint(tmp_path_factory, "granite_tiny_checkpoint",
                                  "granite_hybrid_tiny")


@pytest.fixture(scope="session")
def granite_tiny_model(granite_tiny_checkpoint):
    """Our torch GraniteMoeHybrid (fp32) loaded from the tiny Granite checkpoint."""
    from serving_core.model.granite_moe_hybrid import GraniteMoeHybrid

    return GraniteMoeHybrid.load(granite_tiny_checkpoint)


def wait_until(condition: Callable[[], T], timeout_s: float = 120.0, poll_s: float = 0.05,
               what: str = "the condition") -> T:
    """Poll `condition()` until it returns something truthy, and return that. The timeout
    only bounds a hang (generous: a loaded machine is slow, never wrong)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)
