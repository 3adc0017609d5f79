"""How a model is opened: :class:`LoadConfig`, a recipe's ``load:`` section and every tool's loading flags.

``LoadConfig.load`` is the library's one way to open a model: any checkpoint layercut wrote (its maps
attached), any model ``prune.loading.loader.load_model`` takes, or a skeleton whose blocks stay on disk.
"""

from __future__ import annotations

from dataclasses import dataclass

from prune.checkpoint.save_load import load
from prune.data.calibration import typed_fields
from prune.errors import LayercutError
from prune.loading.loader import EMBEDDED_MODEL, LoadedModel

DTYPES = ("auto", "float32", "bfloat16", "float16")
OFFLOADS = ("none", "sequential")


@dataclass
class LoadConfig:
    """How to load a model; a recipe's ``load:`` section maps key for key onto it.

    Attributes:
        model: alias, hub id, checkpoint folder or ``.gguf`` file; None where the caller names it later
            (``distill.run``'s teacher: the one the student's ``layercut.json`` names).
        dtype: auto | float32 | bfloat16 | float16.
        device: cpu | cuda | cuda:N | auto (accelerate ``device_map`` over the GPUs).
        load_in_4bit: bitsandbytes NF4 weights (CUDA only).
        load_in_8bit: bitsandbytes int8 weights (CUDA only).
        tokenizer: tokenizer to use instead of the checkpoint's (for folders saved without one).
        offload: "none" (the whole model in memory) or "sequential" (scoring and fitting load one block at
            a time from the checkpoint's safetensors and run it over every calibration token, so peak
            memory is one block and two state buffers; ``prune.measure.blockwise``).
    """

    model: str | None = EMBEDDED_MODEL
    dtype: str = "auto"
    device: str = "cpu"
    load_in_4bit: bool = False
    load_in_8bit: bool = False
    tokenizer: str | None = None
    offload: str = "none"

    def __post_init__(self):
        typed_fields(self, "load", {"dtype": f"write one of {', '.join(DTYPES)}",
                                    "offload": f"write one of {', '.join(OFFLOADS)}"})
        if self.load_in_4bit and self.load_in_8bit:
            raise LayercutError("--load-in-4bit and --load-in-8bit exclude each other: pass one")
        if self.offload not in OFFLOADS:
            raise LayercutError(f"--offload {self.offload!r}: choose one of {', '.join(OFFLOADS)}")

    def load(self, model: str | None = None) -> LoadedModel:
        """Load ``model`` (default: ``self.model``) with these options, replacement maps attached.

        With ``offload="sequential"`` the model is a skeleton whose blocks stay in the checkpoint
        (``prune.loading.offload.load_offloaded``).
        """
        if self.offload == "sequential":
            from prune.loading.offload import load_offloaded

            return load_offloaded(model or self.model, dtype=self.dtype, device=self.device,
                                  tokenizer=self.tokenizer, load_in_4bit=self.load_in_4bit,
                                  load_in_8bit=self.load_in_8bit)
        return load(model or self.model, dtype=self.dtype, device=self.device, load_in_4bit=self.load_in_4bit,
                    load_in_8bit=self.load_in_8bit, tokenizer=self.tokenizer)
