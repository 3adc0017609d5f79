"""``eval.mapfit``'s command line: parse, fit and measure one span's maps, write ``results.json`` and ``README.md``.

    python -m eval.mapfit --model smollm2-135m --span 12-15 --out mapfit/
        --heldout novel=sensesensibility.txt,wiki=wiki.test.jsonl,arc=arc_prompts.jsonl

What it measures: ``eval.mapfit``'s docstring.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tqdm.auto import tqdm

from eval.mapfit import (
    MASSIVE,
    capture,
    error_report,
    fit_variants,
    logit_report,
    markdown,
    parse_span,
    text_sequences,
    token_sensitivity,
)
from prune.atomic import atomic_directory, check_output_dir, write_json
from prune.data.calibration import DataConfig, calibration_data, load_documents
from prune.errors import CommandParser, LayercutError, cli_entry
from prune.model.adapters import num_blocks
from prune.options import add_load_arguments, add_threads_argument, apply_threads, load_config_from_args
from prune.replace.driver import short_windows


def build_parser() -> argparse.ArgumentParser:
    """The ``eval.mapfit`` argument parser."""
    parser = CommandParser(prog="python -m eval.mapfit", description=(
        "Where a linear repair's error comes from: one span's map, fitted on calibration, measured elsewhere."))
    add_load_arguments(parser)
    parser.add_argument("--span", required=True, help="the removed blocks, first-last (12-15) or one (12)")
    parser.add_argument("--data", default=None, help="calibration text, as prune.run's --data (default: prune.run's)")
    parser.add_argument("--samples", type=int, default=32, help="calibration sequences (default: 32)")
    parser.add_argument("--heldout-samples", type=int, default=8,
                        help="calibration held-out sequences, measured as a text of their own (default: 8)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default: 512)")
    parser.add_argument("--heldout", default=None,
                        help="other texts, NAME=FILE comma list (.txt: windows; .jsonl: one sequence per document)")
    parser.add_argument("--heldout-tokens", type=int, default=4096, help="tokens read per --heldout text")
    parser.add_argument("--skip", default="1,4", help="ls-skip-N variants, comma list of N (default: 1,4)")
    parser.add_argument("--shrink", default="0.01,0.1,1", help="shrink-R variants, comma list of R")
    parser.add_argument("--update-scale", default="",
                        help="<fit>*S variants: a share S of the least-squares map's update, comma list of S in (0, 1) "
                             "(as --replace linear --update-scale S; default: none)")
    parser.add_argument("--short", type=int, default=0,
                        help="also fit ls-short-N (the calibration cut into N-token sequences) and ls-mixed-N "
                             "(both cuts pooled); 0: off")
    parser.add_argument("--grad-weight", action="store_true",
                        help="also fit <fit>-grad and <fit>-grad-sqrt: least squares with each calibration token "
                             "weighted by how much the original model's next-token loss moves with the span's "
                             "output (squared gradient norm; -sqrt: its norm)")
    parser.add_argument("--logits", action="store_true",
                        help="also run the whole model with each variant in the span's place: KL from the "
                             "original's next-token distribution, top-1 agreement and perplexity per text")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per forward pass (default: 4)")
    parser.add_argument("--out", required=True, help="folder for results.json and README.md")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    add_threads_argument(parser)
    return parser


def _numbers(text: str, kind, flag: str) -> list:
    try:
        return [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise LayercutError(f"{flag} takes a comma list of numbers, got '{text}'") from None


def _check_options(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """Every option checked before the model loads; the ``--heldout`` entries as (name, "=", file)."""
    skips = _numbers(args.skip, int, "--skip")
    if any(not 0 < skip < args.seq_len for skip in skips):
        raise LayercutError(f"--skip takes position counts from 1 to {args.seq_len - 1} (--seq-len), got '{args.skip}'")
    if args.short and not 2 <= args.short < args.seq_len:
        raise LayercutError(f"--short takes a sequence length from 2 to {args.seq_len - 1} (below --seq-len), "
                            f"got {args.short}")
    if any(not 0 < scale < 1 for scale in _numbers(args.update_scale, float, "--update-scale")):
        raise LayercutError(f"--update-scale takes shares between 0 and 1 (1 is the fit itself), "
                            f"got '{args.update_scale}'")
    if any(not ridge > 0 for ridge in _numbers(args.shrink, float, "--shrink")):
        raise LayercutError(f"--shrink takes ridges above 0 (0 is plain least squares, ls), got '{args.shrink}'")
    heldout = [item.partition("=") for item in (args.heldout.split(",") if args.heldout else [])]
    names = [name for name, _, _ in heldout]
    for name, sep, spec in heldout:
        if not sep or not name or not spec:
            raise LayercutError("--heldout takes NAME=FILE entries, e.g. novel=emma.txt,arc=arc_prompts.jsonl")
        if name in ("calibration", "calibration held-out") or names.count(name) > 1:
            raise LayercutError(f"--heldout names '{name}' twice or as the calibration text: name it apart")
        load_documents(spec, flag="--heldout")  # a bad file fails before the model loads
    return heldout


def _texts(args: argparse.Namespace, tokenizer, data, heldout) -> tuple[dict, dict]:
    """Every text measured, as sequences, and where each came from."""
    texts = {"calibration": list(data.token_ids)}
    if data.heldout_ids is not None and data.heldout_ids.numel():
        texts["calibration held-out"] = list(data.heldout_ids)
    sources = {"calibration": data.source, "calibration held-out": f"{data.source} (held-out sequences)"}
    for name, _, spec in heldout:
        texts[name], sources[name] = text_sequences(tokenizer, spec, args.seq_len, args.heldout_tokens)
    return texts, sources


def _fits(args: argparse.Namespace, model, data, span, calibration_sequences, cal) -> dict:
    """Every variant fitted on the calibration (with ``--short``'s cut and ``--grad-weight``'s weights)."""
    short = windows = None
    short_batch = args.batch_size
    if args.short:
        windows = list(short_windows(data.token_ids, args.short))  # the cut --fit-short feeds the fit
        short_batch = max(args.batch_size, args.batch_size * args.seq_len // args.short)
        short = (args.short, capture(model, windows, span, short_batch))
    sensitivity = None
    if args.grad_weight:
        parts = [token_sensitivity(model, calibration_sequences, span, args.batch_size)]
        if short is not None:
            parts.append(token_sensitivity(model, windows, span, short_batch))
        sensitivity = torch.cat(parts)
    return fit_variants(cal, _numbers(args.skip, int, "--skip"), _numbers(args.shrink, float, "--shrink"), short,
                        _numbers(args.update_scale, float, "--update-scale"), sensitivity)


def run(args: argparse.Namespace) -> dict:
    """Capture, fit every variant on calibration, measure on every text; the results."""
    heldout = _check_options(args)
    loaded = load_config_from_args(args).load()
    model, tokenizer = loaded.model, loaded.tokenizer
    span = parse_span(args.span, num_blocks(model))
    data = calibration_data(tokenizer, DataConfig(data=args.data, samples=args.samples, seq_len=args.seq_len,
                                                  heldout_samples=args.heldout_samples), model=model)
    texts, sources = _texts(args, tokenizer, data, heldout)
    captured = {name: capture(model, seqs, span, args.batch_size) for name, seqs in texts.items()}
    cal = captured["calibration"]
    massive_norm = MASSIVE * float(cal.x.norm(dim=1).median())
    fits = _fits(args, model, data, span, texts["calibration"], cal)
    table = {name: {"removal": error_report(None, data_, massive_norm),
                    **{variant: error_report(fit, data_, massive_norm) for variant, fit in fits.items()}}
             for name, data_ in captured.items()}
    results = {"model": args.model, "span": list(span), "sources": sources, "massive_norm": massive_norm,
               "errors": table}
    if args.logits:
        variants = {"removal": None, **fits}
        results["logits"] = {name: logit_report(model, seqs, span, variants, args.batch_size)
                             for name, seqs in tqdm(texts.items(), desc="logits", unit="text")}
    return results


@cli_entry
def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    args = build_parser().parse_args(argv)
    apply_threads(args)
    check_output_dir(args.out, args.overwrite)  # before any work, not after it
    results = run(args)
    with atomic_directory(args.out, overwrite=args.overwrite) as staging:
        write_json(staging / "results.json", results)
        (staging / "README.md").write_text(markdown(results), encoding="utf-8")
    print(markdown(results))
    print(f"wrote {Path(args.out)}/")
    return 0


def console_main() -> None:
    """Console-script entry point."""
    raise SystemExit(main())


if __name__ == "__main__":
    console_main()
