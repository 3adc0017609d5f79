"""Score every block of a decoder, drop (or replace) the most linear ones, export a checkpoint.

    python -m prune.run --model smollm2-135m --drop 4 --out slim/     # repaired: --replace auto (fold here)
    python -m prune.run --model smollm2-135m --drop 4 --replace none --out slim-rm/   # removal only
    python -m prune.run --model smollm2-135m --drop 4 --replace linear --out slim-lin/   # maps no engine runs
    python -m prune.run --model opt-1.3b --drop 4 --replace linear --distill-steps 2000 --out opt-slim/
    python -m prune.run --model opt-1.3b --drop 25% --select span --out opt-1.3b-slim/
    python -m prune.run --recipe recipes/smollm2-drop4.yaml --samples 8      # flags win over the recipe
    python -m prune.run --model gpt2 --score angular            # scores only, nothing written
    python -m prune.run --list-architectures                    # which transformers architectures prune
    python -m prune.run --model smollm2-135m --drop 4 --replace linear --plan   # memory and time, no weights read

Prints a table of every block's scores; writes the checkpoint, its tokenizer, ``layercut.json``, a
model card, ``scores.md`` and ``linearity_profile.png`` to ``--out`` (default ``<model>-drop<K>``
when dropping). Checkpoints with linear / low-rank maps also hold ``replacements.safetensors``:
load them with ``prune.load(path)``.
"""

from __future__ import annotations

import argparse
import dataclasses

from prune.checkpoint.exports import EXPORTS, export_dests, export_targets
from prune.checkpoint.load_config import LoadConfig
from prune.checkpoint.write import describe_generalisation
from prune.data.calibration import DataConfig
from prune.errors import CommandParser, LayercutError, cli_entry
from prune.loading.catalog import model_table
from prune.measure.score_report import score_table
from prune.measure.scores import SCORES
from prune.model.architectures import architecture_markdown
from prune.options import (
    add_data_arguments,
    add_load_arguments,
    add_output_arguments,
    add_threads_argument,
    apply_threads,
    explicit_flags,
)
from prune.pipeline.config import PruneConfig
from prune.pipeline.runner import preflight, run_prune
from prune.planner.estimate import (
    PLAN_FLAGS,
    RunPlan,
    add_plan_arguments,
    format_plan,
    hardware_from_args,
    plan_config,
    refuse_if_too_big,
    write_plan_json,
)
from prune.replace import METHODS, describe_replacement
from prune.replace.registry import describe_option, option_specs
from prune.selection.strategies import DEFAULT_PROTECT, SELECTIONS, selection_help

# Flags defined with a shared dataclass land in its section; the others' dest is their path in a PruneConfig
# ("replace.update_scale"), or the top-level key of the same name.
SHARED_SECTIONS = {"load": LoadConfig, "data": DataConfig}
NOT_CONFIG = {"recipe", "threads", "list_models", "list_architectures", "plan_teacher_cache", *PLAN_FLAGS}
EXPORT_GROUP = "serving export"  # flags of the export targets: none of them is a PruneConfig key


