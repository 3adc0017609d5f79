"""Sub-layer removals as the DeciLM layout, which vLLM and llama.cpp serve.

    python -m prune.decilm slim/ --out slim-decilm/ [--llama-cpp] [--overwrite]
    vllm serve slim-decilm/ --trust-remote-code

The command line only; the library is :mod:`prune.checkpoint.decilm`.
"""

from __future__ import annotations

import argparse

from prune.checkpoint.decilm import write_decilm
from prune.checkpoint.decilm_config import LLAMACPP
from prune.checkpoint.report import read_report
from prune.errors import CommandParser, cli_entry


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m prune.decilm``."""
    parser = CommandParser(prog="python -m prune.decilm", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="a sub-layer checkpoint written by prune.run --unit attention,mlp")
    parser.add_argument("--out", required=True, help="the DeciLM-layout folder to write")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="removed MLPs as zero MLPs of width 256, which llama.cpp also runs exactly "
                             "(default: no-op FFNs, which only vLLM runs exactly)")
    return parser


@cli_entry
def main(argv: list[str] | None = None) -> int:
    """Write one DeciLM-layout folder and say which engines serve it."""
    args = build_parser().parse_args(argv)
    out = write_decilm(args.folder, args.out, args.overwrite, args.llama_cpp)
    why_not = read_report(out)["serving"].get("why_not", {}).get(LLAMACPP)
    print(f"wrote {out} (DeciLM layout): serve with `vllm serve {out} --trust-remote-code`"
          + (f"; llama.cpp: {why_not}" if why_not else "; llama.cpp converts it"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
