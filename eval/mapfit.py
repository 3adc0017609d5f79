"""Where a linear repair's error comes from: one span's map, fitted on calibration, measured elsewhere.

    python -m eval.mapfit --model smollm2-135m --span 12-15 --out mapfit/
        --heldout novel=sensesensibility.txt,wiki=wiki.test.jsonl,arc=arc_prompts.jsonl

The span's input X (the state entering its first block) and output Y (leaving its last) are captured
on the calibration text, on its held-out sequences and on each ``--heldout`` text. Every variant is
fitted on the calibration tokens alone:

- ``ls``: least squares ``Y ~ X A + b``, what ``--replace linear`` fits;
- ``ls-skip-N``: the same without the first N positions of each sequence (the attention sinks whose
  massive norms weigh on a squared loss);
- ``shrink-R``: ridge R (relative to the mean input variance) on the update ``Y - X``: the map is
  pulled toward the identity, i.e. toward plain removal;
- with ``--short N``, ``ls-short-N``: least squares on the same calibration tokens cut into N-token
  sequences (early positions only, as in short task prompts), and ``ls-mixed-N``: both cuts pooled;
- with ``--update-scale S``, ``<fit>*S``: ``h + S (f(h) - h)``, a share S of the update of ``ls-mixed-N``
  (``ls`` without ``--short``), what ``--replace linear --update-scale S`` fits. Least squares is the best
  map in the residual stream's squared error; the logits need not agree.
- with ``--grad-weight``, ``<fit>-grad`` and ``<fit>-grad-sqrt``: the least squares of ``ls-mixed-N`` (``ls``)
  with each calibration token weighted by the squared norm (``-sqrt``: the norm) of the gradient of the
  original model's next-token loss at the span's output. A squared error that weighs every token alike is
  the best fit in the residual stream; this one weighs the tokens whose state the predictions read most.

Each is measured as the *relative* error: the map's squared error over removal's (``X`` standing for
``Y``), so 1.0 is as bad as removing the span and lower is better; above 1.0 the map hurts. Beside it
is where the error sits: the share at position 0 and at tokens of massive norm (over 10x the median).
A ``.txt`` text is cut into windows of ``--seq-len`` tokens; a file of several documents (``.jsonl``)
gives one sequence per document, so prompts keep their own (short) lengths.

With ``--logits`` each variant (and removal) is also put in the span's place and the whole model run on
every text: the mean KL divergence of its next-token distribution from the original model's, relative
to removal's, the share of positions where its top-1 token is the original's, and its perplexity. A map
that halves the hidden-state error need not halve the error the later blocks and the head see.

Writes ``results.json`` and ``README.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from prune.adapters import get_blocks, input_device, num_blocks
from prune.capture import block_input, block_output, hooks_held, residual_states, with_block_output
from prune.data import DataConfig, calibration_data, load_documents
from prune.errors import LayercutError, cli_entry
from prune.export import atomic_directory, check_output_dir, write_json
from prune.linear_fit import LinearFit, fit_linear_map, scale_update
from prune.options import add_load_arguments, add_threads_argument, apply_threads, load_config_from_args
from prune.replace.capture import PairAccumulator
from prune.replace.driver import short_windows
from prune.stats import PairMoments

MASSIVE = 10.0  # a token is "massive" when its input norm exceeds this many times the median
EARLY = 32  # predictions from positions below this are "early": most of a short prompt's, few of a long text's


@dataclass
class Captured:
    """A text's span input and output, token by token, and each token's position in its sequence."""

    x: torch.Tensor  # [n, d] float32
    y: torch.Tensor  # [n, d] float32
    position: torch.Tensor  # [n] long


def parse_span(text: str, blocks: int) -> tuple[int, int]:
    """``"12-15"`` or ``"12"`` -> (first, last), inside the model's blocks."""
    try:
        first, _, last = text.partition("-")
        span = (int(first), int(last or first))
    except ValueError:
        raise LayercutError(f"--span takes blocks like 12-15 or 12, got '{text}'") from None
    if not 0 <= span[0] <= span[1] < blocks:
        raise LayercutError(f"--span {text}: the model has blocks 0..{blocks - 1}")
    return span


