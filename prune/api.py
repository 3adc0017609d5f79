"""The Python API for a model already in memory: :func:`slim`, :func:`score` and :func:`save` (``prune.slim``, ...).

The ecosystem's one-call shape (llm-compressor's ``oneshot``, ModelOpt's ``mtp.prune``, PEFT's
``get_peft_model``) over the same pipeline as ``python -m prune.run`` (:func:`prune.pipeline.runner.run_prune`)::

    import prune
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")
    tokenizer = AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")
    result = prune.slim(model, tokenizer, drop=4, replace="fold")   # SlimResult(llama: 30 -> 26 blocks, ...)
    result.model.generate(...)                                       # the same object as model, surgered in place
    prune.save(result, "slim4/", export="gguf")                      # the folder prune.run --out writes

:func:`slim` changes the model in place, on the device and in the dtype it came in, and writes nothing: no
output folder, and calibration that needs no cache. ``data=None`` reads the novel layercut ships (``builtin``)
rather than ``prune.run``'s default mixture, whose self-sampled half is drawn from the model and kept under
``$LAYERCUT_CACHE``; ``data`` also takes a list of texts or what ``--data`` takes (a file, a ``datasets`` spec,
a mixture). Its keyword options are ``prune.run``'s flags spelled as Python names (``samples=8``,
``seq_len=256``, ``select="span"``, ``update_scale=0.5``): the fields of
:class:`~prune.pipeline.config.PruneConfig`, of its ``data`` section and of the replacement method.

Everything heavy is imported inside the functions, so ``import prune`` stays light.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prune.errors import LayercutError

if TYPE_CHECKING:
    from prune.data.calibration import CalibrationData, DataConfig
    from prune.loading.loader import LoadedModel
    from prune.pipeline.config import PruneConfig
    from prune.pipeline.runner import PruneResult

__all__ = ["ScoreTable", "SlimResult", "save", "score", "slim"]

# what slim calibrates on when not told: the shipped novel, read from the package; nothing is sampled or cached
API_DATA = "builtin"
# what prune.save takes, for the one line that refuses anything else
_SAVE_FORMS = ("takes the result of prune.slim and a folder, save(result, 'out/'), or a model, its tokenizer, a "
               "folder and a report dict, save(model, tokenizer, 'out/', report)")
# PruneConfig fields that the model in memory and the rule "writes nothing" fix; the fix of each, for the refusal
_NOT_OPTIONS = {
    "load": "slim prunes the model it is given: load it yourself (prune.load(path) or from_pretrained)",
    "out": "slim writes nothing: save the result with prune.save(result, path)",
    "overwrite": "slim writes nothing: pass overwrite=True to prune.save(result, path)",
}


@dataclass
class SlimResult:
    """What :func:`slim` returns: the surgered model and the content of the ``layercut.json`` it would write.

    Attributes:
        model: the model given to :func:`slim`, surgered in place (the same object).
        tokenizer: its tokenizer, unchanged.
        dropped: the removed blocks, as 0-based indices of the model given.
        report: what ``layercut.json`` holds: every block's scores, the calibration data, the replacements, the
            held-out perplexities before and after, the configuration.
    """

    model: Any
    tokenizer: Any
    dropped: list[int]
    report: dict
    _run: PruneResult = field(repr=False)
    _config: PruneConfig = field(repr=False)

    def __repr__(self) -> str:
        report = self.report
        text = (f"SlimResult({report['architecture']}: {report['num_blocks_before']} -> {report['num_blocks_after']} "
                f"blocks, dropped {report['dropped']}, replace {report['replace']}")
        heldout = report.get("heldout")
        if heldout:
            text += (f", held-out perplexity {heldout['original']:.2f} -> {heldout['pruned']:.2f} "
                     f"(x{heldout['ratio']:.3f})")
        return text + ")"


class ScoreTable(list):
    """Every registered score of every block, nothing removed: one dict per block, ``{"block": i, score: value}``.

    A list of rows; ``scores`` holds the same values by score (``layercut.json``'s ``scores``), ``str()`` is the
    markdown table of ``scores.md``, and a notebook shows that table.
    """

    def __init__(self, scores: dict[str, list[float]], report: dict | None = None):
        count = len(next(iter(scores.values()))) if scores else 0
        super().__init__({"block": block, **{name: values[block] for name, values in scores.items()}}
                         for block in range(count))
        self.scores = scores
        self.data = (report or {}).get("data")

    def __str__(self) -> str:
        from prune.measure.score_report import score_table

        return score_table(self.scores)

    def _repr_markdown_(self) -> str:
        return str(self)


def slim(model, tokenizer, drop: int | str | None = 4, data: str | Sequence[str] | None = None,
         recipe: str | Path | None = None, replace: str | dict | None = None, **options) -> SlimResult:
    """Remove ``drop`` blocks of a transformers causal LM in memory, in place, and say what was done.

    Args:
        model: a ``*ForCausalLM`` (any architecture ``prune.run`` takes), on any device and in any dtype; it
            stays there. Not a PEFT-wrapped model (merge it first), nor a bitsandbytes one with a method that
            rewrites the kept weights.
        tokenizer: its tokenizer.
        drop: blocks to remove, a count (4) or a share ("25%"); None with ``target_params`` or
            ``target_speedup`` in ``options``.
        data: calibration text: None for the shipped novel (``builtin``), a list of texts, or what ``--data``
            takes (a ``.txt`` / ``.jsonl`` / ``.parquet`` file, a ``datasets`` spec, a weighted mixture).
        recipe: a method recipe by name (a file stem of ``recipes/methods/``, as ``eval.compare --methods``
            takes: ``"layercut-linear-vanilla"``) or a recipe file; ``drop``, ``replace`` and ``options`` win
            over it.
        replace: a replacement method (``"fold"``, ``"linear"``, ``"none"``, ...; default ``"auto"``, as
            ``prune.run``'s: the best training-free repair whose checkpoint every engine runs, for this model's
            layout), or a mapping of ``replace:`` keys.
        **options: ``prune.run``'s options as Python names: the fields of
            :class:`~prune.pipeline.config.PruneConfig` (``score``, ``select``, ``protect``, ``unit``,
            ``target_params``, ``target_speedup``, ``batch_size``, ``oracle``), of its ``data`` section
            (``samples``, ``seq_len``, ``seed``, ``text_field``, ``heldout_samples``) and the replacement
            method's (``update_scale``, ``rank``, ``fit``, ...).

    Returns:
        The :class:`SlimResult`; :func:`save` writes it.

    Raises:
        LayercutError: bad input, in one line naming the fix (not a model in memory, or one without its weights,
            no tokenizer or another model's, an unknown option or name, a PEFT-wrapped model, quantized weights a
            method would rewrite, a distillation step).
    """
    check_inputs(model, tokenizer, "prune.slim")
    config, texts = _slim_config(drop, data, recipe, replace, options)
    check_quantized(model, config.replace.method)
    loaded = _loaded(model, tokenizer, config)
    from prune.pipeline.runner import run_prune

    with _eval_mode(model):
        if texts is not None:
            config.resolve(model)  # the amounts and --seq-len checked against the model before the texts' pass
        scored = _scored(loaded, config, texts) if texts is not None else None
        result = run_prune(config, loaded=loaded, steps=[], scored=scored)
    if texts is not None:  # the report names the texts, not the placeholder spec the config was built with
        result.report["config"]["data"]["data"] = result.calibration.source
    return SlimResult(model, tokenizer, list(result.dropped), result.report, result, config)


def score(model, tokenizer, data: str | Sequence[str] | None = None, **options) -> ScoreTable:
    """Every registered score of every block of a model in memory; nothing is removed or written.

    Args:
        model: a transformers causal LM (as :func:`slim` takes).
        tokenizer: its tokenizer.
        data: calibration text, as :func:`slim` takes it (None: the shipped novel).
        **options: ``samples``, ``seq_len``, ``seed``, ``text_field`` (the calibration) and ``batch_size``.

    Returns:
        A :class:`ScoreTable`: one row per block, a column per registered score.
    """
    check_inputs(model, tokenizer, "prune.score")
    unknown = sorted(set(options) - {*_data_keys(), "batch_size"})
    if unknown:
        raise LayercutError(f"prune.score: unknown option(s) {', '.join(unknown)}; known: "
                            f"{', '.join(sorted({*_data_keys(), 'batch_size'}))}")
    config, texts = _slim_config(None, data, None, None, options)
    loaded = _loaded(model, tokenizer, config)
    from prune.data.calibration import calibration_data
    from prune.pipeline.runner import score_model

    with _eval_mode(model):
        calibration = (_texts_calibration(tokenizer, texts, config.data) if texts is not None
                       else calibration_data(tokenizer, config.data, model=loaded.model))
        _, scores = score_model(model, calibration, config)
    return ScoreTable(scores, {"data": calibration.describe()})


def save(model, *args, export: str | None = None, **kwargs) -> Path:
    """``prune.save``: write a :class:`SlimResult` as ``prune.run --out`` does, or a model as before.

    ``save(result, path, export=None, overwrite=False, **export_options)`` writes the checkpoint, ``layercut.json``,
    the model card, ``scores.md`` and the linearity profile into ``path`` (all or nothing); ``export`` then runs a
    registered export target on the folder (``"gguf"``: ``FOLDER/gguf/<name>-<type>.gguf`` by llama.cpp's converter,
    read back; options ``gguf_type`` and ``converter``, as ``--gguf-type`` / ``--converter``). The target's
    check runs first, so a checkpoint it cannot convert is refused before anything is written.

    ``save(model, tokenizer, out, report, overwrite=False, extra=None)`` is
    :func:`prune.checkpoint.save_load.save`, unchanged.

    Returns:
        The folder written.

    Raises:
        LayercutError: neither form: one line saying what ``prune.save`` takes.
    """
    if isinstance(model, SlimResult):
        try:
            inspect.signature(_save_result).bind(model, *args, **kwargs)
        except TypeError as err:
            raise LayercutError(f"prune.save(result, path) {_SAVE_FORMS} ({err})") from None
        return _save_result(model, *args, export=export, **kwargs)
    if export is not None:
        raise LayercutError("prune.save(..., export=...) takes the result of prune.slim: save(result, path, "
                            f"export={export!r})")
    from prune.checkpoint.save_load import save as save_checkpoint

    try:
        inspect.signature(save_checkpoint).bind(model, *args, **kwargs)
    except TypeError as err:
        raise LayercutError(f"prune.save {_SAVE_FORMS} ({err})") from None
    if not _is_module(model):
        raise LayercutError(f"prune.save {_SAVE_FORMS}; got a {type(model).__name__} where the result or the model "
                            "goes")
    return save_checkpoint(model, *args, **kwargs)


def _is_module(model) -> bool:
    """Whether ``model`` is a torch module (imported only when it is one: a module's class comes from torch)."""
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(model, torch.nn.Module)


def check_inputs(model, tokenizer, caller: str) -> None:
    """Refuse, in one line and before any work, what :func:`slim` and :func:`score` cannot run on.

    Not a model in memory (a name or a path), a PEFT-wrapped one (:func:`check_model`), weights on the meta device
    (built without them, or offloaded by accelerate: every pass would compute nothing), no tokenizer, or a tokenizer
    whose ids run past the model's embedding (another model's).
    """
    if not _is_module(model):
        shown = f" {model!r}" if isinstance(model, (str, Path)) else ""
        raise LayercutError(f"{caller} takes a model in memory (a transformers *ForCausalLM), got a "
                            f"{type(model).__name__}{shown}: load it first, prune.load(path).model or "
                            "AutoModelForCausalLM.from_pretrained(name), or run python -m prune.run --model NAME")
    check_model(model)
    on_meta = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if on_meta:
        raise LayercutError(f"{caller}: {len(on_meta)} of the model's tensors ({on_meta[0]}, ...) are on the meta "
                            "device, without values (a model built on meta, or offloaded by accelerate): load its "
                            "weights onto the CPU or a GPU first (from_pretrained, or prune.load(path).model)")
    if tokenizer is None or not callable(tokenizer):
        raise LayercutError(f"{caller} needs the model's tokenizer to read calibration text, got "
                            f"{'None' if tokenizer is None else type(tokenizer).__name__}: pass "
                            "AutoTokenizer.from_pretrained(name) (prune.load(path).tokenizer for a folder)")
    from prune.loading.tokenizer import check_vocabulary

    check_vocabulary(tokenizer, model)


def check_model(model) -> None:
    """Refuse, in one line, a model wrapped by PEFT: its adapters are not part of the architecture layercut cuts."""
    import sys

    peft = sys.modules.get("peft")  # a PEFT model comes from an imported peft: nothing to import to see one
    wrappers = tuple(getattr(peft, name) for name in ("PeftModel", "PeftMixedModel") if hasattr(peft, name))
    wrapped = isinstance(model, wrappers) if wrappers else False
    adapters = any(type(module).__module__.split(".")[0] == "peft" for module in model.modules()) \
        if hasattr(model, "modules") else False
    if wrapped or adapters:
        raise LayercutError("a PEFT model (adapters on the blocks) cannot be pruned: merge the adapters first, "
                            "model = model.merge_and_unload(), and pass that model")


def check_quantized(model, method: str) -> None:
    """Refuse, in one line, a bitsandbytes 4/8-bit model with a method that writes into the kept weights.

    Such methods (``fold``, ``cosine``, ``magcomp``, ``block``: a vanilla layout reached by a fit) change the
    standard weights of kept blocks, which bitsandbytes holds packed; removing blocks (``none``) and
    methods whose fit is a module of its own (``linear``, ...) read activations only.
    """
    bits = quantized_bits(model)
    if bits is None:
        return
    from prune.replace.registry import get_method

    spec = get_method(method)
    if spec.servable and spec.fitter is not None:
        raise LayercutError(f"replace {method} rewrites the kept blocks' weights, which this bitsandbytes {bits}-bit "
                            "model holds quantized: load the model without quantization (no load_in_4bit / "
                            "load_in_8bit) or use replace='none'")


def quantized_bits(model) -> int | None:
    """4 or 8 for a model loaded by bitsandbytes (its config's ``quantization_config``), else None."""
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is None:
        return None
    values = config if isinstance(config, dict) else config.to_dict() if hasattr(config, "to_dict") else vars(config)
    if str(values.get("quant_method", "")).lower() not in ("bitsandbytes", "bitsandbytes_4bit", "bitsandbytes_8bit"):
        return None
    return 4 if values.get("load_in_4bit") else 8


def _data_keys() -> list[str]:
    """The options that go to the ``data`` section (all of :class:`DataConfig` but the spec itself)."""
    from prune.data.calibration import DataConfig

    return [item.name for item in dataclasses.fields(DataConfig) if item.name != "data"]


def _split_options(options: dict) -> tuple[dict, dict, dict]:
    """``options`` as (PruneConfig fields, ``data`` keys, ``replace`` keys); an unknown one is a one-line error.

    ``seed`` is the calibration's (``data``); a replacement's own seed goes in ``replace={..., "seed": N}``.
    """
    from prune.pipeline.config import PruneConfig
    from prune.replace.config import ReplaceConfig

    for name, fix in _NOT_OPTIONS.items():
        if name in options:
            raise LayercutError(f"{name}=: {fix}")
    data_keys = _data_keys()
    top_keys = [item.name for item in dataclasses.fields(PruneConfig)
                if item.name not in (*_NOT_OPTIONS, "data", "drop", "replace")]
    replace_keys = [key for key in ReplaceConfig.recipe_keys() if key not in ("method", "batch_size", "options",
                                                                               *data_keys)]
    unknown = sorted(set(options) - {*top_keys, *data_keys, *replace_keys})
    if unknown:
        raise LayercutError(f"unknown option(s) {', '.join(unknown)}; known: "
                            f"{', '.join(sorted({*top_keys, *data_keys, *replace_keys}))}")
    pick = lambda keys: {key: value for key, value in options.items() if key in keys}  # noqa: E731
    return pick(top_keys), pick(data_keys), pick(replace_keys)


def _data_spec(data) -> tuple[str | None, list[str] | None]:
    """(``--data`` spec, texts): a list of texts is calibrated on as given, anything else is a spec."""
    if data is None or isinstance(data, (str, Path)):
        return (str(data) if data is not None else None), None
    if not isinstance(data, Sequence) or not data or not all(isinstance(text, str) for text in data):
        raise LayercutError("data must be None (the shipped novel), a --data spec (a file, a datasets spec, a "
                            f"mixture) or a non-empty list of texts, got {type(data).__name__}")
    return None, list(data)


def _slim_config(drop, data, recipe, replace, options: dict) -> tuple[PruneConfig, list[str] | None]:
    """The run's :class:`PruneConfig` (writing nothing) and the texts to calibrate on, if ``data`` lists them."""
    from prune.pipeline.config import PruneConfig
    from prune.pipeline.recipes import config_from_recipe, read_recipe, resolve_method

    top, data_options, replace_options = _split_options(options)
    spec, texts = _data_spec(data)
    if drop is not None and (top.get("target_params") is not None or top.get("target_speedup") is not None):
        raise LayercutError("drop and a target both say how much to remove: pass drop=None with target_params or "
                            "target_speedup")
    path = resolve_method(str(recipe)) if recipe is not None else None
    written = read_recipe(path) if path is not None else {}
    section = written.get("data")
    if spec is None and not (isinstance(section, dict) and section.get("data")):
        spec = API_DATA  # texts too: the spec stands in for them in the config (they are packed by _scored)
    values: dict = {**top, "data": {**data_options, "data": spec}}
    if drop is not None:  # None leaves a recipe's own drop (or a target) in force
        values["drop"] = drop
    replace_section = ({"method": replace} if isinstance(replace, str) else dict(replace or {}))
    replace_section.update(replace_options)
    if "method" not in replace_section and "replace" not in written and path is None:
        # ReplaceConfig's own default is linear; slim's, as prune.run's, the best servable repair of the model
        replace_section["method"] = "auto"
    if replace_section:
        values["replace"] = replace_section
    config = config_from_recipe(path, values) if path is not None else PruneConfig(**values)
    config.out = None  # set after construction: PruneConfig names a default folder when dropping
    if config.step_sections():
        raise LayercutError(f"prune.slim does not run {', '.join(config.step_sections())} (the step reloads the "
                            "original model as its teacher from disk): save the result with prune.save and distil it "
                            "with python -m distill.run --student FOLDER --teacher MODEL, or run the recipe with "
                            "python -m prune.run")
    return config, texts


def _loaded(model, tokenizer, config: PruneConfig) -> LoadedModel:
    """``model`` as the pipeline takes it; ``config.load`` records where it lives (for ``layercut.json``)."""
    from prune.checkpoint.load_config import LoadConfig
    from prune.loading.loader import LoadedModel

    name = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or \
        f"in-memory {model.config.model_type}"
    weight = next(iter(model.parameters()), None)
    bits = quantized_bits(model)
    config.load = LoadConfig(model=name, dtype=str(weight.dtype).removeprefix("torch.") if weight is not None else
                             "auto", device=str(weight.device) if weight is not None else "cpu",
                             load_in_4bit=bits == 4, load_in_8bit=bits == 8)
    return LoadedModel(model, tokenizer, name, name)


@contextlib.contextmanager
def _eval_mode(model) -> Iterator[None]:
    """The model in eval mode (no dropout in the statistics) while inside; its own mode back after."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


def _texts_calibration(tokenizer, texts: list[str], data: DataConfig) -> CalibrationData:
    """The calibration of a list of texts: the windows a ``.jsonl`` file of them would give, held-out ones apart."""
    from prune.data.calibration import CalibrationData, _pack

    kept = [text for text in texts if text.strip()]
    if not kept:
        raise LayercutError("data: every text is empty: pass texts to calibrate on")
    source = f"texts({len(kept)})"
    ids, heldout = _pack(kept, tokenizer, data.samples, data.heldout_samples, data.seq_len, data.seed,
                         "calibration text")
    return CalibrationData(ids, source, heldout if heldout.shape[0] else None, None, {source: heldout}, None)


def _scored(loaded: LoadedModel, config: PruneConfig, texts: list[str]):
    """The run's calibration from ``texts`` and its one scoring pass, handed to ``run_prune`` as shared statistics."""
    from prune.pipeline.runner import Scored, score_model

    calibration = _texts_calibration(loaded.tokenizer, texts, config.data)
    moments, scores = score_model(loaded.model, calibration, config)
    return Scored(calibration, moments, scores)


def _export_options(name: str, options: dict):
    """The registered export target ``name`` and its options (its options dataclass, from keywords)."""
    from prune.checkpoint.exports import export_targets

    target = export_targets().get(name)
    return target, target.options_of(options)


def _save_result(result: SlimResult, path: str | Path, export: str | None = None, overwrite: bool = False,
                 **export_options) -> Path:
    from prune.atomic import check_output_dir, output_lock
    from prune.pipeline.runner import write_outputs

    if export is None and export_options:
        raise LayercutError(f"option(s) {', '.join(sorted(export_options))} belong to an export: pass export=NAME")
    config = copy.copy(result._config)
    config.out, config.overwrite = str(path), overwrite
    target, args = _export_options(export, export_options) if export is not None else (None, None)
    if target is not None:
        target.check(config, args)
    with output_lock(config.out):
        check_output_dir(config.out, overwrite)
        folder = Path(write_outputs(result._run.loaded, result.report, config))
    if target is not None:
        import logging

        logging.getLogger(__name__).info(target.write(folder, args))
    return folder
