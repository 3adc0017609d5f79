"""Markdown for a lens run: per-layer tables, parameter counts, early exit, stand-ins and the papers' claims.

Everything is read from the results dict that ``eval.lens.pipeline`` writes as ``results.json``.
"""

from __future__ import annotations


def _fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _intermediate(results: dict) -> range:
    """Layers after at least one block and before the last one, where the shortcuts differ."""
    return range(1, results["num_blocks"])


def claims(results: dict) -> dict:
    """The papers' claims, counted on this run (layers 1..L-1; "first half" = layers 1..L/2)."""
    per, count = results["per_layer"], results["num_blocks"]
    layers, first_half = _intermediate(results), range(1, count // 2 + 1)
    out: dict = {"layers_compared": len(layers), "first_half_layers": len(first_half)}

    def wins(a: str, b: str, metric: str, over: range) -> int:
        return sum(per[a][metric][layer] > per[b][metric][layer] for layer in over)

    if "id" in per and "mat" in per:
        out["mat_beats_id_r2_layers"] = wins("mat", "id", "r2", layers)
        out["mat_beats_id_precision@1_layers"] = wins("mat", "id", "precision@1", layers)
    if "n-njtc" in per and "id" in per:
        out["n-njtc_beats_id_precision@1_first_half"] = wins("n-njtc", "id", "precision@1", first_half)
        out["n-njtc_beats_id_r2_first_half"] = wins("n-njtc", "id", "r2", first_half)
    if "n-njtc" in per:
        out["n-njtc_params_share_of_mat"] = results["shortcuts"]["n-njtc"]["share_of_mat"]
    exits = results.get("early_exit") or {}
    if "mat_minus_id_saved_share" in exits:
        out["mat_minus_id_layers_saved_share"] = exits["mat_minus_id_saved_share"]
    return out


def shortcut_table(results: dict) -> str:
    """Markdown: each shortcut's description and parameter counts."""
    lines = ["| shortcut | map | params / layer | params, all layers | share of mat |", "|---|---|---:|---:|---:|"]
    for name, info in results["shortcuts"].items():
        lines.append(f"| {name} | {info['description']} | {info['params_per_layer']:,} | {info['params_total']:,} "
                     f"| {info['share_of_mat']:.2%} |")  # fmt: skip
    return "\n".join(lines)


def layer_table(results: dict, metrics: list[tuple[str, str, int]]) -> str:
    """Markdown, one row per layer, columns ``metric`` of every shortcut; ``metrics`` = (key, header, digits)."""
    names = list(results["per_layer"])
    header = "| layer | " + " | ".join(f"{n} {h}" for n in names for _, h, _ in metrics) + " |"
    rule = "|---:|" + "---:|" * (len(names) * len(metrics))
    rows = [
        f"| {layer} | " + " | ".join(_fmt(results["per_layer"][n][key][layer], digits)
                                     for n in names for key, _, digits in metrics) + " |"
        for layer in results["layers"]
    ]  # fmt: skip
    return "\n".join([header, rule, *rows])


def early_exit_table(results: dict) -> str:
    """Markdown: layers used and saved at the precision goal, per shortcut."""
    exits = results["early_exit"]
    count = results["num_blocks"]
    lines = [f"| shortcut | mean layers used at Precision@1 >= {exits['goal']} | layers saved (of {count}) "
             "| saved share |", "|---|---:|---:|---:|"]  # fmt: skip
    for name, data in exits["shortcuts"].items():
        share = data["saved_share"]
        lines.append(f"| {name} | {_fmt(data['layers_used_at_goal'], 2)} | {_fmt(data['layers_saved_at_goal'], 2)} "
                     f"| {'-' if share is None else f'{share:.1%}'} |")  # fmt: skip
    if "mat_minus_id_saved_share" in exits:
        lines += ["", f"mat saves {exits['mat_minus_id_saved_share']:+.1%} of the layers more than id."]
    return "\n".join(lines)


def submodule_table(results: dict) -> str:
    """Markdown: Precision@1 / surprisal of the full model with one part of one block replaced."""
    sub = results["submodules"]
    parts = sub["parts"]
    lines = ["| block | " + " | ".join(f"{p} P@1 | {p} surprisal" for p in parts) + " |",
             "|---:|" + "---:|" * (2 * len(parts))]  # fmt: skip
    for row in sub["rows"]:
        cells = " | ".join(f"{row[p]['precision@1']:.3f} | {row[p]['surprisal']:.3f}" for p in parts)
        lines.append(f"| {row['block']} | {cells} |")
    return "\n".join(lines)


def claims_list(results: dict) -> list[str]:
    """The claims as bullet lines."""
    found, lines = results.get("claims") or {}, []
    n, half = found.get("layers_compared"), found.get("first_half_layers")
    if "mat_beats_id_r2_layers" in found:
        lines.append(f"- mat beats id in R^2 at {found['mat_beats_id_r2_layers']}/{n} intermediate layers "
                     f"and in Precision@1 at {found['mat_beats_id_precision@1_layers']}/{n}.")  # fmt: skip
    if "n-njtc_params_share_of_mat" in found:
        lines.append(f"- n-njtc uses {found['n-njtc_params_share_of_mat']:.2%} of mat's parameters.")
    if "n-njtc_beats_id_precision@1_first_half" in found:
        lines.append(f"- n-njtc beats id in Precision@1 at {found['n-njtc_beats_id_precision@1_first_half']}/{half} "
                     f"layers of the first half (R^2: {found['n-njtc_beats_id_r2_first_half']}/{half}).")  # fmt: skip
    if "mat_minus_id_layers_saved_share" in found:
        lines.append(f"- early exit at 95% precision: mat saves {found['mat_minus_id_layers_saved_share']:+.1%} "
                     "of the layers more than id (paper: +7.9% on GPT-2).")  # fmt: skip
    return lines


def lens_readme(results: dict, figures: list[str]) -> str:
    """The README.md of a lens output folder."""
    data = results["data"]
    lines = [
        f"# Lens: what each layer of {results['model']} already predicts",
        "",
        f"{results['num_blocks']} blocks, hidden size {results['hidden_size']}. Fit on {data['fit']['tokens']} "
        f"tokens of {data['fit']['source']}; evaluated on {data['eval']['tokens']} held-out tokens of "
        f"{data['eval']['source']} ({data['split']}).",
        "",
        "Layer l is the residual stream after l blocks (0 = embeddings, L = the full model). Each shortcut maps it to "
        "a guess of the last block's output, read by the model's own final norm and LM head. Precision@k: the full "
        "model's top-1 token is in the shortcut's top-k; surprisal: -log p of that token, in nats; R^2: coordinate-"
        "averaged, held out. Files: `results.json` (all numbers), `shortcuts.safetensors` "
        "(`eval.lens.shortcuts.load_shortcuts(folder)`).",
        "",
        "## Shortcuts",
        "",
        shortcut_table(results),
        "",
        "## Precision@1 and surprisal per layer",
        "",
        layer_table(results, [("precision@1", "P@1", 3), ("surprisal", "surprisal", 2)]),
        "",
        "## R^2 per layer",
        "",
        layer_table(results, [("r2", "R^2", 3)]),
        "",
        "## Precision@5 and Precision@10 per layer",
        "",
        layer_table(results, [("precision@5", "P@5", 3), ("precision@10", "P@10", 3)]),
        "",
    ]  # fmt: skip
    if results.get("early_exit"):
        first, last = results["early_exit"]["exit_layers"]
        lines += ["## Early exit", "", f"Each token exits at the first layer l in {first}..{last} whose top-1 "
                  f"probability exceeds lambda (else it runs all {results['num_blocks']} blocks); layers used = "
                  "blocks run; lambda swept over [0, 1].", "", early_exit_table(results), ""]  # fmt: skip
    if results.get("submodules"):
        lines += ["## Sub-module stand-ins", "", "One part of one block replaced by an affine map fitted from its "
                  "input to its output; final predictions against the original model's top-1.", "",
                  submodule_table(results), ""]  # fmt: skip
    claim_lines = claims_list(results)
    if claim_lines:
        lines += ["## The papers' claims on this model", "", *claim_lines, ""]
    if figures:
        lines += ["## Figures", "", *(f"![{name}]({name})" for name in figures), ""]
    return "\n".join(lines)
