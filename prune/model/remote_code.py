"""Modeling code that a layercut checkpoint with maps or removed sub-layers carries, as ``modeling_layercut.py``.

Load such a checkpoint without layercut installed::

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)

The checkpoint is the kept blocks of a transformers model (``model.safetensors``) plus linear or
low-rank maps standing in for the removed blocks (``replacements.safetensors``), and/or a list of the
attention and MLP sub-layers removed from kept blocks (``base_config["layercut_removed_sublayers"]``:
no transformers architecture can leave one out, so each becomes a :class:`ZeroSublayer`). Its ``config.json``
has ``model_type: "layercut"`` with the wrapped model's config under ``base_config`` (its ``model_type`` kept
apart, as ``base_model_type``, so that no transformers config class adopts the nested dict) and a
``vocab_size`` that is a sentence, not a number: ``AutoModelForCausalLM.from_pretrained`` without remote code
and the concrete classes (``LlamaForCausalLM.from_pretrained``) refuse it instead of loading the kept blocks
without their maps (another model).
``LayercutForCausalLM.from_pretrained`` builds the wrapped architecture from ``base_config``, loads the
folder's weights into it and puts each map on its block; the model it returns is that architecture
(e.g. ``LlamaForCausalLM``), so generation and the KV cache work as usual.

This file is self-contained (torch, transformers and safetensors only) and is layercut's own
definition of the format: ``prune.checkpoint.save_load`` writes the checkpoint with these names, and
``prune.loading.loader`` reads ``base_config`` with :func:`base_config_from_dict`.

layercut imports it at start-up for its names, maps and helpers, so transformers and safetensors are imported
where they are used (importing transformers' model code takes seconds): the two transformers classes,
:class:`LayercutConfig` and :class:`LayercutForCausalLM`, are defined on first access (``module.LayercutConfig``,
``from ... import``, or transformers' own ``getattr`` on the module it loads), by the module's ``__getattr__``.
"""

from __future__ import annotations

import json

import torch
from torch import nn

MODEL_TYPE = "layercut"
MODELING_FILE = "modeling_layercut.py"
MAPS_FILE = "replacements.safetensors"
MAPS_METADATA_KEY = "layercut_maps"  # safetensors metadata: {"<position>.<before|after>": spec}
# base config entry: the attention / MLP sub-layers removed, [{"block", "kind", "module", "returns"}, ...]
SUBLAYERS_KEY = "layercut_removed_sublayers"
RECORDS_KEY = "layercut_replacements"  # base config entry: what replaced each removed span
SIDES = ("before", "after")
BASE_TYPE_KEY = "base_model_type"  # the wrapped model's model_type, outside base_config (see wrap_config_dict)
# AutoModel is listed so that engines building a model from the config (vLLM's Transformers backend) meet
# LayercutForCausalLM's refusal, which says what to serve instead, not "Unrecognized configuration class"
AUTO_MAP = {
    "AutoConfig": "modeling_layercut.LayercutConfig",
    "AutoModel": "modeling_layercut.LayercutForCausalLM",
    "AutoModelForCausalLM": "modeling_layercut.LayercutForCausalLM",
}
SERVABLE = ("for a checkpoint that vLLM and llama.cpp serve, export with --replace fold, --replace none or the "
            "magcomp recipe (plain transformers checkpoints)")
REFUSAL = (
    "this is a layercut checkpoint with replacement maps or removed sub-layers, not a plain transformers one: "
    "load it with prune.load(path) or AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)"
)
# a config field every causal LM config types as an int: as a sentence, a concrete class refuses the folder
REFUSAL_FIELD = "vocab_size"
# where blocks live when a config does not say (configs written by layercut always do)
_COMMON_BLOCK_PATHS = ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers")
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token")


# ----------------------------------------------------------------------------------------------------------------
# Config


def is_wrapped(config_dict: dict) -> bool:
    """Whether a ``config.json`` dict is a layercut-wrapped one (a checkpoint with replacement maps)."""
    return config_dict.get("model_type") == MODEL_TYPE


def wrap_config_dict(base: dict, blocks_path: str) -> dict:
    """The ``config.json`` of a checkpoint with maps, around the wrapped model's config dict ``base``.

    transformers' ``LlamaConfig.from_pretrained`` adopts any nested dict whose ``model_type`` is ``"llama"``,
    so the base's ``model_type`` is stored beside it; ``vocab_size`` is :data:`REFUSAL` so that a concrete
    class, left with the wrapper itself, fails on it with the sentence that says how to load the folder.
    """
    nested = {key: value for key, value in base.items() if key != "model_type"}
    return {
        "model_type": MODEL_TYPE,
        "architectures": ["LayercutForCausalLM"],
        "auto_map": dict(AUTO_MAP),
        "blocks_path": blocks_path,
        BASE_TYPE_KEY: base.get("model_type"),
        "base_config": nested,
        REFUSAL_FIELD: REFUSAL,
        "transformers_version": base.get("transformers_version"),
    }