def build_parser() -> argparse.ArgumentParser:
    """The ``prune.run`` argument parser."""
    parser = CommandParser(prog="python -m prune.run", description=__doc__.split("\n")[0])
    add_load_arguments(parser, offload=True)
    add_data_arguments(parser, samples=64, seq_len=512, heldout_samples=8)
    group = parser.add_argument_group("selection")
    group.add_argument("--drop", default=None,
                       help="blocks to remove: a count (4) or a share (25%%); omit to only score")
    group.add_argument("--target-params", default=None, metavar="N|P%",
                       help="in place of --drop: remove the fewest blocks that bring the parameters to N (110M, "
                       "1.2B) or P%% of the model's")
    group.add_argument("--target-speedup", type=float, default=None, metavar="X",
                       help="in place of --drop: remove the fewest blocks whose ideal decode speed-up L/(L-K) "
                       "reaches X (1.25)")
    group.add_argument("--unit", default="block",
                       help="what goes: block (default), or a block's attention or MLP sub-layer alone: attention, "
                       "mlp, or attention,mlp (then --drop counts sub-layers, ranked by --score with --select "
                       "topk or by the measured cost of skipping each with --select measured; a block losing both goes "
                       "whole; the export loads with prune.load or "
                       "trust_remote_code)")
    group.add_argument("--score", default="linearity", choices=list(SCORES),
                       help="ranking criterion (default: linearity)")
    group.add_argument("--select", default="topk", choices=list(SELECTIONS),
                       help=selection_help().replace("%", "%%") + " (default: topk)")
    group.add_argument("--oracle", action="store_true",
                       help="also measure the calibration perplexity with each block alone removed (one pass per "
                       "block) and each score's Spearman correlation with it, into scores.md")
    group.add_argument("--protect", default=DEFAULT_PROTECT,
                       help="blocks never dropped, negative from the end, or 'none' (default: 0,-1 = first and last)")
    group.add_argument("--batch-size", type=int, default=4,
                       help="sequences per forward pass while scoring and fitting (default: 4)")
    _add_replacement_arguments(parser)
    group = parser.add_argument_group("recipe")
    group.add_argument("--recipe", default=None,
                       help="YAML recipe (see recipes/); flags typed on the command line win over its values")
    parser.add_argument("--list-models", action="store_true",
                        help="list the model aliases, their hub ids and whether each loads offline now, then exit")
    parser.add_argument("--list-architectures", action="store_true",
                        help="list every causal-LM architecture of the installed transformers with whether layercut "
                        "prunes it (each built tiny and read; about a minute), then exit")
    add_output_arguments(parser, what="the checkpoint and reports (default: <model>-drop<K> when dropping, "
                         "nothing when only scoring)")
    group = parser.add_argument_group(EXPORT_GROUP)
    targets = export_targets()
    group.add_argument("--export", choices=targets.names(), default=None,
                       help="also write the checkpoint for a serving engine: "
                       + "; ".join(f"{name}, {target.help}" for name, target in targets.items()))
    for target in targets.values():
        target.add_arguments(group)
    add_threads_argument(parser)
    add_plan_arguments(parser)
    parser.add_argument("--plan-teacher-cache", type=int, default=None, metavar="K",
                        help="plan as if the teacher's top-K logits were cached (distill.run --teacher-cache topk=K)")
    return parser


def _add_replacement_arguments(parser: argparse.ArgumentParser) -> None:
    """``--replace``, ``--fit``, every option of the registered methods, ``--fit-short`` and distillation."""
    group = parser.add_argument_group("replacement")
    group.add_argument("--replace", dest="replace.method", default="auto", metavar="METHOD",
                       help="what takes the removed blocks' place: " + "; ".join(
                           f"{name}: {spec.description}" for name, spec in METHODS.items())
                       + " (default: auto: the best training-free repair whose checkpoint every engine runs, for the "
                       "model's layout: " + ", ".join(m.name for m in METHODS.values() if m.default_for)
                       + " or, where none applies, none)")
    group.add_argument("--fit", dest="replace.fit", default="independent", metavar="FIT",
                       help="independent: fit each span on the original model's states; sequential: on the states "
                       "of the model with the earlier spans already replaced (two passes per later span) "
                       "(default: independent)")
    group.add_argument("--fit-rows", dest="replace.fit_rows", default="all", metavar="ROWS",
                       help="all: fit the repair on every calibration row; fitting: on the rows --select repaired "
                       "fits on (7 in 8), reusing its fits, so the KL it measured on the others is the "
                       "checkpoint's (prune.ship's build) (default: all)")
    for name, spec in option_specs().items():  # the fields of the methods' options (prune.replace.options)
        if spec.flag is not None:
            group.add_argument(spec.flag, dest=f"replace.{name}", type=spec.type, default=None,
                               metavar=spec.metavar or name.upper(), help=describe_option(name))
    group.add_argument("--fit-short", dest="replace.short", type=int, default=None, metavar="N",
                       help="also fit the replacements on the calibration cut into N-token sequences, as short "
                       "as task prompts (0: off; default: the method's recipe, else 0)")
    group.add_argument("--distill-steps", dest="distill.steps", type=int, default=0, metavar="N",
                       help="after surgery, distil against the original model's logits for N steps "
                       "(distill.config.DistillConfig defaults; default: 0 = no distillation)")
    group.add_argument("--distill-samples", dest="distill.data.samples", type=int, default=None, metavar="N",
                       help="sequences of distillation text (default: 512, enough for 200 steps of 4; give more "
                       "with more steps: each sequence read more than a few times is memorised)")


