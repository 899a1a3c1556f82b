"""Where the suite's CPU goes: per-file and per-test totals of a `HSL_TEST_CPU_LOG` file
(`python tests/cpu_log.py <log> [--top N] [--against <older log>]`; `make test-cpu` writes
the log and prints this).

CPU seconds, not wall: with other work on the machine a test's wall time says more about
its neighbours. Even CPU seconds grow on a heavily loaded machine (shared caches and
cores), so compare two logs taken under similar load, or better, at the same time.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from run_order import write_costs


def load(path: Path, field: str = "cpu_s") -> dict[str, float]:
    """CPU seconds (or another field: `wall_s`) by test id (the last entry of a test that
    ran twice)."""
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["test"]] = float(row[field])
    return rows


def by_file(tests: dict[str, float]) -> dict[str, float]:
    files: dict[str, float] = defaultdict(float)
    for test, cpu in tests.items():
        files[test.split("::", 1)[0]] += cpu
    return dict(files)


def report(tests: dict[str, float], top: int, older: dict[str, float] | None = None) -> str:
    total = sum(tests.values())
    lines = [f"{len(tests)} tests, {total:.1f} CPU seconds"
             + (f" (before: {len(older)} tests, {sum(older.values()):.1f} s, "
                f"{100 * (total / sum(older.values()) - 1):+.1f} %)" if older else "")]
    files, before = by_file(tests), by_file(older or {})
    lines.append(f"\n{'CPU s':>8} {'share':>6}" + (f" {'before':>8}" if older else "") + "  file")
    for name, cpu in sorted(files.items(), key=lambda kv: -kv[1])[:top]:
        was = f" {before.get(name, 0.0):8.1f}" if older else ""
        lines.append(f"{cpu:8.1f} {100 * cpu / total:5.1f}%{was}  {name}")
    lines.append(f"\n{'CPU s':>8}  test")
    for name, cpu in sorted(tests.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{cpu:8.2f}  {name}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log", type=Path)
    p.add_argument("--top", type=int, default=25, help="rows per list (default 25)")
    p.add_argument("--against", type=Path, help="an older log to compare with")
    p.add_argument("--write-costs", type=Path, metavar="JSON",
                   help="also write each file's wall seconds there, the order in which the "
                        "workers get the files (tests/run_order.py)")
    args = p.parse_args(argv)
    for field, path in (("log", args.log), ("--against", args.against)):
        if path is not None and not path.is_file():
            print(f"error: {field}={str(path)!r}: no such file", file=sys.stderr)
            return 2
    if args.top < 1:
        print(f"error: --top={args.top}: allowed integers >= 1", file=sys.stderr)
        return 2
    print(report(load(args.log), args.top, load(args.against) if args.against else None))
    if args.write_costs is not None:
        write_costs(by_file(load(args.log, "wall_s")), args.write_costs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