def unwrap_config_dict(wrapped: dict) -> dict:
    """The wrapped model's ``config.json`` dict (with its ``model_type``) from a wrapped one, old layout or new.

    Checkpoints written before :data:`BASE_TYPE_KEY` keep ``model_type`` inside ``base_config``.
    """
    base = dict(wrapped.get("base_config") or {})
    if wrapped.get(BASE_TYPE_KEY):
        base["model_type"] = wrapped[BASE_TYPE_KEY]
    return base


def base_config_from_dict(base: dict) -> PretrainedConfig:  # noqa: F821 (transformers' class, imported inside)
    """The wrapped model's config (e.g. a ``LlamaConfig``) from its dict, as ``AutoConfig`` would build it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = base.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"this layercut checkpoint wraps a '{model_type}' model, which this transformers version does not know: "
            "upgrade transformers"
        )
    return CONFIG_MAPPING[model_type].from_dict(dict(base))


def _define_config_class() -> type:
    """Define :class:`LayercutConfig`, a transformers ``PretrainedConfig`` (on first access, by ``__getattr__``)."""
    from transformers import PretrainedConfig

    class LayercutConfig(PretrainedConfig):
        """The config of a checkpoint with replacement maps: the wrapped model's config and where its blocks are.

        Attributes:
            base_config: the wrapped model's ``config.json`` dict (its ``model_type``, sizes, layercut records).
            blocks_path: dotted path of the decoder blocks' ``nn.ModuleList`` (e.g. ``"model.layers"``).
        """

        model_type = MODEL_TYPE

        def __init__(self, base_config: dict | None = None, blocks_path: str | None = None, **kwargs):
            kwargs.pop(REFUSAL_FIELD, None)  # the sentence that makes other config classes refuse the folder
            base_type = kwargs.pop(BASE_TYPE_KEY, None)
            self.base_config = unwrap_config_dict({"base_config": base_config, BASE_TYPE_KEY: base_type})
            self.blocks_path = blocks_path
            super().__init__(**kwargs)

        def to_dict(self) -> dict:
            """The ``config.json`` dict, in the layout :func:`wrap_config_dict` writes."""
            output = super().to_dict()
            output.update({key: value for key, value in wrap_config_dict(self.base_config, self.blocks_path).items()
                           if key in (BASE_TYPE_KEY, "base_config", REFUSAL_FIELD)})
            return output

        @property
        def base_model_type(self) -> str | None:
            """The wrapped architecture's ``model_type`` (e.g. ``"llama"``)."""
            return self.base_config.get("model_type")

        def base(self) -> PretrainedConfig:
            """The wrapped model's config object."""
            return base_config_from_dict(self.base_config)

    LayercutConfig.__qualname__ = "LayercutConfig"
    return LayercutConfig


# ----------------------------------------------------------------------------------------------------------------
# Maps (same state_dict keys and maths as layercut's prune.replace.LinearMap / LowRankMap / ReplacedBlock)


class LinearMap(nn.Module):
    """``h -> h A + b`` on the residual stream."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Map [..., d] states."""
        return self.proj(hidden)


