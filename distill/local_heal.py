"""The heal block by block: the blocks beside each cut trained towards the original's stream, one cut at a time.

What ``prune.ship --offload sequential`` heals with, where neither the student with its LoRA and optimizer nor the
original's logits fit in memory. Each cut's pair of blocks (the kept block that carries the repair and the block
after it) is copied into memory and trained with Adam so that, from the slim model's own input to the pair, it
gives what the original's block at the same depth gives: layerwise MSE towards the teacher's residual stream,
each token's state scaled to unit RMS first (as the next block's norm reads it: the stream's few outlier dimensions
would otherwise rule the loss). The inputs are recorded in a pass of the slim model as healed so far (an earlier
cut's heal is in them), the targets in a pass of the original; both passes stop at the pair, so a cut costs two
partial passes and the steps of two blocks. A model in memory heals the same way (the tests compare the two).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from distill.layout import resolve_layout
from prune.atomic import write_file_atomic
from prune.loading.offload import materialized, streamed
from prune.model.adapters import get_blocks, input_device
from prune.model.capture import block_output
from prune.model.remote_code import float_param
from prune.replace.capture import SpanBatch, move, record
from prune.replace.fitter import adam_steps, relative_mse
from prune.replace.local import StatePatch

# The pair's Adam steps: a peak learning rate of 1e-3 (cosine to 0) on the MSE of unit-RMS states (normalised_mse).
# Chosen on the selection split (SmolLM2-135M, prune.ship --drop 4 --offload sequential --data builtin: fold on
# blocks 12-15, 100 steps; the geometric mean of its four texts' perplexity, training-free 30.87): the stream's MSE
# at lr 3e-5, 1e-4, 3e-4, 1e-3 and 3e-3 gave 31.00, 30.75, 30.44, 30.19 and 30.89; the unit-RMS MSE at 3e-4 and 1e-3
# 30.22 and 29.85 (-3.3 %), lower on each text. 300 steps of the stream's MSE at 1e-3: 29.72. Ship's heal in memory
# (LoRA, KL of the logits) gave 27.57 on the same build (2026-12-05, reports/heal-blocks/)
LOCAL_HEAL_LR = 1e-3
LOCAL_HEAL_LOSS = "rms"


def local_heal_settings() -> dict:
    """What the heal block by block trains and how, for a run's settings (a run healed otherwise is another run)."""
    return {"train": "blocks", "lr": LOCAL_HEAL_LR, "loss": LOCAL_HEAL_LOSS}


@dataclass(frozen=True)
class Cut:
    """Where the slim model lost blocks, as the heal trains it.

    Attributes:
        blocks: the slim model's blocks trained (its indices): the block carrying the cut and the one after.
        target: the original's block whose output the last of them is trained to give.
    """

    blocks: tuple[int, ...]
    target: int


def cuts_of(layout: list[list[int]], blocks_before: int | None = None) -> list[Cut]:
    """The cuts of a slim model from its layout (``layercut.json``: each block's original blocks), shallow first.

    A block covering more than one original block carries a repair of the span beside it: it and the block after
    it are trained. A gap between blocks (removed without a repair) trains the blocks on either side of it; blocks
    removed after the last kept one (``blocks_before``: the original's count) train that one towards the original's
    last block.
    """
    found: dict[tuple[int, ...], Cut] = {}
    last = len(layout) - 1
    for i, covered in enumerate(layout):
        pairs = []
        if i and min(covered) != max(layout[i - 1]) + 1 or not i and min(covered) != 0:
            pairs.append((max(i - 1, 0), i))
        if len(covered) > 1:
            pairs.append((i, min(i + 1, last)))
        for pair in pairs:
            blocks = tuple(sorted(set(pair)))
            found.setdefault(blocks, Cut(blocks, max(layout[blocks[-1]])))
    if blocks_before is not None and max(layout[last]) < blocks_before - 1:
        found.setdefault((last,), Cut((last,), blocks_before - 1))
    return sorted(found.values(), key=lambda cut: cut.blocks)