def plan_of(args: argparse.Namespace, config: PruneConfig) -> RunPlan:
    """The plan of ``config`` on the devices the flags name (this machine's, or the ``--plan-*`` what-ifs)."""
    if args.plan_teacher_cache is not None:
        config = dataclasses.replace(config, distill={**config.distill, "teacher_cache": args.plan_teacher_cache})
    return plan_config(config, hardware_from_args(args, config.load.device))


def _config_path(dest: str) -> tuple[str, ...]:
    """Where the flag of ``dest`` lands in a :class:`PruneConfig`: its path of keys."""
    if "." in dest:
        return tuple(dest.split("."))
    for section, cls in SHARED_SECTIONS.items():
        if dest in {item.name for item in dataclasses.fields(cls)}:
            return section, dest
    return (dest,)


def config_values(args: argparse.Namespace, only: set[str] | None = None) -> dict:
    """The flags as nested :class:`PruneConfig` keys; ``only`` keeps just those flags (the ones typed)."""
    values: dict = {}
    for dest, value in vars(args).items():
        if dest in NOT_CONFIG or dest in export_dests() or (only is not None and dest not in only):
            continue
        if value is None:
            continue  # not given: the config's own default (a method's, the loader's)
        *sections, key = _config_path(dest)
        node = values
        for section in sections:
            node = node.setdefault(section, {})
        node[key] = value
    if values.get("distill", {}).get("steps") == 0 and only is None:
        del values["distill"]
    return values


def config_from_args(args: argparse.Namespace, typed: set[str] | None = None) -> PruneConfig:
    """Map parsed flags (over ``--recipe`` when given: ``typed`` flags win) onto :class:`PruneConfig`."""
    samples = getattr(args, "distill.data.samples")
    if samples is not None and samples <= 0:
        raise LayercutError(f"--distill-samples must be a positive integer, got {samples}")
    if args.recipe:
        from prune.pipeline.recipes import config_from_recipe  # here, not at the top: yaml slows --help

        config = config_from_recipe(args.recipe, config_values(args, typed or set()))
    else:
        config = PruneConfig(**config_values(args))
    if samples is not None and not config.step_sections():
        raise LayercutError("--distill-samples sizes the distillation text: pass --distill-steps N (> 0) too")
    return config


