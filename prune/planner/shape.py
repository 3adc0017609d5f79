"""What the planner knows of a model before any weight is read: its parameters, block by block.

The model is built from its config on the meta device (``accelerate.init_empty_weights``): every parameter
has a shape and no storage, so a 70B model costs a second and no memory. Counted once per parameter object,
so a tied LM head is not counted twice. Mixture-of-experts blocks also say how many of their parameters a
token passes through (the router's top-k of the experts), which is what the time estimates need.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import logging
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from torch import nn

from prune.errors import LayercutError
from prune.model.adapters import changes_logits_after_head, get_blocks, text_config

logger = logging.getLogger(__name__)

# config attribute names of the expert count and the experts a token is routed to, across architectures
_EXPERT_COUNT_NAMES = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_EXPERT_TOPK_NAMES = ("num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts")


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts of one decoder-only model, as the planner reads them.

    Attributes:
        model_type: the config's ``model_type``.
        hidden: residual width d.
        layers: decoder blocks L.
        vocab: vocabulary size V (the logits' width).
        heads: attention heads.
        intermediate: MLP width a token passes through (the routed experts' together in a mixture of experts).
        dtype: the checkpoint's dtype (what ``--dtype auto`` loads on a GPU).
        block_params: parameters of one block (the mean over blocks).
        block_linear_params: of those, the weights of ``nn.Linear`` modules (what bitsandbytes quantizes).
        block_linear_io: inputs plus outputs summed over a block's ``nn.Linear`` modules (LoRA's r x (in + out)).
        block_active_params: parameters a token passes through in one block (fewer than ``block_params``
            in a mixture of experts).
        embed_params: the input embedding (and any position embedding).
        head_params: the LM head when it is not tied to the embedding, else 0.
        other_params: the rest (final norm, rotary buffers that are parameters).
        block_linear_io_names: ``block_linear_io`` by the layers' own names (``q_proj``: the inputs plus outputs
            of every Linear of a block so named), sorted by name: what LoRA adapts under ``--lora-targets``.
        logits_after_head: the config caps or scales the logits after the head's matmul
            (``prune.model.adapters.AFTER_HEAD_FIELDS``): distillation's KL then takes whole logits.
    """

    model_type: str
    hidden: int
    layers: int
    vocab: int
    heads: int
    intermediate: int
    dtype: str
    block_params: int
    block_linear_params: int
    block_linear_io: int
    block_active_params: int
    embed_params: int
    head_params: int
    other_params: int
    block_linear_io_names: tuple[tuple[str, int], ...] = ()
    logits_after_head: bool = False

    @property
    def total(self) -> int:
        """Every parameter once (a tied head counted with the embedding)."""
        return self.layers * self.block_params + self.embed_params + self.head_params + self.other_params

    def kept(self, drop: int) -> int:
        """Parameters left after removing ``drop`` blocks (replacements not counted)."""
        return self.total - drop * self.block_params

    def to_dict(self) -> dict:
        """JSON-ready fields and the total."""
        return {**asdict(self), "total": self.total}


def _unique_params(module: nn.Module, seen: set[int]) -> int:
    """Scalars of ``module``'s parameters not counted yet (``seen``: ids of those counted)."""
    total = 0
    for param in module.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel()
    return total


def _experts_share(config) -> float:
    """Share of the experts' parameters one token passes through: top-k / experts (1 without experts)."""
    count = next((getattr(config, n) for n in _EXPERT_COUNT_NAMES if isinstance(getattr(config, n, None), int)), 0)
    topk = next((getattr(config, n) for n in _EXPERT_TOPK_NAMES if isinstance(getattr(config, n, None), int)), 0)
    return topk / count if count and topk else 1.0


def _block_counts(block: nn.Module, share: float) -> tuple[int, int, int, int, dict[str, int]]:
    """A block's counts: parameters, nn.Linear weights, their inputs + outputs, what a token passes through.

    And the Linear layers' inputs + outputs by their own names (LoRA's targets).
    """
    total = sum(p.numel() for p in block.parameters())
    linears = [(name, m) for name, m in block.named_modules() if isinstance(m, nn.Linear)]
    experts = sum(p.numel() for name, m in block.named_modules() if name.split(".")[-1] == "experts"
                  for p in m.parameters())
    named: dict[str, int] = {}
    for name, m in linears:
        leaf = name.rsplit(".", 1)[-1]
        named[leaf] = named.get(leaf, 0) + m.in_features + m.out_features
    return (total, sum(m.weight.numel() for _, m in linears),
            sum(m.in_features + m.out_features for _, m in linears), total - experts + round(experts * share), named)