@torch.no_grad()
def capture(model, sequences: list[torch.Tensor], span: tuple[int, int], batch_size: int = 4) -> Captured:
    """X (input of block ``span[0]``) and Y (output of block ``span[1]``) over ``sequences`` (1-D token ids)."""
    wanted = {span[0]: "x", span[1] + 1: "y"}
    kept: dict[str, list[torch.Tensor]] = {"x": [], "y": []}

    def keep(index: int, state: torch.Tensor) -> None:
        if index in wanted:
            kept[wanted[index]].append(state.detach().float().reshape(-1, state.shape[-1]).cpu())

    positions = []
    with residual_states(model, keep):
        for batch in batches(model, sequences, batch_size):
            model.base_model(input_ids=batch, use_cache=False)
            positions.append(torch.arange(batch.shape[1]).repeat(batch.shape[0]))
    return Captured(torch.cat(kept["x"]), torch.cat(kept["y"]), torch.cat(positions))


def token_sensitivity(model, sequences: list[torch.Tensor], span: tuple[int, int], batch_size: int = 4) -> torch.Tensor:
    """Per token of ``sequences`` (in :func:`capture`'s order): how far the original model's loss moves with its state.

    That is the squared norm of the gradient of the summed next-token loss at the span's output. A sequence's
    last token predicts nothing and no later token reads it: 0.
    """
    _, blocks = get_blocks(model)
    held: dict[str, torch.Tensor] = {}

    def leaf(_module, _args, output):  # the gradient stops here: only the later blocks and the head are traced
        held["state"] = block_output(output).detach().requires_grad_(True)
        return with_block_output(output, held["state"])

    trained = [p for p in model.parameters() if p.requires_grad]
    for param in trained:
        param.requires_grad_(False)
    weights = []
    try:
        with hooks_held([blocks[span[1]].register_forward_hook(leaf)]), torch.enable_grad():
            for batch in batches(model, sequences, batch_size):
                logits = model(input_ids=batch, use_cache=False).logits[:, :-1]
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                         batch[:, 1:].reshape(-1).to(logits.device), reduction="sum")
                (grad,) = torch.autograd.grad(loss, held.pop("state"))
                weights.append(grad.float().pow(2).sum(-1).reshape(-1).cpu())
    finally:
        for param in trained:
            param.requires_grad_(True)
    return torch.cat(weights)


def weighted_moments(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor) -> PairMoments:
    """The centred moments of (x, y) with token ``i`` counted ``weight[i]`` times (float64)."""
    w = weight.double() / weight.double().mean()  # the scale cancels in the fit; near 1 keeps the sums readable
    xd, yd = x.double(), y.double()
    mean_x, mean_y = (w @ xd) / w.sum(), (w @ yd) / w.sum()
    xc, yc = xd - mean_x, yd - mean_y
    weighted = xc * w[:, None]
    return PairMoments(int(x.shape[0]), mean_x, mean_y, weighted.T @ xc, weighted.T @ yc, (yc * w[:, None]).T @ yc)


def batches(model, sequences: list[torch.Tensor], batch_size: int) -> Iterator[torch.Tensor]:
    """``sequences`` stacked ``batch_size`` at a time on the model's input device; equal lengths only.

    A file of documents has many lengths, each its own batch: no padding, so no mask to get wrong.
    """
    device = input_device(model)
    groups: dict[int, list[torch.Tensor]] = {}
    for seq in sequences:
        groups.setdefault(int(seq.numel()), []).append(seq)
    for group in tqdm(list(groups.values()), desc="batches", unit="length", disable=len(groups) < 8):
        for start in range(0, len(group), batch_size):
            yield torch.stack(group[start : start + batch_size]).to(device)


@contextmanager
def span_replaced(model, span: tuple[int, int], fit: LinearFit | None) -> Iterator[None]:
    """Within the block, the span's output is ``fit(input)`` (None: the input itself, i.e. removal).

    Hooks rather than surgery: the span's blocks still run, so nothing about the model changes but the
    one state handed on, which is the quantity being measured.
    """
    _, blocks = get_blocks(model)
    entering: dict[str, torch.Tensor] = {}

    def keep(_module, args, kwargs):
        entering["x"] = block_input(args, kwargs)

    def replace(_module, _args, output):
        x = entering.pop("x")
        new = x if fit is None else fit(x.double()).to(x.dtype)
        return with_block_output(output, new)

    with hooks_held([blocks[span[0]].register_forward_pre_hook(keep, with_kwargs=True),
                     blocks[span[1]].register_forward_hook(replace)]):
        yield


