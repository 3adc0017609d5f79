"""Training checkpoints: trained parameters, optimizer, scheduler, RNG and step, written atomically.

One file per checkpoint, ``<work>/checkpoints/step-00000050.pt``; it is written to a temporary name
and renamed, so a crash mid-write never leaves a truncated latest checkpoint, and older ones are
deleted only after the new one is in place. ``--resume`` picks the highest step.

A checkpoint holds tensors and plain data only (the RNG states as tensors, the run's options as JSON), so it is
read with ``torch.load(weights_only=True)``: a file in a work folder never runs code when it is read.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
from pathlib import Path

import torch
from torch import nn

from prune.errors import LayercutError

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"step-(\d+)\.pt")


def default_work_folder(out: str | Path) -> Path:
    """Where a run exporting to ``out`` keeps checkpoints and its log: the sibling ``<out>.work``."""
    path = Path(out).expanduser()
    return path.with_name(path.name + ".work")


def checkpoint_dir(work: str | Path) -> Path:
    """Folder holding the checkpoints of a work folder."""
    return Path(work) / CHECKPOINT_DIR


def list_checkpoints(work: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under ``work``, by increasing step."""
    folder = checkpoint_dir(work)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.fullmatch(p.name))]
    return sorted(found)


def latest_checkpoint(work: str | Path) -> Path | None:
    """The checkpoint with the highest step, or None."""
    found = list_checkpoints(work)
    return found[-1][1] if found else None


def rng_state() -> dict:
    """Every random generator a training step draws from (dropout, LoRA init), as tensors and numbers."""
    version, internal, gauss = random.getstate()
    state = {"python": torch.tensor(internal, dtype=torch.int64), "python_version": version, "python_gauss": gauss,
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` captured (or the tuple checkpoints before it stored)."""
    python = state["python"]
    if isinstance(python, torch.Tensor):
        python = (int(state.get("python_version", 3)), tuple(int(v) for v in python.tolist()),
                  state.get("python_gauss"))
    random.setstate(python)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trained_state(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """The trained parameters and every persistent buffer (e.g. BatchNorm running statistics), on the CPU.

    A parameter under a second name (a head tied to the embedding: ``lm_head.weight``) is neither, as in
    ``distill.sharded.full_model_state`` (it cost every checkpoint of a Gemma-3-270M heal its 671 MB embedding and
    about 5 s).
    """
    wanted = set(names)
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    state = {n: t for n, t in model.state_dict().items() if n in wanted or n not in params}
    return {name: tensor.detach().cpu().clone() for name, tensor in state.items()}


def save_checkpoint(work: str | Path, step: int, model: nn.Module, names: list[str], optimizer, scheduler,
                    config: dict, keep: int = 1, whole: tuple[dict, dict] | None = None) -> Path:
    """Write the training state at ``step`` atomically, then delete all but the newest ``keep`` checkpoints.

    ``whole``: the model's trained tensors and the optimizer's state keyed by parameter name, gathered from a
    sharded student (``distill.sharded``); the optimizer's state is then stored by name, not by position.
    """
    folder = checkpoint_dir(work)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:08d}.pt"
    payload = {
        "step": step,
        "model": trained_state(model, names) if whole is None else whole[0],
        "trained_names": list(names),
        "optimizer": optimizer.state_dict() if whole is None else whole[1],
        "optimizer_format": "positions" if whole is None else "names",
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
        "config_json": json.dumps(config, default=_json_value),
    }
    _check_plain(payload, "checkpoint")  # what torch.load(weights_only=True) reads back at --resume
    tmp = folder / f".{path.name}.tmp-{os.getpid()}"
    torch.save(payload, tmp)
    os.replace(tmp, path)
    for _, old in list_checkpoints(work)[: -max(keep, 1)]:
        old.unlink(missing_ok=True)
    logger.info("checkpoint at step %d: %s", step, path)
    return path


_PLAIN = (str, int, float, bool, type(None), torch.Tensor, torch.Size)


def _check_plain(value, where: str) -> None:
    """Fail (a bug, not bad input) on anything but tensors and plain data: it would not load with weights_only."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(key, where)
            _check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
    elif not isinstance(value, _PLAIN):
        raise TypeError(f"{where} is a {type(value).__name__}: a checkpoint holds tensors and plain data only")


def _json_value(value):
    """A number-like value JSON does not know (a numpy or 0-d tensor number) as a number, else its text."""
    return value.item() if hasattr(value, "item") else str(value)


def load_checkpoint(path: str | Path) -> dict:
    """Read a checkpoint written by :func:`save_checkpoint`: tensors and plain data, never a pickled object.

    Raises:
        LayercutError: the file holds Python objects (it is refused unread: unpickling could run code), or is
            damaged, or is not a training checkpoint.
    """
    fix = "delete it (or the work folder), or start over with --overwrite"
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise LayercutError(f"{path} holds Python objects, not only tensors: it is not a checkpoint layercut wrote "
                            f"and is never unpickled (that could run code); {fix}") from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise LayercutError(f"{path} is damaged ({reason}); {fix}") from None
    needed = ("step", "model", "trained_names", "optimizer", "scheduler", "rng")
    if not isinstance(payload, dict) or any(key not in payload for key in needed):
        raise LayercutError(f"{path} is not a training checkpoint of distill.run; {fix}")
    if "config_json" in payload:  # checkpoints before the JSON field held the dict itself
        try:
            payload["config"] = json.loads(payload.pop("config_json"))
        except (TypeError, ValueError):
            raise LayercutError(f"{path} is damaged (its options are not JSON); {fix}") from None
    return payload


def check_trained_names(payload: dict, names: list[str]) -> None:
    """Refuse a checkpoint that trained other parameters than this run would."""
    if sorted(payload["trained_names"]) != sorted(names):
        raise LayercutError(
            "the checkpoint trained other parameters than this run would (different --train, --lora-r or "
            "student): resume with the same options, or start over with --overwrite"
        )


def restore_model(model: nn.Module, payload: dict, names: list[str]) -> None:
    """Load the checkpoint's trained parameters and buffers into ``model``; the trained set must match."""
    check_trained_names(payload, names)
    own = model.state_dict()
    for name, tensor in payload["model"].items():
        if name not in own or own[name].shape != tensor.shape:
            raise LayercutError(
                f"checkpoint tensor {name} does not fit the student: resume with the same --student, or start over "
                "with --overwrite"
            )
    model.load_state_dict(payload["model"], strict=False)