def in_original_basis(cut: Cut, basis_changes: Sequence[int]) -> bool:
    """Whether the slim model's state after ``cut``'s pair is the original's own, up to scale.

    ``basis_changes``: the first removed block of each span whose repair turned every weight upstream of it (a
    change of basis, ``fold-rotate``). Upstream of such a span the slim model's stream is the original's turned, so
    the target of a cut shallower than it, read from the original, is in another basis.
    """
    return all(start <= cut.target for start in basis_changes)


def cut_depths(layout: list[list[int]], blocks_before: int | None = None) -> list[tuple[int, int, int]]:
    """Each cut's blocks its two recording passes run: (the slim model's, the original's), as the planner counts them.

    The slim model's pass stops as its pair's last block is called, the original's after the target block; the
    third figure is the blocks the cut trains (one where the cut is at the last block).
    """
    return [(cut.blocks[-1], cut.target + 1, len(cut.blocks)) for cut in cuts_of(layout, blocks_before)]


def _batches(rows: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    return [rows[i : i + batch_size] for i in range(0, rows.shape[0], batch_size)]


@torch.no_grad()
def _recorded(student: nn.Module, original: nn.Module, cut: Cut, rows: torch.Tensor,
              batch_size: int) -> list[SpanBatch]:
    """Each batch's input to the cut's first block, every trained block's call, and the original's target.

    ``SpanBatch.args`` holds one ``(args, kwargs)`` call per trained block: a model whose layers attend
    differently (Gemma-3's sliding and global layers) calls each with its own mask and rotary tables.
    """
    slim_blocks, original_blocks = get_blocks(student)[1], get_blocks(original)[1]
    kept = []
    for batch in _batches(rows, batch_size):
        def inputs(recorder, batch_blocks=slim_blocks):
            recorder.input_of(batch_blocks[cut.blocks[0]], "x")
            for k, index in enumerate(cut.blocks):
                recorder.input_of(batch_blocks[index], f"call{k}", with_call=True)

        with streamed(student):
            seen = record(student, batch, inputs)
        with streamed(original):
            target = record(original, batch, lambda r: r.output_of(original_blocks[cut.target], "y"))["y"]
        calls = tuple(seen[f"call{k}.call"] for k in range(len(cut.blocks)))
        kept.append(move(SpanBatch(seen["x"], target, calls), torch.device("cpu")))
    return kept


def _unit_rms(states: torch.Tensor) -> torch.Tensor:
    states = states.float()
    return states * torch.rsqrt(states.pow(2).mean(-1, keepdim=True) + 1e-6)


def normalised_mse(output: torch.Tensor, batch: SpanBatch) -> torch.Tensor:
    """The MSE of each token's state scaled to unit RMS (what the next block's norm reads), relative to removal's.

    The stream's few outlier dimensions, hundreds of times the others, weigh the same here as in the norm after it.
    """
    return relative_mse(_unit_rms(output), _unit_rms(batch.y), _unit_rms(batch.x))


# the stream's MSE as it is (adam_steps' own), and the unit-RMS one
LOSSES = {"mse": None, "rms": normalised_mse}


def heal_cut(student: nn.Module, original: nn.Module, cut: Cut, rows: torch.Tensor, *, steps: int,
             lr: float = LOCAL_HEAL_LR, batch_size: int = 4, seed: int = 0, progress: bool = True,
             loss: str = LOCAL_HEAL_LOSS, keep: tuple[Path, str] | None = None) -> dict:
    """Train ``cut``'s blocks of ``student`` towards ``original``'s output at ``cut.target``; the record.

    The trained weights are put in place (on a skeleton, as changes its later passes and its export read). The
    loss (``loss``: a key of :data:`LOSSES`) is relative to leaving the pair out (1.0): the MSE of each token's
    state scaled to unit RMS (``rms``), or of the stream as it is (``mse``); the record holds it before the first
    step and over the last ten, and ``tokens_read``: the tokens of the batches its steps drew (a short last batch
    counts its own). ``keep``: ``(file, digest)``, where the trained weights and the record are written (all or
    nothing) for :func:`heal_locally` to take instead of training them again.
    """
    batches = _recorded(student, original, cut, rows, batch_size)
    slim_blocks = get_blocks(student)[1]
    pair = nn.ModuleList(materialized(slim_blocks[i]) for i in cut.blocks)
    device = input_device(student)
    dtype = float_param(pair[0]).dtype
    pair.to(device=device, dtype=torch.float32).eval()

    read = []

    def forward(batch: SpanBatch) -> torch.Tensor:
        read.append(batch.x.shape[0] * batch.x.shape[1])
        hidden = batch.x
        for block, (args, kwargs) in zip(pair, batch.args, strict=True):
            hidden = block_output(block(hidden, *args, **kwargs))
        return hidden

    params = list(pair.parameters())
    for param in params:
        param.requires_grad_(True)
    losses = adam_steps(params, batches, forward, steps=steps, lr=lr, seed=seed, device=device,
                        desc=f"heal blocks {list(cut.blocks)}", progress=progress, loss=LOSSES[loss])
    for param in params:  # the gradients go; the weights wait on the host until a pass or the export reads them
        param.grad = None
    pair.to(device="cpu", dtype=dtype).requires_grad_(False)
    tokens = int(rows.numel())
    last = losses[-10:]
    result = {"blocks": list(cut.blocks), "target": cut.target, "steps": steps, "lr": lr, "loss": loss,
              "tokens": tokens, "tokens_read": sum(read), "loss_start": round(losses[0], 6) if losses else None,
              "loss_end": round(sum(last) / len(last), 6) if last else None}
    if keep is not None:
        _keep_pair(*keep, pair, cut, result)
    _apply(student, cut, pair)
    return result


def _apply(student: nn.Module, cut: Cut, pair: Sequence[nn.Module]) -> None:
    slim_blocks = get_blocks(student)[1]
    for index, trained in zip(cut.blocks, pair, strict=True):
        StatePatch(slim_blocks[index], trained).apply()


def _digest(rows: torch.Tensor, *settings) -> str:
    """What a kept cut was trained from: the rows' token ids and shape and ``settings`` (another: trained again)."""
    digest = hashlib.sha256(rows.detach().cpu().to(torch.int64).contiguous().numpy().tobytes())
    digest.update(repr((tuple(rows.shape), *settings)).encode())
    return digest.hexdigest()


_KEPT_CUT = "cut-{}.safetensors"


def kept_cut_file(work: Path, cut: Cut) -> Path:
    """Where :func:`heal_locally` keeps ``cut``'s trained weights in its work folder."""
    return Path(work) / _KEPT_CUT.format("-".join(map(str, cut.blocks)))


def kept_cut_files(work: Path) -> list[Path]:
    """The cuts' trained weights :func:`heal_locally` kept in ``work`` (none where it is not there)."""
    return sorted(Path(work).glob(_KEPT_CUT.format("*")))


def _keep_pair(path: Path, digest: str, pair: Sequence[nn.Module], cut: Cut, record: dict) -> None:
    tensors = {f"{index}.{name}": param.detach().contiguous()
               for index, block in zip(cut.blocks, pair, strict=True) for name, param in block.named_parameters()}
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"digest": digest, "record": json.dumps(record)}
    write_file_atomic(path, lambda staging: save_file(tensors, str(staging), metadata=metadata))


