"""workload.source=trace: the vendored Mooncake traces, prompts spelled from hash ids, the
block-size mapping, every refusal, and the infinite-cache bound beside what each organization
adopted (experiments/workloads/trace.py)."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments.workloads import trace
from experiments.workloads.workload import build_workload, normalize_workload_config

REPO = Path(__file__).resolve().parent.parent
CONF = str(REPO / "conf")


def _rows(name: str) -> list[dict]:
    with open(trace.TRACES[name]) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("name,count,fraction", [("conversation", 12031, 0.374),
                                                 ("synthetic", 3993, 0.651)])
def test_vendored_traces_parse_with_their_published_counts_and_reuse(name, count, fraction):
    parsed = trace.read_trace(name)
    rows = _rows(name)
    assert len(parsed) == len(rows) == count
    assert parsed.input_lengths.tolist() == [r["input_length"] for r in rows]
    assert parsed.hash_ids(count - 1).tolist() == rows[-1]["hash_ids"]
    # The published fraction, recomputed from the raw JSON: a block counts once any earlier
    # request held its id (partial last blocks included), the prefix ends at the first new id.
    seen: set[int] = set()
    reusable = total = 0
    for r in rows:
        k = 0
        while k < len(r["hash_ids"]) and r["hash_ids"][k] in seen:
            k += 1
        reusable += min(512 * k, r["input_length"])
        total += r["input_length"]
        seen.update(r["hash_ids"])
    assert round(reusable / total, 3) == fraction
    # Our bound counts whole blocks only (a partial block is unique to its request): a set of
    # whole-block prefixes, independently of the trie in trace.py.
    prefixes: set[tuple] = set()
    expected = []
    for r in rows:
        full = r["input_length"] // 512
        ids = tuple(r["hash_ids"][:full])
        k = 0
        while k < full and ids[: k + 1] in prefixes:
            k += 1
        expected.append(k)
        prefixes.update(ids[:j] for j in range(1, full + 1))
    bound = trace.reusable_prefix_blocks(parsed, range(count))
    assert bound == expected
    assert 0 < fraction - 512 * sum(bound) / total < 0.002  # 0.373 and 0.650


def _digest(cfg: dict) -> str:
    w = build_workload(cfg, {}, 7)
    h = hashlib.sha256()
    for r in w.requests:
        h.update(r.prompt.tobytes())
        h.update(f"{r.arrival_s!r},{r.output_tokens}".encode())
    return h.hexdigest()


def test_prompts_are_a_function_of_the_hash_ids_across_processes():
    cfg = {"source": "trace", "num_requests": 40, "trace_start": 100}
    code = ("from tests.test_trace_workload import _digest; "
            f"print(_digest({cfg!r}))")
    other = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.strip()
    assert other == _digest(cfg)
    # Equal hash ids give equal tokens wherever they occur; different ids differ within a
    # block's first three tokens; a partial last block is unique even when its id recurs.
    data = trace.read_trace("conversation")
    blocks: dict[int, bytes] = {}
    for line in range(300):
        prompt = trace.prompt_tokens(data, line, 512, 32000)
        assert prompt.min() >= trace.TOKEN_BASE and prompt.max() < 32000
        ids = data.hash_ids(line)
        assert len(prompt) == data.input_lengths[line]
        for k, h in enumerate(ids):
            tokens = prompt[512 * k : 512 * (k + 1)]
            if len(tokens) < 512:
                continue
            assert blocks.setdefault(int(h), tokens.tobytes()) == tokens.tobytes()
    firsts = {b[: 3 * 4] for b in blocks.values()}
    assert len(firsts) == len(blocks)
    # A last partial block keyed by its line: two lines ending in the same id still differ.
    last = [(line, int(data.hash_ids(line)[-1])) for line in range(len(data))
            if data.input_lengths[line] % 512]
    by_id: dict[int, int] = {}
    pair = next((by_id[h], line) for line, h in last if by_id.setdefault(h, line) != line)
    tails = [trace.prompt_tokens(data, line, 512, 32000)[-(data.input_lengths[line] % 512):]
             for line in pair]
    assert not np.array_equal(tails[0][:3], tails[1][:3])
    # A different window holds the same tokens for the same line.
    shifted = build_workload({"source": "trace", "num_requests": 5, "trace_start": 102}, {}, 0)
    again = build_workload({"source": "trace", "num_requests": 5, "trace_start": 100}, {}, 0)
    assert np.array_equal(shifted.requests[0].prompt, again.requests[2].prompt)


def test_block_size_mapping_by_hand():
    # 1,300 tokens = 3 hash blocks: two whole (512 each) and a 276-token tail.
    assert trace.block_lengths(1300, 3, 512) == [512, 512, 276]
    # C = 256 with trace_block_tokens = 256: one C block per hash block, the tail scaled by
    # 256 / 512 and rounded half up (138), at least 1 token.
    assert trace.block_lengths(1300, 3, 256) == [256, 256, 138]
    assert trace.block_lengths(513, 2, 256) == [256, 1]
    # C = 1,024: each hash block is one 1,024-token block; 276 x 2 = 552.
    assert trace.block_lengths(1300, 3, 1024) == [1024, 1024, 552]
    assert trace.block_lengths(1024, 2, 512) == [512, 512]
    # The bound scales with the block: k whole blocks reusable -> k x trace_block_tokens.
    base = build_workload({"source": "trace", "num_requests": 30}, {}, 0)
    wide = build_workload({"source": "trace", "num_requests": 30, "trace_block_tokens": 1024},
                          {}, 0)
    assert [2 * b for b in base.reusable_prefix] == list(wide.reusable_prefix)
    assert max(base.reusable_prefix) > 0
    data = trace.read_trace("conversation")
    for r, line in zip(wide.requests, range(30), strict=True):
        n = len(data.hash_ids(line))
        tail = int(data.input_lengths[line]) - 512 * (n - 1)
        assert len(r.prompt) == 1024 * (n - 1) + (1024 if tail == 512 else math.floor(
            tail * 2 + 0.5))


def test_window_speed_and_purity():
    cfg = {"source": "trace", "trace_file": "synthetic", "num_requests": 50, "trace_start": 10,
           "trace_speed": 4.0}
    w = build_workload(cfg, {"rate": 9.0}, 3)
    data = trace.read_trace("synthetic")
    stamps = data.timestamps_ms[10:60]
    assert [r.arrival_s for r in w.requests] == pytest.approx((stamps - stamps[0]) / 4000.0)
    assert [r.output_tokens for r in w.requests] == data.output_lengths[10:60].tolist()
    assert w.meta["trace"]["first_line"] == 11 and w.meta["trace"]["last_line"] == 60
    timed = build_workload({**cfg, "trace_duration_s": 20.0, "num_requests": 4000}, {}, 3)
    assert all(r.arrival_s * 4.0 < 20.0 for r in timed.requests)
    assert len(timed.requests) == int(np.sum(data.timestamps_ms[10:] < stamps[0] + 20000))
    assert _digest(cfg) == _digest(dict(cfg))
    # Other sources' normalized configs are unchanged (no trace keys in them).
    assert not any(k.startswith("trace_") for k in normalize_workload_config({}))


BAD_LINES = [
    (b'{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n{oops\n',
     "line 2: not a JSON object"),
    (b'[1, 2]\n', "line 1: not a JSON object"),
    (b'{"timestamp": 0, "input_length": 10, "hash_ids": [0]}\n', "line 1: missing field "
     "'output_length'"),
    (b'{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n',
     "line 1: timestamp=-1: allowed integers >= 0"),
    (b'{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}\n',
     "line 1: input_length=0: allowed integers >= 1"),
    (b'{"timestamp": 0, "input_length": 9, "output_length": 1.5, "hash_ids": [0]}\n',
     "line 1: output_length=1.5: allowed integers >= 1"),
    (b'{"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": ["a"]}\n',
     "line 1: hash_ids: allowed a list of integers >= 0"),
    (b'{"timestamp": 5, "input_length": 9, "output_length": 1, "hash_ids": [0]}\n'
     b'{"timestamp": 4, "input_length": 9, "output_length": 1, "hash_ids": [0]}\n',
     "line 2: timestamp 4 is below the previous line's 5"),
    (b'{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [0, 1, 2]}\n',
     "line 1: hash_ids holds 3 ids; input_length=1024 needs ceil(1024 / 512) = 2"),
    (b'{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [0, 1]}\n',
     "line 1: hash_ids holds 2 ids; input_length=1025 needs ceil(1025 / 512) = 3"),
    (b'', "no requests in the file"),
    (b'\xff\n', "line 1: not UTF-8 text"),
]


@pytest.mark.parametrize("data,message", BAD_LINES)
def test_every_bad_line_is_refused_naming_it(tmp_path, data, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(data)
    with pytest.raises(ValueError) as err:
        normalize_workload_config({"source": "trace", "trace_file": str(path)})
    text = str(err.value)
    assert text.startswith(f"workload.trace_file={str(path)!r}: ") and message in text
    assert "\n" not in text


@pytest.mark.parametrize("cfg,message", [
    ({"trace_file": "nope"}, "workload.trace_file='nope': allowed values are conversation, "
     "synthetic or the path of a JSONL trace file"),
    ({"trace_speed": 0}, "workload.trace_speed=0.0: allowed values are (0, inf)"),
    ({"trace_speed": math.inf}, "workload.trace_speed=inf: allowed finite numbers > 0"),
    ({"trace_duration_s": -1}, "workload.trace_duration_s=-1.0: allowed values are (0, inf)"),
    ({"trace_start": 12031}, "workload.trace_start=12031: the trace holds 12031 requests"),
    ({"trace_block_tokens": 8}, "workload.trace_block_tokens=8: allowed values are integers"),
    ({"trace_vocab_size": 10}, "workload.trace_vocab_size=10: allowed values are integers"),
    ({"source": "sharegpt", "trace_speed": 2.0},
     "workload.trace_speed: allowed only with workload.source=trace"),
])
def test_bad_trace_fields_are_refused(cfg, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        normalize_workload_config({"source": "trace", **cfg})


def test_command_line_refuses_a_bad_trace_with_exit_2_and_writes_nothing(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 5, "input_length": 9, "output_length": 1, "hash_ids": [0]}\n'
                    '{"timestamp": 4, "input_length": 9, "output_length": 1, "hash_ids": [1]}\n')
    root = tmp_path / "ledgers"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.run", "workload=trace",
         f"workload.trace_file={path}", f"ledger_root={root}"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "line 2: timestamp 4 is below" in lines[0]
    assert not root.exists()


ORGS = ("s0", "s1", "s2", "d0", "s2_retention", "n0", "jenga", "s2_marconi", "d0_marconi")
BUDGET = "16384MiB"  # 16 GiB of Falcon-H1-7B state: holds the window's longest request (87.6k)


def _adopted_and_bound(org: str, n: int, budget: str) -> tuple[dict, dict]:
    """A run through the user's path (experiments.run's: validate_config, whose device check
    refuses a budget the A100-40GB cannot hold, then the checked engine), its ledger rows
    in memory."""
    from hydra import compose, initialize_config_dir

    from experiments.config.validation import validate_config
    from experiments.runners.cell import checked_engine, run_cell

    with initialize_config_dir(version_base="1.3", config_dir=CONF):
        cfg = compose(config_name="config", overrides=[
            "workload=trace", f"workload.num_requests={n}", f"org={org}", f"budget={budget}",
            "write_ledgers=false"])
    plan = validate_config(cfg, preflight=False)
    assert plan.spec.executor.profile["hbm_capacity_bytes"] == 40 * 2**30  # the A100-40GB
    result = run_cell(cfg, plan=plan, engine=checked_engine(plan))
    requests = result.tables["requests"]
    assert result.summary["completed"] == n
    bound = result.workload_columns["reusable_prefix_tokens"]
    adopted = dict(zip(requests["request_id"], requests["adopted_prefix_tokens"], strict=True))
    assert sorted(bound) == sorted(adopted) == list(range(n))
    assert all(adopted[r] <= bound[r] for r in bound)
    grid = result.memory.checkpoint_interval  # adoption lands on the organization's grid
    assert all(adopted[r] <= grid * (bound[r] // grid) for r in bound)
    return adopted, bound


@pytest.mark.parametrize("org", ORGS)
def test_every_organization_adopts_at_most_the_bound(org):
    adopted, bound = _adopted_and_bound(org, 60, BUDGET)
    assert sum(bound.values()) == 30208  # 59 blocks of 512 tokens reusable in this window
    assert max(bound.values()) == 512  # the first block, shared: below D0's and N0's grid
    if org in ("d0", "d0_marconi", "n0"):  # C = 1,792 and 1,568 > 512: nothing to adopt
        assert sum(adopted.values()) == 0


def test_reuse_distance_by_hand(tmp_path):
    rows = [(0, 1024, [1, 2]), (1, 600, [1, 9]), (2, 1536, [1, 2, 3]), (3, 1024, [1, 2]),
            (4, 100, [7])]
    data = "\n".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 1,
                                 "hash_ids": h}) for t, n, h in rows).encode()
    parsed = trace.parse_trace(data, "hand")
    assert trace.reusable_prefix_blocks(parsed, range(5)) == [0, 1, 2, 2, 0]
    # line 1 reuses line 0's block 1 (nothing between); line 2 reuses [1, 2] of line 0, with
    # line 1's 600 tokens between; line 3 reuses [1, 2] of line 2, the latest holder
    assert trace.reuse_distance_tokens(parsed, range(5)) == [-1, 0, 600, 0, -1]


def test_why_deep_reuse_of_the_first_thousand_conversation_requests_is_never_adopted():
    """docs/usage.md, "Why D0 and N0 adopt nothing": the window's bound is one shared
    512-token first block on 781 requests (held by the request just before) and 2+ blocks on
    218, each of which at least 450,847 prompt tokens of other requests separate from the
    latest request holding its prefix: more than any organization's 20480MiB budget caches
    (D0's attention pool, the largest, holds 15,710 x 16 = 251,360 tokens)."""
    parsed = trace.read_trace("conversation")
    bound = np.array(trace.reusable_prefix_blocks(parsed, range(1000)))
    distance = np.array(trace.reuse_distance_tokens(parsed, range(1000)))
    assert (bound == 1).sum() == 781 and (bound >= 2).sum() == 218 and (bound == 0).sum() == 1
    assert distance[bound == 1].max() == 0
    assert distance[bound >= 2].min() == 450847 > 251360


@pytest.mark.slow  # 1,000 requests of up to 122k tokens per organization: 5-25 s each
@pytest.mark.parametrize("org", ORGS)
def test_first_thousand_conversation_requests_complete_within_the_bound(org):
    # 20 GiB of Falcon-H1-7B state, the campaign's larger trace budget and the most an
    # A100-40GB holds beside the weights, holds the window's longest request (122,378 tokens)
    adopted, bound = _adopted_and_bound(org, 1000, "20480MiB")
    assert sum(bound.values()) == 2959360  # 21.5 % of the window's 13,732,944 prompt tokens
    assert max(adopted.values()) <= 512  # docs/usage.md: only the shared first block is reused


def test_requests_ledger_stores_the_bound_and_the_sentinel(tmp_path):
    import pyarrow.parquet as pq

    from ledgers.writer import write_run
    from serving_core.records import REQUEST_COLUMNS

    def table(ids):
        cols = {c: [0] * len(ids) for c in REQUEST_COLUMNS}
        cols.update(request_id=ids, salt=[""] * len(ids), status=["finished"] * len(ids),
                    **{c: [0.0] * len(ids) for c in ("arrival_s", "start_s", "first_token_s",
                                                       "finish_s", "ttft_s", "e2e_s", "tpot_s")})
        return cols

    from tests.test_ledgers import runs_row

    write_run(tmp_path, "c", "r1", {"requests": table([1, 0])}, runs_row(),
              {"reusable_prefix_tokens": {0: 0, 1: 512}})
    write_run(tmp_path, "c", "r2", {"requests": table([0])}, {**runs_row(), "seed": 9})
    got = {}
    for path in sorted((tmp_path / "requests" / "campaign=c").glob("*.parquet")):
        t = pq.read_table(path).to_pydict()
        got[t["run_id"][0]] = list(zip(t["request_id"], t["reusable_prefix_tokens"],
                                       strict=True))
    assert got == {"r1": [(1, 512), (0, 0)], "r2": [(0, -1)]}


def test_trace_ids_must_fit_the_model_vocabulary():
    from hydra import compose, initialize_config_dir

    from experiments.config.validation import validate_config
    from serving_core.executor.device_fit import choose_device
    from serving_core.geometry import load_geometry
    from serving_core.planner import plan_budget

    with initialize_config_dir(version_base="1.3", config_dir=CONF):
        for model in sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml")):
            # each on the first declared device that holds it at this budget
            device = choose_device(load_geometry(model), plan_budget(
                load_geometry(model), "16384MiB").model_nominal_bytes)
            cfg = compose(config_name="config", overrides=[
                f"model={model}", f"executor={device}", "workload=trace", "budget=16384MiB",
                "write_ledgers=false"])
            validate_config(cfg)  # the default 32,000 ids fit every preset
        cfg = compose(config_name="config", overrides=[
            "model=zamba2_7b", "workload=trace", "workload.trace_vocab_size=50000",
            "budget=16384MiB", "write_ledgers=false"])
        with pytest.raises(ValueError, match=r"^workload.trace_vocab_size=50000: allowed "
                           r"integers <= 32000, the vocabulary of model=zamba2_7b$"):
            validate_config(cfg)


def test_a_request_that_cannot_fit_alone_is_refused_and_the_others_served():
    """Trace and sessions runs refuse such a request alone, at its arrival (status refused,
    counted in the summary); the rest of the window completes."""
    from hydra import compose, initialize_config_dir

    from experiments.runners.cell import run_cell
    from serving_core.engine import shortfall

    with initialize_config_dir(version_base="1.3", config_dir=CONF):
        cfg = compose(config_name="config", overrides=[
            "workload=trace", "workload.trace_start=174", "workload.num_requests=8", "org=s2",
            "budget=b63", "write_ledgers=false"])
    result = run_cell(cfg)
    req = result.tables["requests"]
    size = [p + o for p, o in zip(req["prompt_tokens"], req["target_output_tokens"],
                                  strict=True)]
    refused = sorted(n for n, s in zip(size, req["status"], strict=True) if s == "refused")
    assert refused == [103270]  # it needs 209 S2 pages, b63 holds 193 (76,032 tokens fit)
    assert 76032 in size
    assert all(bool(shortfall(result.memory, n)) == (n in refused) for n in size)
    assert result.summary["refused"] == 1 and result.summary["failed"] == 1
    assert result.summary["completed"] == 7
    assert set(req["status"]) == {"finished", "refused"}
    assert all(math.isnan(f) for f, s in zip(req["first_token_s"], req["status"], strict=True)
               if s == "refused")


def test_an_ordinary_workload_that_cannot_fit_is_refused_before_a_step():
    """ShareGPT and synthetic keep the whole-run refusal (serving_core.engine.check_feasible):
    one line naming the longest request and the pool's shortfall; nothing waits on it."""
    from hydra import compose, initialize_config_dir

    from experiments.runners.cell import run_cell

    with initialize_config_dir(version_base="1.3", config_dir=CONF):
        cfg = compose(config_name="config", overrides=[
            "workload.source=synthetic", "workload.num_requests=10",
            "workload.synthetic_prompt_tokens=4000", "org=s2", "budget=p7",
            "write_ledgers=false"])
    with pytest.raises(ValueError, match=r"^budget='p7' cannot hold one maximal request of "
                       r"4032 tokens under org=S2: shared pool needs 15 units but has 7"):
        run_cell(cfg)
