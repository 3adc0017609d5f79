"""A servable checkpoint folder as one GGUF file for llama.cpp, written by llama.cpp's own converter.

    python -m prune.export_gguf slim/ [--out slim.gguf] [--outtype f32|f16|bf16|q8_0] [--converter PATH]
    python -m prune.run --model smollm2-135m --drop 4 --replace fold --out slim/ --export gguf

The command line only; the library is :mod:`prune.checkpoint.gguf`.
"""

from __future__ import annotations

import argparse

from prune.checkpoint.gguf import CONVERTER_ENV, CONVERTER_NAME, OUTTYPES, convert
from prune.errors import cli_entry


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m prune.export_gguf``."""
    parser = argparse.ArgumentParser(prog="python -m prune.export_gguf", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="a checkpoint folder written by prune.run (or any transformers checkpoint)")
    parser.add_argument("--out", default=None, help="the .gguf path (default: FOLDER/gguf/<name>-<outtype>.gguf)")
    parser.add_argument("--outtype", default="f32", choices=OUTTYPES, help="tensor type (default: f32)")
    parser.add_argument("--converter", default=None,
                        help=f"llama.cpp's {CONVERTER_NAME} or its folder (default: ${CONVERTER_ENV})")
    return parser


@cli_entry
def main(argv: list[str] | None = None) -> int:
    """Convert, check and report one checkpoint."""
    args = build_parser().parse_args(argv)
    path, report = convert(args.folder, args.out, args.outtype, args.converter)
    print(f"wrote {path}: {report['architecture']}, {report['blocks']} blocks, {report['tensors']} tensors "
          f"({report['compared']} compared with the checkpoint, largest relative difference "
          f"{report['max_rel_diff']:.1e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