def print_summary(result) -> None:
    """The score table and one line per thing the run did."""
    report = result.report
    if "sublayers" in report:
        print_units_summary(result)
        return
    print(score_table(result.scores, result.dropped))
    if "oracle" in report:
        rho = ", ".join(f"{name} {value:+.2f}" for name, value in report["oracle"]["spearman"].items())
        print(f"\noracle (Spearman of each score with single-block removal perplexity): {rho}")
    if "budget" in report:
        b = report["budget"]
        goal = (f"--target-params {b['target_params']:,}" if "target_params" in b
                else f"--target-speedup {b['target_speedup']} (ideal {b['ideal_speedup']:.3f}x)")
        print(f"\n{goal}: {b['drop']} blocks; parameters {b['params_before']:,} -> {b['params_after']:,}")
    print(f"\n{report['num_blocks_before']} blocks -> {report['num_blocks_after']}; dropped {result.dropped} "
          f"by {report['select']} on {report['score']} over {report['data']['tokens']} tokens "
          f"in {report['seconds']:.1f}s")
    if "span_scores" in report:
        best = ", ".join(f"{span['blocks'][0]}-{span['blocks'][1]}: {span[report['score']]:.4f}"
                         for span in report["span_scores"][:3])
        print(f"spans by {report['score']} (best first): {best}")
    if report.get("config", {}).get("auto_replace"):
        print(f"--replace auto: {report['replace']}, the best training-free repair of a plain {report['architecture']} "
              "checkpoint here (--replace none removes only)")
    for record in report["replacements"]:
        print(describe_replacement(record))
    if "heldout" in report:
        h = report["heldout"]
        print(f"held-out perplexity ({h['samples']} x {h['seq_len']} tokens of the calibration source, unseen by "
              f"scoring and fitting): original {h['original']:.3f} -> {h['pruned']:.3f} (x{h['ratio']:.3f})"
              + (f"; removal of the same blocks alone: {h['removal']:.3f} (x{h['removal_ratio']:.3f})"
                 if "removal" in h else "")
              + ("; distillation drew its own sequences from the same text" if "distill" in report else ""))
    if "distill" in report:
        fit = describe_generalisation(report["distill"].get("generalisation"))
        print(f"distilled {report['distill']['steps']} steps: loss {report['distill']['first_loss']} -> "
              f"{report['distill']['final_loss']}" + (f"; {fit}" if fit else ""))
    if result.out is not None:
        print(f"wrote {result.out}/")


def print_units_summary(result) -> None:
    """The sub-layer score table and what a ``--unit attention/mlp`` run removed."""
    report = result.report
    scores = {k: v for k, v in report["sublayer_scores"].items() if k != "units"}
    removal = report["sublayers"]
    removed = [report["sublayer_scores"]["units"].index(u) for u in removal["units"]]
    print(score_table(scores, removed, labels=report["sublayer_scores"]["units"]))
    if "budget" in report:
        b = report["budget"]
        print(f"\n--target-params {b['target_params']:,}: {b['drop']} sub-layers; parameters {b['params_before']:,} "
              f"-> {b['params_after']:,}")
    by = (f"measured cost per parameter ({report['sublayer_measured']['sequences']} sequences)"
          if "sublayer_measured" in report else report["score"])
    print(f"\nremoved {len(removal['units'])} sub-layer(s) by {by} over {report['data']['tokens']} "
          f"tokens: {', '.join(removal['units'])}; blocks removed whole: {removal['blocks_removed_whole'] or 'none'}; "
          f"{report['num_blocks_before']} blocks -> {report['num_blocks_after']} in {report['seconds']:.1f}s")
    if "heldout" in report:
        h = report["heldout"]
        print(f"held-out perplexity ({h['samples']} x {h['seq_len']} tokens of the calibration source, unseen by "
              f"scoring): original {h['original']:.3f} -> {h['pruned']:.3f} (x{h['ratio']:.3f})")
    if result.out is not None:
        print(f"wrote {result.out}/")


@cli_entry
def main(argv: list[str] | None = None) -> int:
    """Run the prune CLI; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_models:
        print(model_table())
        return 0
    if args.list_architectures:
        print(architecture_markdown())
        return 0
    apply_threads(args)
    config = config_from_args(args, explicit_flags(parser, argv))
    if args.plan:
        plan = plan_of(args, config)
        print(format_plan(plan))
        write_plan_json(plan, args.plan_json)
        return 0
    target = EXPORTS.get(args.export) if args.export else None
    options = target.options_from_args(args) if target is not None else None
    if target is not None:
        target.check(config, options)
    amounts = None
    if not args.no_plan_check:
        # the inputs first: a --seq-len past the model's positions is the error, not its memory; run_prune reuses them
        amounts = preflight(config)
        refuse_if_too_big(config, lambda: plan_of(args, config))
    result = run_prune(config, steps=config.build_steps(), amounts=amounts)
    print_summary(result)
    if target is not None and result.out is not None:
        print(target.write(result.out, options))
    return 0


def console_main() -> None:
    """Console-script entry point."""
    raise SystemExit(main())


if __name__ == "__main__":
    console_main()
