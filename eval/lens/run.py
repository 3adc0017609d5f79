r"""Read what each layer already predicts (Jump to Conclusions, N-NJTC) and how many layers early exit saves.

    python -m eval.lens --model smollm2-135m --out lens/
    python -m eval.lens --model gpt2 --shortcuts id,mat,njtc,n-njtc --early-exit --out lens-gpt2/
    python -m eval.lens --model smollm2-135m --shortcuts id,mat --no-heatmap \
        --submodules --submodule-blocks 0-29 --eval-data emma.txt --out lens-sub/

Fits the shortcuts on calibration text, evaluates them on held-out text, prints the per-layer
Precision@1 / surprisal table and the early-exit summary; with ``--out`` writes ``results.json``,
``README.md``, PNG figures and ``shortcuts.safetensors``. (``layercut-lens`` and
``python -m eval.lens.run`` are the same command.)
"""

from __future__ import annotations

import argparse

from eval.lens.pipeline import LensConfig, run_lens
from eval.lens.report import claims_list, early_exit_table, layer_table, shortcut_table, submodule_table
from eval.lens.shortcuts import SHORTCUTS, LowRankConfig
from prune.errors import CommandParser, cli_entry
from prune.options import (
    add_data_arguments,
    add_load_arguments,
    add_output_arguments,
    add_threads_argument,
    apply_threads,
    load_config_from_args,
)


def build_parser() -> argparse.ArgumentParser:
    """The ``eval.lens`` argument parser."""
    parser = CommandParser(prog="python -m eval.lens", description=__doc__.split("\n")[0])
    add_load_arguments(parser)
    add_data_arguments(parser, samples=None, seq_len=512, title="fit data", what="window",
                       data_help="the built-in Austen novel")
    group = parser.add_argument_group("held-out data and batching")
    group.add_argument("--eval-data", default=None, help="held-out text (default: the last 20%% of --data's windows)")
    group.add_argument("--tokens", type=int, default=16384, help="fit tokens, >= 4 x hidden size (default: 16384)")
    group.add_argument("--eval-tokens", type=int, default=4096, help="held-out tokens (default: 4096)")
    group.add_argument("--batch-size", type=int, default=4, help="windows per forward pass (default: 4)")
    group = parser.add_argument_group("shortcuts")
    group.add_argument("--shortcuts", default=",".join(SHORTCUTS),
                       help=f"comma-separated subset of {', '.join(SHORTCUTS)} (default: all)")  # fmt: skip
    group.add_argument("--ridge", type=float, default=1e-3,
                       help="mat ridge, relative to the mean diagonal of the input Gram (default: 1e-3)")  # fmt: skip
    group.add_argument("--rank", type=int, default=None, help="njtc / n-njtc rank (default: hidden // 100, at least 1)")
    group.add_argument("--steps", type=int, default=300,
                       help="Adam steps for njtc / n-njtc, from a --seed initialisation (default: 300)")  # fmt: skip
    group.add_argument("--epochs", type=int, default=2, help="passes over the fit windows while training (default: 2)")
    group.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate (default: 1e-2)")
    group.add_argument("--token-batch", type=int, default=512, help="tokens per Adam step (default: 512)")
    group.add_argument("--low-rank-target", choices=["residual", "direct"], default="residual",
                       help="njtc / n-njtc predict h_L - h_l (residual) or h_L (direct); default residual")  # fmt: skip
    group = parser.add_argument_group("analyses")
    group.add_argument("--early-exit", action=argparse.BooleanOptionalAction, default=True,
                       help="lambda sweep of confidence-based early exit (default: on)")  # fmt: skip
    group.add_argument("--heatmap", action=argparse.BooleanOptionalAction, default=True,
                       help="R^2 from every layer to every later one for id and mat (default: on)")  # fmt: skip
    group.add_argument("--heatmap-stride", type=int, default=0,
                       help="every n-th layer on the heatmap axes (default: 0 = all, spread to 33 for deep models)")
    group.add_argument("--submodules", action="store_true",
                       help="replace attention / FFN / norms of each block by a linear map, one at a time")  # fmt: skip
    group.add_argument("--submodule-blocks", default=None, help="blocks for --submodules: all, 0,5,-1 or 0-9 "
                       "(default: all; each part costs one pass over the held-out tokens)")  # fmt: skip
    add_output_arguments(parser, what="results.json, README.md, figures, shortcuts")
    add_threads_argument(parser)
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return parser


def config_from_args(args: argparse.Namespace) -> LensConfig:
    """Map parsed flags onto :class:`LensConfig`."""
    low_rank = LowRankConfig(rank=args.rank, steps=args.steps, epochs=args.epochs, lr=args.lr,
                             token_batch=args.token_batch, residual=args.low_rank_target == "residual",
                             seed=args.seed)  # fmt: skip
    return LensConfig(
        load=load_config_from_args(args),
        data=args.data, eval_data=args.eval_data, text_field=args.text_field, tokens=args.tokens,
        eval_tokens=args.eval_tokens, seq_len=args.seq_len, seed=args.seed, batch_size=args.batch_size,
        shortcuts=args.shortcuts, ridge=args.ridge, low_rank=low_rank, early_exit=args.early_exit,
        heatmap=args.heatmap, heatmap_stride=args.heatmap_stride, submodules=args.submodules,
        submodule_blocks=args.submodule_blocks, out=args.out, overwrite=args.overwrite, progress=not args.no_progress,
    )  # fmt: skip


@cli_entry
def main(argv: list[str] | None = None) -> int:
    """Run the lens CLI; returns the exit code."""
    args = build_parser().parse_args(argv)
    apply_threads(args)
    result = run_lens(config_from_args(args))
    results = result.results
    print(shortcut_table(results), end="\n\n")
    print(layer_table(results, [("precision@1", "P@1", 3), ("surprisal", "surprisal", 2), ("r2", "R^2", 3)]))
    if results["early_exit"]:
        print("\n" + early_exit_table(results))
    if results["submodules"]:
        print("\n" + submodule_table(results))
    print("\n" + "\n".join(claims_list(results)))
    print(f"\n{results['data']['fit']['tokens']} fit / {results['data']['eval']['tokens']} held-out tokens "
          f"in {results['seconds']:.1f}s")  # fmt: skip
    if result.out is not None:
        print(f"wrote {result.out}/")
    return 0


def console_main() -> None:
    """Console-script entry point (``layercut-lens``)."""
    raise SystemExit(main())


if __name__ == "__main__":
    console_main()
