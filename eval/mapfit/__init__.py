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

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from prune.data.calibration import load_documents
from prune.data.windows import encode, text_windows
from prune.errors import LayercutError
from prune.measure.least_squares import LinearFit, fit_linear_map, scale_update
from prune.measure.moments import PairMoments
from prune.measure.perplexity import target_nll
from prune.model.adapters import get_blocks, input_device
from prune.model.capture import block_input, block_output, hooks_held, residual_states, with_block_output
from prune.replace.capture import PairAccumulator

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
            sums[name]["nll"] += float(target_nll(logp, target).sum())
    late = tokens - early
    report = {name: {"kl": s["kl"] / tokens, "top1_agreement": s["agree"] / tokens,
                     "ppl": math.exp(s["nll"] / tokens), "tokens": tokens,
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
    """One text as sequences: windows of ``seq_len`` (one document) or one per document (several).

    Tokenized with the tokenizer's special tokens (``special_tokens=True`` in ``prune.data.windows``: BOS
    first for Llama-family tokenizers), as the ``--heldout`` figures in reports were measured; the
    calibration sequences beside them are packed text, without.
    """
    documents, source = load_documents(spec, flag="--heldout")
    if len(documents) == 1:
        windows = text_windows(tokenizer, documents, seq_len, special_tokens=True)  # [windows, seq_len]
        sequences = list(windows[: -(-max_tokens // seq_len)])  # whole windows until max_tokens is reached
    else:
        sequences, total = [], 0
        for document in documents:
            if total >= max_tokens:
                break
            ids = torch.tensor(encode(tokenizer, document, special_tokens=True)[:seq_len], dtype=torch.long)
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