def _kept_pair(student: nn.Module, path: Path, cut: Cut, digest: str,
               say: Callable[[str], None]) -> tuple[list[nn.Module], dict] | None:
    """The pair as :func:`heal_cut` kept it in ``path``, and its record.

    None where none was kept there from these rows and settings, or the file cannot be read whole (said: the cut
    trains again and writes it anew).
    """
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as saved:
            metadata = saved.metadata() or {}
            if metadata.get("digest") != digest:
                say(f"blocks {list(cut.blocks)}: the pair kept in {path} was trained from other rows, settings or "
                    "cuts before it: trained again")
                return None
            tensors = {name: saved.get_tensor(name) for name in saved.keys()}  # noqa: SIM118 (safe_open is no dict)
        pair = []
        for index in cut.blocks:
            block = materialized(get_blocks(student)[1][index])
            for name, param in block.named_parameters():
                param.data = tensors[f"{index}.{name}"].to(dtype=param.dtype)
            pair.append(block)
        return pair, json.loads(metadata["record"])
    except (SafetensorError, OSError, KeyError, ValueError) as err:
        say(f"blocks {list(cut.blocks)}: the pair kept in {path} cannot be read ({err}): trained again")
        return None


def heal_locally(student: nn.Module, original: nn.Module, layout: list[list[int]], rows: torch.Tensor, *,
                 steps: int, lr: float = LOCAL_HEAL_LR, batch_size: int = 4, seed: int = 0, progress: bool = True,
                 loss: str = LOCAL_HEAL_LOSS, blocks_before: int | None = None, basis_changes: Sequence[int] = (),
                 work: str | Path | None = None, say: Callable[[str], None] = print) -> list[dict]:
    """Heal every cut of ``student`` (``layout``: its blocks' original blocks) in turn, ``steps`` steps each.

    ``rows`` [n, seq]: the token ids the passes record; ``blocks_before``: the original's block count;
    ``basis_changes``: see :func:`in_original_basis` (a cut shallower than such a span is left as built, and said);
    ``work``: a folder each cut's trained weights are kept in as it ends (:func:`kept_cut_file`). A heal run again
    from the same rows, settings, layout and device takes the cuts kept there instead of training them: a killed
    heal goes on from its last whole cut, to the weights an unbroken one gives (a later cut's inputs are recorded
    with them; each cut's digest holds the one before it, so a cut trained again trains every later one again).
    Returns each healed cut's record (:func:`heal_cut`).
    """
    records = []
    digest = _digest(rows, steps, lr, batch_size, seed, loss, layout, blocks_before, input_device(student).type)
    for cut in cuts_of(layout, blocks_before):
        if not in_original_basis(cut, basis_changes):
            say(f"not healing blocks {list(cut.blocks)}: a deeper cut's repair turned the basis of their states")
            continue
        digest = hashlib.sha256(f"{digest} {cut}".encode()).hexdigest()
        keep = kept_cut_file(Path(work), cut) if work is not None else None
        kept = _kept_pair(student, keep, cut, digest, say) if keep is not None else None
        if kept is not None:
            pair, record = kept
            _apply(student, cut, pair)
            say(f"blocks {list(cut.blocks)} healed before: their trained weights read from {keep}")
            records.append(record)
            continue
        say(f"healing blocks {list(cut.blocks)} towards the original's block {cut.target}: {steps} steps")
        records.append(heal_cut(student, original, cut, rows, steps=steps, lr=lr, batch_size=batch_size,
                                seed=seed, progress=progress, loss=loss,
                                keep=None if keep is None else (keep, digest)))
    return records


def basis_changes(report: dict) -> list[int]:
    """The first removed block of each span whose repair turned the basis upstream (``fold-rotate``'s records)."""
    return [min(record["replaces"]) for record in report.get("replacements") or ()
            if "rotation_angle" in record and record.get("replaces")]


def heal_built(student: nn.Module, original: nn.Module, report: dict, rows: torch.Tensor, **options) -> list[dict]:
    """:func:`heal_locally` on a built checkpoint, its cuts read from its ``layercut.json`` (``report``).

    The layout (else one rebuilt from the removed blocks, :func:`distill.layout.resolve_layout`), the original's
    block count and the changes of basis are the report's; ``options``: :func:`heal_locally`'s other keywords.
    """
    layout = report.get("layout") or resolve_layout(student, original, report)
    return heal_locally(student, original, layout, rows, blocks_before=report.get("num_blocks_before"),
                        basis_changes=basis_changes(report), **options)
