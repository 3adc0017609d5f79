"""What one comparison runs: :class:`CompareConfig`, the methods and drops it names, and each cell's prune config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from eval.compare.metrics import METRICS
from prune.checkpoint.load_config import LoadConfig
from prune.data.calibration import DataConfig
from prune.errors import LayercutError
from prune.model.adapters import get_blocks
from prune.pipeline.config import PruneConfig
from prune.pipeline.recipes import config_from_recipe, method_recipes, method_summary, resolve_method
from prune.replace import parameter_count
from prune.selection.strategies import parse_drop
from prune.selection.sublayers import is_sublayer, parse_units


@dataclass
class CompareConfig:
    """One comparison: every method recipe x every drop on one model and one calibration.

    Attributes:
        load: the model and how it loads.
        data: the calibration text, drawn and scored once for every cell.
        drops: block counts to remove, sorted and unique.
        methods: method name -> recipe file.
        out: the folder of ``results.json``, ``README.md`` and the plots.
        heldout: the held-out texts, one perplexity domain each (``novel=emma.txt,news=ptb.txt``); None:
            the calibration's held-out sequences, one domain per ``data`` source.
        heldout_tokens: score only the first this many tokens of each held-out text (None: all).
        tasks: lm-eval tasks, in order.
        limit: rows per lm-eval task (``eval.quality.evaluate.parse_limit``'s values; None: whole splits).
        data_dir: local lm-eval data laid out like ``shared/data``.
        batch_size: sequences per forward pass while scoring, fitting and measuring.
        speed_tokens: decode steps timed per model for the speed-up (0: skip).
        oracle: also run SLEB's oracle and each score's Spearman correlation with it.
        metrics: registered metrics (``eval.compare.metrics``) measured on every model besides the standard ones.
        keep_checkpoints: keep every cell's weights under ``cells/``.
        engine: the engine that times the decode speed-up (a name of ``eval.speed.engines``' registry);
            another than transformers times each cell's written checkpoint (a GGUF export for llama.cpp).
        overwrite: start afresh in an ``out`` that holds another comparison.
    """

    load: LoadConfig
    data: DataConfig
    drops: list[int]
    methods: dict[str, Path]
    out: Path
    heldout: str | None = None
    heldout_tokens: int | None = None
    tasks: list[str] = field(default_factory=list)
    limit: int | float | str | None = None
    data_dir: str | None = None
    batch_size: int = 4
    speed_tokens: int = 32
    oracle: bool = False
    keep_checkpoints: bool = False
    overwrite: bool = False
    metrics: list[str] = field(default_factory=list)
    engine: str = "transformers"

    def __post_init__(self):
        self.out = Path(self.out)
        for name in self.metrics:
            METRICS.get(name)  # an unknown name is one line listing the known ones
        if not self.drops or min(self.drops) <= 0:
            raise LayercutError("--drop takes positive block counts like 2,4,6,8")
        if not self.methods:
            raise LayercutError("--methods is empty: pass all, list, or method names")
        if self.batch_size <= 0:
            raise LayercutError(f"--batch-size must be positive, got {self.batch_size}")
        from eval.speed.engines import get_engine

        get_engine(self.engine).check()  # unknown or not installed: one line before any cell runs
        if self.speed_tokens < 0:
            raise LayercutError(f"--speed-tokens must be >= 0 (0: skip), got {self.speed_tokens}")
        if self.heldout_tokens is not None and self.heldout_tokens <= 0:
            raise LayercutError(f"--heldout-tokens must be positive, got {self.heldout_tokens}")

    @property
    def seq_len(self) -> int:
        """Tokens per sequence, for calibration and held-out perplexity alike."""
        return self.data.seq_len

    def setup(self) -> dict:
        """What every cell of one comparison shares; a ``--out`` written for another setup is refused."""
        # heldout and tasks are not here: domains and tasks can be added to a comparison
        return {"model": self.load.model, "load": dataclasses.asdict(self.load), "data": dataclasses.asdict(self.data),
                "heldout_tokens": self.heldout_tokens, "batch_size": self.batch_size,
                "speed_tokens": self.speed_tokens, "engine": self.engine}


def parse_drops(text: str | None, model: str | None = None) -> list[int]:
    """``"2,4,6,8"`` -> ``[2, 4, 6, 8]`` (sorted, unique, positive); ``"25%"`` as ``prune.run`` reads it.

    A share counts the blocks of ``model``'s config (read without its weights), as ``prune.run --drop 25%`` does.
    """
    if not text:
        raise LayercutError("--drop is required: block counts to remove, e.g. --drop 4 or --drop 2,4,6,8")
    parts = [part.strip() for part in text.split(",") if part.strip()]
    blocks = _blocks_of(model, text) if any(part.endswith("%") for part in parts) else 0
    try:
        drops = sorted({parse_drop(part, blocks) if part.endswith("%") else int(part) for part in parts})
    except ValueError:
        raise LayercutError(f"--drop takes block counts like 2,4,6,8 or shares like 25%, got '{text}'") from None
    if not drops or drops[0] <= 0:
        raise LayercutError(f"--drop takes positive block counts like 2,4,6,8, got '{text}'")
    return drops


def _blocks_of(model: str | None, text: str) -> int:
    """The block count a share of ``--drop`` is taken of."""
    from prune.loading.loader import load_config
    from prune.model.adapters import config_layer_count

    model_config = load_config(model) if model else None
    count = config_layer_count(model_config) if model_config is not None else None
    if count is None:
        raise LayercutError(f"--drop {text}: a share needs the model's block count, which its config does not give "
                            "before conversion: pass block counts (--drop 2,4)")
    return count


def parse_methods(text: str) -> dict[str, Path]:
    """``all``, or a comma list of method names / recipe files -> name -> recipe path."""
    if text.strip() == "all":
        methods = method_recipes()
        if not methods:
            raise LayercutError("--methods all found no method recipe: name recipe files instead")
        return methods
    chosen = {}
    for item in (part.strip() for part in text.split(",") if part.strip()):
        path = resolve_method(item)
        chosen[item if item in method_recipes() else path.stem] = path
    if not chosen:
        raise LayercutError("--methods is empty: pass all, list, or method names")
    return chosen


def method_list() -> str:
    """One line per known method: its name, what its checkpoint serves in, and its recipe's summary."""
    methods = method_recipes()
    width = max((len(name) for name in methods), default=0)
    lines = [f"{'method':<{width}}  {'serves':<9}  what it does", f"{'':-<{width}}  {'':-<9}  {'':-<12}"]
    lines += [f"{name:<{width}}  {method_serving(path):<9}  {method_summary(path)}" for name, path in methods.items()]
    return "\n".join(lines)


def method_serving(path: Path) -> str:
    """``plain`` (every engine runs its checkpoint), ``DeciLM`` (per-layer shapes) or ``maps`` (prune.load only)."""
    from prune.replace.registry import get_method

    config = config_from_recipe(path, {"drop": 1})
    if is_sublayer(parse_units(config.unit)):
        return "DeciLM"
    return "plain" if get_method(config.replace.method).servable else "maps"


def cell_config(config: CompareConfig, path: Path, drop: int, out: Path | None,
                budget: tuple[int, float] | None = None) -> PruneConfig:
    """The method's recipe with the comparison's model, data, drop and batch size on top.

    A method that removes sub-layers (``unit: attention,mlp``) meets, at drop K, the parameter count
    of the model less K blocks (``budget``: the model's parameters and a block's), so its row compares
    with the whole-block rows at equal parameters; without ``budget`` (checks before the model loads)
    K stands in as a sub-layer count.
    """
    overrides = {"load": dataclasses.asdict(config.load), "data": dataclasses.asdict(config.data), "drop": drop,
                 "batch_size": config.batch_size, "out": None if out is None else str(out), "overwrite": True}
    prune_config = config_from_recipe(path, overrides)
    if budget is not None and is_sublayer(parse_units(prune_config.unit)):
        total, block = budget
        prune_config = dataclasses.replace(prune_config, drop=None, target_params=int(total - drop * block))
    return prune_config


def block_budget(model) -> tuple[int, float]:
    """The model's parameters and its mean block's: what a drop of K blocks frees, for sub-layer methods."""
    _, blocks = get_blocks(model)
    return parameter_count(model), sum(parameter_count(b) for b in blocks) / len(blocks)
