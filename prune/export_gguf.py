"""A servable checkpoint folder as one GGUF file for llama.cpp, written by llama.cpp's own converter.

    python -m prune.export_gguf slim/ [--out slim.gguf] [--outtype f32|f16|bf16|q8_0|q4_k_m] [--converter PATH]
    python -m prune.run --model smollm2-135m --drop 4 --replace fold --out slim/ --export gguf
    python -m prune.export_gguf --fetch-converter     # once: llama.cpp's converter into ~/.cache/layercut

The command line only; the library is :mod:`prune.checkpoint.gguf`.
"""

from __future__ import annotations

import argparse

from prune.checkpoint.gguf import CONVERTER_ENV, CONVERTER_NAME, OUTTYPES, convert, fetch_converter
from prune.errors import CommandParser, cli_entry


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m prune.export_gguf``."""
    parser = CommandParser(prog="python -m prune.export_gguf", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", help="a checkpoint folder written by prune.run (or any transformers "
                        "checkpoint)")
    parser.add_argument("--out", default=None, help="the .gguf path (default: FOLDER/gguf/<name>-<outtype>.gguf)")
    parser.add_argument("--outtype", default="f32", choices=OUTTYPES, help="tensor type (default: f32)")
    parser.add_argument("--converter", default=None,
                        help=f"llama.cpp's {CONVERTER_NAME} or its folder (default: ${CONVERTER_ENV}, else the one "
                        "--fetch-converter fetched)")
    parser.add_argument("--fetch-converter", action="store_true",
                        help="download llama-cpp-python's source distribution (nothing is built) and keep its "
                        f"{CONVERTER_NAME} in the cache, where the GGUF exports find it; then convert FOLDER if given")
    return parser


@cli_entry
def main(argv: list[str] | None = None) -> int:
    """Convert, check and report one checkpoint."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.fetch_converter:
        print(f"llama.cpp's converter: {fetch_converter()}")
    if args.folder is None:
        if not args.fetch_converter:
            parser.error("give the checkpoint FOLDER to convert")
        return 0
    path, report = convert(args.folder, args.out, args.outtype, args.converter)
    print(f"wrote {path}: {report['architecture']}, {report['blocks']} blocks, {report['tensors']} tensors "
          f"({report['compared']} compared with the checkpoint, largest relative difference "
          f"{report['max_rel_diff']:.1e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