def _intermediate(config, hidden: int) -> int:
    """The MLP width one token passes through: the dense MLP's, or the routed (and shared) experts' together."""
    topk = next((getattr(config, n) for n in _EXPERT_TOPK_NAMES if isinstance(getattr(config, n, None), int)), 0)
    expert = getattr(config, "moe_intermediate_size", None)
    if topk and isinstance(expert, int):
        shared = getattr(config, "shared_expert_intermediate_size", None) or 0
        return topk * expert + shared
    for name in ("intermediate_size", "ffn_dim", "n_inner", "d_ff"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    return 4 * hidden


def build_on_meta(config) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` with no weights: every parameter on the meta device."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    # transformers' construction chatter (warnings, prints of remote code) is not the plan's output
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), init_empty_weights():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config)
    # from_config leaves a tied head as its own parameter until weights load; tying inside
    # init_empty_weights does not take, so it is done here
    model.tie_weights()
    return model


def shape_of_model(model: nn.Module) -> ModelShape:
    """The :class:`ModelShape` of a built model (meta or real)."""
    config = text_config(model)
    _, blocks = get_blocks(model)
    share = _experts_share(config)
    counts = [_block_counts(block, share) for block in blocks]
    seen: set[int] = set()
    embed = _unique_params(model.get_input_embeddings(), seen)
    block_total = sum(_unique_params(block, seen) for block in blocks)
    head_module = model.get_output_embeddings()
    head = _unique_params(head_module, seen) if head_module is not None else 0
    other = _unique_params(model, seen)  # whatever is left: final norm, position embeddings of some models
    layers = len(blocks)
    hidden = int(model.get_input_embeddings().weight.shape[1])
    dtype = str(getattr(config, "dtype", None) or "float32")  # a config.json's torch_dtype is read into it
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None) or 1
    return ModelShape(
        model_type=str(getattr(config, "model_type", type(model).__name__)),
        hidden=hidden, layers=layers, vocab=int(model.get_input_embeddings().weight.shape[0]), heads=int(heads),
        intermediate=int(_intermediate(config, hidden)), dtype=dtype.removeprefix("torch."),
        block_params=round(block_total / layers), block_linear_params=round(sum(c[1] for c in counts) / layers),
        block_linear_io=round(sum(c[2] for c in counts) / layers),
        block_active_params=round(sum(c[3] for c in counts) / layers),
        embed_params=embed, head_params=head, other_params=other,
        block_linear_io_names=tuple(sorted((name, round(sum(c[4].get(name, 0) for c in counts) / layers))
                                           for name in {name for c in counts for name in c[4]})),
        logits_after_head=changes_logits_after_head(config),
    )


def shape_of_config(config) -> ModelShape:
    """The :class:`ModelShape` of a config, built on the meta device (no weights anywhere)."""
    return shape_of_model(build_on_meta(config))


def read_config(name: str):
    """The (text) config of ``name`` without loading weights: config.json, or a ``.gguf`` file's header.

    An alias, hub id or folder reads ``config.json`` only (``prune.loading.loader.load_config``); a ``.gguf``
    file not converted yet is read by transformers' GGUF reader, which parses the metadata and leaves
    the tensors on disk.
    """
    from prune.loading.loader import load_config
    from prune.loading.names import resolve_model_name

    config = load_config(name)
    if config is not None:
        return config
    path = Path(resolve_model_name(name))
    if path.suffix.lower() != ".gguf" or not path.is_file():
        raise LayercutError(f"--plan: no config found for {name!r}: pass a model with a config.json or a .gguf file")
    from prune.loading.gguf import check_gguf_file

    check_gguf_file(path)  # a truncated file: one line, not the GGUF reader's struct error
    stat = path.stat()
    return copy.deepcopy(_gguf_header_config(str(path), stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=4)
def _gguf_header_config(path: str, size: int, mtime_ns: int):
    """A ``.gguf`` file's (text) config from its header: seconds for a real vocabulary, so read once per file.

    ``size`` and ``mtime_ns`` are part of the key: a file written again is read again. Callers get a copy.
    """
    from transformers import AutoConfig

    gguf = Path(path)
    return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).get_text_config()


def shape_of_name(name: str) -> ModelShape:
    """The :class:`ModelShape` of what ``--model`` names, from its config alone."""
    return shape_of_config(read_config(name))