@torch.no_grad()
def logit_report(model, sequences: list[torch.Tensor], span: tuple[int, int], fits: dict[str, LinearFit | None],
                 batch_size: int = 4) -> dict[str, dict]:
    """Per variant: mean KL(original || variant) per predicted token, top-1 agreement with the original, ppl.

    ``fits`` maps variant names to maps, None for removal; KL is also given relative to removal's
    (present under the name ``removal``), so 1.0 reads as in the hidden-state table.
    """
    sums = {name: {"kl": 0.0, "agree": 0, "nll": 0.0, "kl_early": 0.0} for name in fits}
    tokens = early = 0
    for batch in batches(model, sequences, batch_size):
        reference = torch.log_softmax(model(input_ids=batch, use_cache=False).logits[:, :-1].float(), dim=-1)
        target = batch[:, 1:].to(reference.device)
        tokens += target.numel()
        early += target[:, :EARLY].numel()
        for name, fit in fits.items():
            with span_replaced(model, span, fit):
                logp = torch.log_softmax(model(input_ids=batch, use_cache=False).logits[:, :-1].float(), dim=-1)
            kl = (reference.exp() * (reference - logp)).sum(-1)
            sums[name]["kl"] += float(kl.sum())
            sums[name]["kl_early"] += float(kl[:, :EARLY].sum())
            sums[name]["agree"] += int((logp.argmax(-1) == reference.argmax(-1)).sum())
            sums[name]["nll"] -= float(logp.gather(-1, target.unsqueeze(-1)).sum())
    late = tokens - early
    report = {name: {"kl": s["kl"] / tokens, "top1_agreement": s["agree"] / tokens,
                     "ppl": float(torch.tensor(s["nll"] / tokens).exp()), "tokens": tokens,
                     "kl_early": s["kl_early"] / early, "kl_late": (s["kl"] - s["kl_early"]) / late if late else None,
                     "early_tokens": early}
              for name, s in sums.items()}
    removal = report.get("removal")
    for entry in report.values():
        for key in ("kl", "kl_early", "kl_late"):
            base = removal[key] if removal else None
            entry[f"{key}_relative"] = entry[key] / base if base and entry[key] is not None else None
    return report


def text_sequences(tokenizer, spec: str, seq_len: int, max_tokens: int) -> tuple[list[torch.Tensor], str]:
    """One text as sequences: windows of ``seq_len`` (one document) or one per document (several)."""
    documents, source = load_documents(spec, flag="--heldout")
    sequences, total = [], 0
    if len(documents) == 1:
        ids = torch.tensor(tokenizer(documents[0])["input_ids"], dtype=torch.long)
        for start in range(0, ids.numel() - seq_len + 1, seq_len):
            if total >= max_tokens:
                break
            sequences.append(ids[start : start + seq_len])
            total += seq_len
    else:
        for document in documents:
            if total >= max_tokens:
                break
            ids = torch.tensor(tokenizer(document)["input_ids"][:seq_len], dtype=torch.long)
            if ids.numel() >= 2:
                sequences.append(ids)
                total += ids.numel()
    if not sequences:
        raise LayercutError(f"--heldout {spec} gives no sequence of {seq_len} tokens: lower --seq-len")
    return sequences, source