class LowRankMap(nn.Module):
    """``h -> h + up(down(BatchNorm(h)))`` (residual) or ``h -> up(down(BatchNorm(h)))``."""

    def __init__(self, dim: int, rank: int, residual: bool = True):
        super().__init__()
        self.residual = residual
        self.norm = nn.BatchNorm1d(dim)
        self.down = nn.Linear(dim, rank, bias=False)
        self.up = nn.Linear(rank, dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Map [..., d] states; the norm sees them as a [tokens, d] batch."""
        flat = hidden.reshape(-1, hidden.shape[-1])  # [tokens, d]
        out = self.up(self.down(self.norm(flat))).view_as(hidden)
        return hidden + out if self.residual else out


# map type (the layercut method's name) -> its module, built from the spec saved in replacements.safetensors
MAP_TYPES = {
    "linear": lambda spec: LinearMap(spec["dim"]),
    "lowrank": lambda spec: LowRankMap(spec["dim"], spec["rank"], spec.get("residual", True)),
    "linearpatch": lambda spec: LinearMap(spec["dim"]),  # a d x d map like linear's (saved as type "linear")
}


def build_map(spec: dict) -> nn.Module:
    """An untrained map of the type and shape a ``replacements.safetensors`` spec records."""
    if spec.get("type") not in MAP_TYPES:
        raise ValueError(f"{MAPS_FILE} holds a map of unknown type '{spec.get('type')}': update this checkpoint's code")
    return MAP_TYPES[spec["type"]](spec)


class ReplacedBlock(nn.Module):
    """A kept block with the maps of removed blocks next to it: ``before`` on its input, ``after`` on its output.

    Unknown attributes fall through to the wrapped block (``attention_type``, ``self_attn``, ...).
    """

    def __init__(self, block: nn.Module, before: nn.Module | None = None, after: nn.Module | None = None):
        super().__init__()
        self.block = block
        self.before = before
        self.after = after

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            block = self.__dict__["_modules"].get("block")
            if block is None:
                raise
            return getattr(block, name)

    def maps(self) -> list[nn.Module]:
        """The replacement maps (before, after) present."""
        return [m for m in (self.before, self.after) if m is not None]

    def forward(self, *args, **kwargs):
        """Run ``before``, the block, then ``after``; returns what the block returns (tensor or tuple)."""
        hidden = args[0] if args else kwargs["hidden_states"]
        if self.before is not None:
            hidden = self.before(hidden)
        if args:
            output = self.block(hidden, *args[1:], **kwargs)
        else:
            output = self.block(**{**kwargs, "hidden_states": hidden})
        if self.after is None:
            return output
        if isinstance(output, (tuple, list)):
            return (self.after(output[0]), *output[1:])
        return self.after(output)


class ZeroSublayer(nn.Module):
    """A removed attention or MLP sub-layer: it adds nothing to the residual stream and costs nothing.

    Returns zeros shaped like its input, as a tensor (``returns`` 0) or as the first entry of a tuple of
    ``returns`` entries (attention weights, router logits: None), the way the module it stands for did.
    """

    def __init__(self, kind: str, returns: int = 0):
        super().__init__()
        self.kind = kind
        self.returns = returns

    def extra_repr(self) -> str:
        """What ``print(model)`` shows of it."""
        return f"kind={self.kind}, returns={self.returns}"

    def forward(self, *args, **kwargs):
        """Zeros like the hidden states passed in (positionally or by keyword)."""
        hidden = args[0] if args else kwargs.get("hidden_states", kwargs.get("x"))
        if hidden is None:
            hidden = next(value for value in kwargs.values() if torch.is_tensor(value))
        zeros = torch.zeros_like(hidden)
        return zeros if self.returns == 0 else (zeros, *([None] * (self.returns - 1)))


def sublayer_records(config) -> list[dict]:
    """The removed sub-layers a config (object or ``config.json`` dict) records; [] when none."""
    value = config.get(SUBLAYERS_KEY) if isinstance(config, dict) else getattr(config, SUBLAYERS_KEY, None)
    return list(value or [])


def remove_sublayers(model: nn.Module, records: list[dict], blocks_path: str | None = None) -> int:
    """Put a :class:`ZeroSublayer` in place of each sub-layer ``records`` names; returns how many."""
    path = _blocks_path(model, blocks_path)
    blocks = model.get_submodule(path)
    for record in records:
        position = int(record["block"])
        if not 0 <= position < len(blocks):
            raise ValueError(f"{SUBLAYERS_KEY} names block {position} but the model has {len(blocks)} blocks: "
                             "mismatched config")
        parent_path, _, name = record["module"].rpartition(".")
        parent = blocks[position].get_submodule(parent_path) if parent_path else blocks[position]
        setattr(parent, name, ZeroSublayer(record["kind"], int(record.get("returns", 0))))
    return len(records)


def _maps_recorded(base_config: dict) -> bool:
    """Whether the wrapped config's replacement records name a method whose maps live in the maps file."""
    records = base_config.get(RECORDS_KEY) or []
    # this file is copied into each checkpoint and reads the config it was written with: an earlier checkpoint's
    # records (no "maps" flag) are read by its own earlier copy, and prune.load upgrades them (upgrade_records)
    return any(r.get("maps") for r in records if isinstance(r, dict))


def _blocks_path(model: nn.Module, blocks_path: str | None) -> str:
    for path in (blocks_path,) if blocks_path else _COMMON_BLOCK_PATHS:
        try:
            if isinstance(model.get_submodule(path), nn.ModuleList):
                return path
        except AttributeError:
            continue
    tried = blocks_path or ", ".join(_COMMON_BLOCK_PATHS)
    raise ValueError(f"cannot find the decoder blocks of {type(model).__name__} (tried {tried})")


def float_param(module: nn.Module) -> torch.Tensor:
    """The first floating-point parameter of ``module``: the dtype and device its computations run in.

    bitsandbytes stores 4/8-bit weights as integer tensors, so a block's first parameter may be ``uint8``
    while its norms and activations are bf16; a map must take the activations' dtype.
    """
    return next(p for p in module.parameters() if p.is_floating_point())


def attach_maps(model: nn.Module, maps_file: str, blocks_path: str | None = None, build=None) -> int:
    """Wrap the blocks named in a ``replacements.safetensors`` file with their maps; returns how many maps.

    ``build`` makes a map from its saved spec (default: :func:`build_map`; layercut passes its registry's).
    """
    from safetensors import safe_open

    build = build or build_map
    with safe_open(maps_file, framework="pt") as handle:
        specs = json.loads((handle.metadata() or {}).get(MAPS_METADATA_KEY, "{}"))
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    path = _blocks_path(model, blocks_path)
    blocks = list(model.get_submodule(path))
    for name, spec in specs.items():
        position_text, side = name.split(".")
        position = int(position_text)
        if not 0 <= position < len(blocks) or side not in SIDES:
            raise ValueError(f"{maps_file} names block {name} but the model has {len(blocks)} blocks: mismatched files")
        host = blocks[position]
        param = float_param(host)
        module = build(spec)
        module.load_state_dict({key[len(name) + 1 :]: value for key, value in tensors.items()
                                if key.startswith(name + ".")})  # fmt: skip
        module.to(device=param.device, dtype=param.dtype).eval()
        if not isinstance(host, ReplacedBlock):
            host = ReplacedBlock(host)
        setattr(host, side, module)
        blocks[position] = host
    model.set_submodule(path, nn.ModuleList(blocks))
    return len(specs)


# ----------------------------------------------------------------------------------------------------------------
# Model


def _define_model_class() -> type:
    """Define :class:`LayercutForCausalLM`, a transformers ``PreTrainedModel`` (on first access, by ``__getattr__``)."""
    from transformers import AutoModelForCausalLM, PreTrainedModel
    from transformers.utils import cached_file

    LayercutConfig = _transformers_class("LayercutConfig")

    class LayercutForCausalLM(PreTrainedModel):
        """Loader of a checkpoint with replacement maps; ``from_pretrained`` returns the wrapped architecture.

        Never instantiated itself: the model it returns is the wrapped ``*ForCausalLM`` (what generation,
        pipelines and the KV cache expect), with :class:`ReplacedBlock` wrappers on the blocks carrying maps.
        Save a changed model with layercut's ``prune.save``: ``save_pretrained`` of the returned model writes
        the wrappers' weight names, which plain transformers does not read back.
        """

        config_class = LayercutConfig
        base_model_prefix = ""

        def __init__(self, config: LayercutConfig, *args, **kwargs):
            raise TypeError(
                "LayercutForCausalLM only loads checkpoints, with AutoModelForCausalLM.from_pretrained(path, "
                "trust_remote_code=True): no model is built from its config, so serving engines (vLLM, llama.cpp) "
                f"cannot run it; {SERVABLE}"
            )

        @classmethod
        def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
            """Load the wrapped model from the checkpoint's weights and attach its replacement maps.

            Args:
                pretrained_model_name_or_path: the checkpoint folder or hub id.
                *model_args: passed to the wrapped model's ``from_pretrained``.
                config: its :class:`LayercutConfig` (read from the checkpoint when not given).
                **kwargs: ``from_pretrained`` options (``dtype``, ``device_map``, hub options, ...), passed on.
            """
            path = str(pretrained_model_name_or_path)
            hub = {key: kwargs[key] for key in _HUB_KWARGS if key in kwargs}
            if not isinstance(config, LayercutConfig):
                config = LayercutConfig.from_pretrained(path, **hub)
            kwargs.pop("_from_auto", None)
            # removed sub-layers have no weights in the folder: transformers initialises them, then they go
            model = AutoModelForCausalLM.from_pretrained(path, *model_args, config=config.base(), **kwargs)
            remove_sublayers(model, sublayer_records(config.base_config), config.blocks_path)
            maps_file = cached_file(path, MAPS_FILE, _raise_exceptions_for_missing_entries=False, **hub)
            if maps_file is not None:
                attach_maps(model, maps_file, config.blocks_path)
            elif _maps_recorded(config.base_config):
                raise ValueError(f"{path} records replacement maps but has no {MAPS_FILE}: without them it is another "
                                 f"model; copy {MAPS_FILE} next to config.json")
            return model

    LayercutForCausalLM.__qualname__ = "LayercutForCausalLM"
    return LayercutForCausalLM


# ----------------------------------------------------------------------------------------------------------------
# The transformers classes, defined on first access

_LAZY_CLASSES = {"LayercutConfig": _define_config_class, "LayercutForCausalLM": _define_model_class}


def _transformers_class(name: str) -> type:
    """The class ``name`` of :data:`_LAZY_CLASSES`, defined once and then kept as a module attribute."""
    if name not in globals():
        globals()[name] = _LAZY_CLASSES[name]()
    return globals()[name]


def __getattr__(name: str):
    """``LayercutConfig`` and ``LayercutForCausalLM``, defined on first access (transformers is imported then)."""
    if name in _LAZY_CLASSES:
        return _transformers_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names, the two classes not yet defined included."""
    return sorted({*globals(), *_LAZY_CLASSES})
