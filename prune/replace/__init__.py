"""Replace removed blocks instead of only dropping them: one module per method, found by name.

Each maximal run (span) of removed blocks gets one replacement, fitted to reproduce the span's output
from its input on calibration text. The methods are ``METHODS``, one module of this folder each, registered
where it is defined (:func:`prune.replace.registry.register_method`); each module's docstring says what it is,
and ``python -m prune.run --help`` lists them under ``--replace``. ``none`` only removes the blocks;
the maps (``linear``, ``lowrank``) ride on a kept block; the others (``fold``, ``fold-rotate``, ``local``,
``block``, ...) change standard weights, so the checkpoint stays a plain one of its architecture.

``fit="independent"`` fits every span on the original model's states (one streamed pass);
``fit="sequential"`` fits span by span, each on the inputs the already-surgered model produces
(targets are always the original model's span outputs), which corrects the drift earlier spans cause.
Adam-trained methods keep the captured activations of at most ``cache_bytes`` (on the CPU) and train
on them; closed-form methods keep only float64 moments, so their memory does not grow with the data.

Maps (``linear``, ``lowrank``) ride on a kept block inside a :class:`ReplacedBlock` (the block, then
the map; the map first when the span starts at block 0), so the block list keeps the config's length
and every ``layer_idx`` / KV-cache slot stays valid. ``prune.checkpoint.save_load`` saves them next to a vanilla
checkpoint and ``prune.load`` puts them back.

A new method is one module in this folder that registers a :class:`Method` (``register_method``):
every module here that is not a shared one is imported, so it registers itself. Its options are the
fields of its :class:`MethodOptions` subclass (``options.py``): ``prune.run``'s flags and a recipe's
``replace:`` keys come from them, so a new option is one field. Shared modules (``registry``,
``options``, ``config``, ``capture``, ``fitter``, ``modules``, ``driver``) never import a method module.
"""

import importlib
import pkgutil

from prune.model.surgery import block_layout, replacement_records
from prune.replace.capture import PairAccumulator, SpanBatch
from prune.replace.config import DEFAULT_CACHE_BYTES, ReplaceConfig
from prune.replace.driver import (
    check_drop_for_method,
    check_replacement_supported,
    check_span_lengths,
    checked_spans,
    fit_replacements,
    fit_spans,
    fit_spans_of_methods,
    install_replacements_,
    replace_blocks_,
    replacement_modules,
    spans_of,
    surgered_view,
)
from prune.replace.fitter import Replacement, SpanFitter
from prune.replace.modules import ReplacedBlock, parameter_count
from prune.replace.options import LeastSquaresOptions, MethodOptions, OptionSpec, option
from prune.replace.registry import (
    FITS,
    METHODS,
    Method,
    describe_replacement,
    get_method,
    method_for_module,
    neutral_options,
    option_specs,
    option_takers,
    register_method,
    resolve_options,
    unregister_method,
    unset_options,
)

# isort: off
# the methods register themselves on import, in this order: the order --help and errors list them in
from prune.replace import none, linear, lowrank, fold, block  # noqa: F401
# isort: on
from prune.replace.linear import LinearMap
from prune.replace.lowrank import LowRankMap, default_rank

SHARED_MODULES = ("registry", "options", "config", "capture", "fitter", "modules", "driver")
for _module in pkgutil.iter_modules(__path__):
    if _module.name not in SHARED_MODULES:
        importlib.import_module(f"{__name__}.{_module.name}")  # a method added as one new file registers here

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "SHARED_MODULES",
    "FITS",
    "METHODS",
    "LeastSquaresOptions",
    "LinearMap",
    "LowRankMap",
    "Method",
    "MethodOptions",
    "OptionSpec",
    "PairAccumulator",
    "ReplaceConfig",
    "ReplacedBlock",
    "Replacement",
    "SpanBatch",
    "SpanFitter",
    "block_layout",
    "check_drop_for_method",
    "check_replacement_supported",
    "check_span_lengths",
    "checked_spans",
    "default_rank",
    "describe_replacement",
    "fit_replacements",
    "fit_spans",
    "fit_spans_of_methods",
    "get_method",
    "install_replacements_",
    "method_for_module",
    "neutral_options",
    "option",
    "option_specs",
    "option_takers",
    "parameter_count",
    "register_method",
    "replace_blocks_",
    "replacement_modules",
    "replacement_records",
    "resolve_options",
    "spans_of",
    "surgered_view",
    "unregister_method",
    "unset_options",
]