def fit_variants(calibration: Captured, skips: list[int], shrinks: list[float],
                 short: tuple[int, Captured] | None = None, scales: Sequence[float] = (),
                 sensitivity: torch.Tensor | None = None) -> dict[str, LinearFit]:
    """Every variant's map, fitted on the calibration tokens only (``short``: the same tokens re-cut).

    ``sensitivity``: per token of the calibration (then of the re-cut, when given), the weight of the
    ``-grad`` variants (:func:`token_sensitivity`).
    """
    fits = {}
    for skip in [0, *skips]:
        keep = calibration.position >= skip
        moments = PairAccumulator(precision="float64")
        moments.update(calibration.x[keep], calibration.y[keep])
        fits["ls" if skip == 0 else f"ls-skip-{skip}"] = fit_linear_map(moments.moments())
    for ridge in shrinks:
        moments = PairAccumulator(precision="float64")
        moments.update(calibration.x, calibration.y - calibration.x)
        update = fit_linear_map(moments.moments(), ridge)
        eye = torch.eye(update.weight.shape[0], dtype=update.weight.dtype)
        fits[f"shrink-{ridge:g}"] = LinearFit(update.weight + eye, update.bias)
    if short is not None:
        length, recut = short
        moments = PairAccumulator(precision="float64")
        moments.update(recut.x, recut.y)
        fits[f"ls-short-{length}"] = fit_linear_map(moments.moments())
        moments.update(calibration.x, calibration.y)
        fits[f"ls-mixed-{length}"] = fit_linear_map(moments.moments())
    base = f"ls-mixed-{short[0]}" if short is not None else "ls"
    for scale in scales:
        fits[f"{base}*{scale:g}"] = scale_update(fits[base], scale)
    if sensitivity is not None:
        pooled = [calibration] if short is None else [calibration, short[1]]
        x, y = torch.cat([c.x for c in pooled]), torch.cat([c.y for c in pooled])
        for suffix, weight in (("grad", sensitivity), ("grad-sqrt", sensitivity.sqrt())):
            fits[f"{base}-{suffix}"] = fit_linear_map(weighted_moments(x, y, weight))
    return fits


def error_report(fit: LinearFit | None, data: Captured, massive_norm: float) -> dict:
    """Relative squared error of ``fit`` (None: removal) on ``data``, and the shares at position 0 / massive tokens."""
    removal = (data.x - data.y).pow(2).sum(1)
    error = removal if fit is None else (fit(data.x.double()).float() - data.y).pow(2).sum(1)
    massive = data.x.norm(dim=1) > massive_norm
    first = data.position == 0
    total = float(error.sum())
    return {"relative": total / float(removal.sum()), "share_position0": float(error[first].sum()) / total,
            "share_massive": float(error[massive].sum()) / total, "tokens": int(data.x.shape[0]),
            "massive_tokens": int(massive.sum())}


def build_parser() -> argparse.ArgumentParser:
    """The ``eval.mapfit`` argument parser."""
    parser = argparse.ArgumentParser(prog="python -m eval.mapfit", description=__doc__.split("\n")[0])
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


def run(args: argparse.Namespace) -> dict:
    """Capture, fit every variant on calibration, measure on every text; the results."""
    skips = _numbers(args.skip, int, "--skip")
    shrinks = _numbers(args.shrink, float, "--shrink")
    scales = _numbers(args.update_scale, float, "--update-scale")
    if any(not 0 < skip < args.seq_len for skip in skips):
        raise LayercutError(f"--skip takes position counts from 1 to {args.seq_len - 1} (--seq-len), got '{args.skip}'")
    if args.short and not 2 <= args.short < args.seq_len:
        raise LayercutError(f"--short takes a sequence length from 2 to {args.seq_len - 1} (below --seq-len), "
                            f"got {args.short}")
    if any(not 0 < scale < 1 for scale in scales):
        raise LayercutError(f"--update-scale takes shares between 0 and 1 (1 is the fit itself), "
                            f"got '{args.update_scale}'")
    if any(not ridge > 0 for ridge in shrinks):
        raise LayercutError(f"--shrink takes ridges above 0 (0 is plain least squares, ls), got '{args.shrink}'")
    heldout = [item.partition("=") for item in (args.heldout.split(",") if args.heldout else [])]
    names = [name for name, _, _ in heldout]
    for name, sep, spec in heldout:
        if not sep or not name or not spec:
            raise LayercutError("--heldout takes NAME=FILE entries, e.g. novel=emma.txt,arc=arc_prompts.jsonl")
        if name in ("calibration", "calibration held-out") or names.count(name) > 1:
            raise LayercutError(f"--heldout names '{name}' twice or as the calibration text: name it apart")
        load_documents(spec, flag="--heldout")  # a bad file fails before the model loads
    loaded = load_config_from_args(args).load()
    model, tokenizer = loaded.model, loaded.tokenizer
    span = parse_span(args.span, num_blocks(model))
    data = calibration_data(tokenizer, DataConfig(data=args.data, samples=args.samples, seq_len=args.seq_len,
                                                  heldout_samples=args.heldout_samples), model=model)
    texts = {"calibration": list(data.token_ids)}
    if data.heldout_ids is not None and data.heldout_ids.numel():
        texts["calibration held-out"] = list(data.heldout_ids)
    sources = {"calibration": data.source, "calibration held-out": f"{data.source} (held-out sequences)"}
    for name, _, spec in heldout:
        texts[name], sources[name] = text_sequences(tokenizer, spec, args.seq_len, args.heldout_tokens)
    captured = {name: capture(model, seqs, span, args.batch_size) for name, seqs in texts.items()}
    cal = captured["calibration"]
    massive_norm = MASSIVE * float(cal.x.norm(dim=1).median())
    short = None
    if args.short:
        windows = list(short_windows(data.token_ids, args.short))  # the cut --fit-short feeds the fit
        short_batch = max(args.batch_size, args.batch_size * args.seq_len // args.short)
        short = (args.short, capture(model, windows, span, short_batch))
    sensitivity = None
    if args.grad_weight:
        parts = [token_sensitivity(model, texts["calibration"], span, args.batch_size)]
        if short is not None:
            parts.append(token_sensitivity(model, windows, span, short_batch))
        sensitivity = torch.cat(parts)
    fits = fit_variants(cal, skips, shrinks, short, scales, sensitivity)
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


def markdown(results: dict) -> str:
    """README.md: relative error per variant and text, then where each text's error sits."""
    texts = list(results["errors"])
    variants = list(next(iter(results["errors"].values())))
    span = results["span"]
    lines = [f"# Linear map of blocks {span[0]}-{span[1]}: {results['model']}", "",
             "Relative error = the map's squared error / removal's (1.0: as bad as removing the span; "
             "lower is better). Every variant is fitted on the calibration tokens only.", "",
             "| variant | " + " | ".join(texts) + " |", "|---|" + "---:|" * len(texts)]
    for variant in variants:
        cells = [f"{results['errors'][t][variant]['relative']:.3f}" for t in texts]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    lines += ["", f"Where the least-squares map's error sits (massive: input norm over {MASSIVE:g}x the "
              f"calibration median, {results['massive_norm']:.1f}):", "",
              "| text | tokens | massive tokens | ls error at position 0 | ls error at massive tokens | "
              "removal error at position 0 |", "|---|---:|---:|---:|---:|---:|"]
    for t in texts:
        ls, rm = results["errors"][t]["ls"], results["errors"][t]["removal"]
        lines.append(f"| {t} | {ls['tokens']} | {ls['massive_tokens']} | {100 * ls['share_position0']:.1f}% | "
                     f"{100 * ls['share_massive']:.1f}% | {100 * rm['share_position0']:.1f}% |")
    if "logits" in results:
        lines += ["", "The whole model with each variant in the span's place: mean KL(original || variant) per "
                  "predicted token relative to removal's (lower is better), then top-1 agreement with the original "
                  "and perplexity:", "",
                  "| variant | " + " | ".join(texts) + " |", "|---|" + "---:|" * len(texts)]
        logits = results["logits"]
        for variant in logits[texts[0]]:
            cells = [f"{logits[t][variant]['kl_relative']:.3f} ({logits[t][variant]['kl']:.3f} nats)" for t in texts]
            lines.append(f"| KL {variant} | " + " | ".join(cells) + " |")
        for variant in logits[texts[0]]:
            cells = [f"{100 * logits[t][variant]['top1_agreement']:.1f}% / {logits[t][variant]['ppl']:.2f}"
                     for t in texts]
            lines.append(f"| top-1 / ppl {variant} | " + " | ".join(cells) + " |")
        def ratio(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}"

        for variant in logits[texts[0]]:
            cells = [f"{ratio(logits[t][variant]['kl_early_relative'])} / "
                     f"{ratio(logits[t][variant]['kl_late_relative'])}" for t in texts]
            lines.append(f"| KL early / late {variant} | " + " | ".join(cells) + " |")
        lines += ["", f"KL early / late: relative KL of the predictions from positions below {EARLY} / from the rest "
                  "(share of early predictions: " + ", ".join(
                      f"{t} {100 * logits[t]['removal']['early_tokens'] / logits[t]['removal']['tokens']:.0f}%"
                      for t in texts) + ")."]
    lines += ["", "Texts: " + "; ".join(f"{t}: {s}" for t, s in results["sources"].items()), ""]
    return "\n".join(lines)


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
