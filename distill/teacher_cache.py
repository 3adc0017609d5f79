"""The teacher's top-K logits, written once and read memory-mapped, so training runs without the teacher.

``--teacher-cache topk=K`` (``DistillConfig.teacher_cache``): before the first step the teacher runs once (eval,
no grad, the run's autocast) over the training sequences and the held-out ones the run measures, and keeps
per token its K largest logits, their vocabulary ids (int32) and the log-sum-exp of the other logits, so the
probability of the "rest" bucket is exact (``distill.losses.topk_kl``). The files live in
``<work>/teacher_cache/`` as ``.npy`` arrays read with ``numpy`` memory maps, beside the token ids they were
made from and ``header.json``. The header's ``key`` is a digest of the teacher's weights (their fingerprint
with sums), the token ids, K, the dtype and the autocast: a run whose key differs rewrites the cache, never
reads another teacher's targets. The header also keeps a ``request`` (the teacher's files, the data options,
K) that ``distill.job`` matches before loading anything, so a resumed run never loads the teacher.

The folder is written under a temporary name and renamed; under ``accelerate launch`` the main process writes
it while the others wait, then every process reads it.

A cache of at most :data:`KEPT_MAX_BYTES` is also kept across runs, under its key in
``$LAYERCUT_CACHE/teacher-cache/`` (the :data:`KEPT_COUNT` latest): a later run of the same teacher on the same
token ids (``prune.ship`` on one model and calibration, whatever its budget) copies it instead of running the
teacher again (77 s of SmolLM2-135M's 32,768 heal tokens on 2 CPU cores).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from distill.forward import TeacherTargets, forward_head
from distill.head_kl import topk_through_head
from distill.losses import TeacherTopK, topk_targets
from prune.errors import LayercutError
from prune.model.head import head_apart
from prune.stamps import weights_fingerprint

logger = logging.getLogger(__name__)

CACHE_DIR = "teacher_cache"
HEADER = "header.json"
CACHE_FORMAT = 1  # bumped when what the files mean changes
DTYPE = "float32"  # of the logits and the rest's log-sum-exp; the ids are int32
_ARRAYS = ("logits", "indices", "rest_lse", "ids")
KEPT_DIR = "teacher-cache"  # under $LAYERCUT_CACHE: caches kept across runs, one folder per key
# a cache larger than this is left in its run's work folder alone: distill.run's caches of millions of tokens
# would fill the user's cache folder (ship's heal: 67 MB for 32,768 tokens at K = 256)
KEPT_MAX_BYTES = 512 * 1024**2
KEPT_COUNT = 4  # the latest caches kept; older ones are deleted as a new one is kept
KEEP_ENV = "LAYERCUT_KEEP_TEACHER_CACHE"


def cache_folder(work: str | Path) -> Path:
    """Where a work folder keeps its teacher cache."""
    return Path(work) / CACHE_DIR


def token_digest(token_ids: torch.Tensor, heldout_ids: torch.Tensor | None) -> str:
    """A digest of the training and held-out token ids (shapes and values)."""
    digest = hashlib.sha256()
    for ids in (token_ids, heldout_ids):
        if ids is not None:
            digest.update(str(tuple(ids.shape)).encode() + ids.long().contiguous().numpy().tobytes())
        digest.update(b"|")
    return digest.hexdigest()[:32]


def cache_key(fingerprint: str | None, tokens: str, k: int, precision: str) -> str:
    """The digest a cache must carry to be read: teacher weights, token ids, K, dtype and autocast."""
    fields = {"format": CACHE_FORMAT, "teacher": fingerprint, "tokens": tokens, "k": k, "dtype": DTYPE,
              "precision": precision}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def files_stamp(source: str) -> str | None:
    """A stamp of a local checkpoint's files (names, sizes, modification times); None for a hub id.

    Cheap, nothing is loaded: it lets a resumed run trust the cache of the same files without loading the
    teacher to fingerprint its weights.
    """
    path = Path(source)
    if not path.exists():
        return None
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    digest = hashlib.sha256()
    for file in files:
        info = file.stat()
        digest.update(f"{file.name}:{info.st_size}:{info.st_mtime_ns};".encode())
    return digest.hexdigest()[:32]


class TeacherCache:
    """A written cache, memory-mapped: the teacher's targets by row (``distill.forward.TeacherSource``).

    Rows ``0 .. rows - 1`` are the training sequences, the held-out ones follow.

    Attributes:
        folder: the cache folder.
        header: its ``header.json``.
        k: top-K classes kept per token.
    """

    def __init__(self, folder: Path, header: dict, keep: object = None):
        self.folder, self.header, self.k = folder, header, int(header["k"])
        self._keep = keep  # a temporary folder's handle, alive as long as the cache is read
        # read-only maps: each batch reads its rows from the page cache, the arrays are never loaded whole
        self.arrays = {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in _ARRAYS}
        self.rows = int(header["rows"])
        self.written = False  # whether this run wrote it (else it was reused)

    def report(self) -> dict:
        """The ``teacher_cache`` entry of a run's report: K, size, writing time and whether this run wrote it."""
        size = sum((self.folder / f"{name}.npy").stat().st_size for name in _ARRAYS)
        return {"k": self.k, "dtype": self.header["dtype"], "bytes": size, "write_seconds": self.header["seconds"],
                "written": self.written, "sequences": self.rows + int(self.header["heldout_rows"])}

    @property
    def token_ids(self) -> torch.Tensor:
        """The training sequences [rows, seq_len] int64 the cache was written for."""
        return torch.from_numpy(np.array(self.arrays["ids"][: self.rows]))

    @property
    def heldout_ids(self) -> torch.Tensor | None:
        """The held-out sequences [n, seq_len] int64, or None when the run measures none."""
        held = np.array(self.arrays["ids"][self.rows:])
        return torch.from_numpy(held) if held.shape[0] else None

    @property
    def sources(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each training and held-out row's source, for a mixture (``generalisation.heldout_strata``)."""
        path = self.folder / "sources.npz"
        if not path.is_file():
            return None
        with np.load(path) as saved:
            return torch.from_numpy(saved["rows"]), torch.from_numpy(saved["heldout"])

    def targets(self, rows: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> TeacherTargets:
        """The cached top-K of ``rows``, whose tokens must be ``ids`` (a row mix-up fails loudly, never trains)."""
        index = rows.long().numpy()
        cached = torch.from_numpy(np.array(self.arrays["ids"][index]))
        if not torch.equal(cached, ids.cpu().long()):
            raise RuntimeError(f"teacher cache {self.folder}: rows {index.tolist()} hold other tokens than the batch")
        topk = TeacherTopK(torch.from_numpy(np.array(self.arrays["logits"][index])),  # [batch, seq, K] float32
                           torch.from_numpy(np.array(self.arrays["indices"][index])).long(),  # [batch, seq, K]
                           torch.from_numpy(np.array(self.arrays["rest_lse"][index])))  # [batch, seq]
        return TeacherTargets({}, None, topk)


def read_header(folder: Path) -> dict | None:
    """The cache's header, or None when it is missing or unreadable (then the cache is written again)."""
    try:
        header = json.loads((folder / HEADER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return header if isinstance(header, dict) and header.get("format") == CACHE_FORMAT else None


def open_cache(folder: Path, *, key: str | None = None, request: dict | None = None,
               keep: object = None) -> TeacherCache | None:
    """The cache in ``folder`` if its header carries ``key`` (or, without a key, ``request``); else None."""
    header = read_header(folder)
    if header is None or (key is not None and header.get("key") != key):
        return None
    if key is None and (request is None or header.get("request") != request):
        return None
    try:
        return TeacherCache(folder, header, keep)
    except (OSError, ValueError) as err:  # a damaged array is a missed cache: written again
        logger.warning("ignoring the unreadable teacher cache %s (%s): writing it again", folder, err)
        return None


def _write_arrays(staging: Path, teacher: nn.Module, ids: torch.Tensor, k: int, batch_size: int,
                  autocast: Callable[[], AbstractContextManager]) -> None:
    """Run the teacher over ``ids`` [rows, seq] in batches and write its top-K arrays into ``staging``."""
    from prune.model.adapters import input_device

    rows, seq = ids.shape
    out = {
        "logits": np.lib.format.open_memmap(staging / "logits.npy", "w+", np.float32, (rows, seq, k)),
        "indices": np.lib.format.open_memmap(staging / "indices.npy", "w+", np.int32, (rows, seq, k)),
        "rest_lse": np.lib.format.open_memmap(staging / "rest_lse.npy", "w+", np.float32, (rows, seq)),
    }
    np.save(staging / "ids.npy", ids.long().numpy())
    device = input_device(teacher)
    # the top K through the head a chunk of positions at a time, where the head's matmul is all there is after the
    # final norm: the whole logits and the rest's masked copy were fresh vocabulary-wide tensors every batch
    apart = head_apart(teacher)
    with tqdm(total=rows, desc="teacher cache", unit="seq") as bar:
        for first in range(0, rows, batch_size):
            batch = ids[first:first + batch_size]  # [batch, seq]
            with torch.no_grad(), autocast():
                mask = torch.ones_like(batch).to(device)
                if apart is not None:
                    _, head, _ = forward_head(teacher, teacher, batch.to(device), mask, set(), apart)
                    top = TeacherTopK(*topk_through_head(head.hidden, head.head, k))
                else:
                    logits = teacher(input_ids=batch.to(device), attention_mask=mask,
                                     use_cache=False).logits  # [batch, seq, vocab]
                    top = topk_targets(logits, k)
            end = first + batch.shape[0]
            out["logits"][first:end] = top.logits.cpu().numpy()
            out["indices"][first:end] = top.indices.to(torch.int32).cpu().numpy()
            out["rest_lse"][first:end] = top.rest_lse.cpu().numpy()
            bar.update(batch.shape[0])
    for array in out.values():
        array.flush()


def write_cache(folder: Path, teacher: nn.Module, token_ids: torch.Tensor, heldout_ids: torch.Tensor | None,
                k: int, header: dict, *, batch_size: int = 4, sources=None,
                autocast: Callable[[], AbstractContextManager] | None = None) -> float:
    """Write the cache of ``teacher`` on the training and held-out ids atomically; returns the seconds taken.

    ``header`` (``key``, ``request``, ...) is completed with the shapes and written last, inside the
    temporary folder, which then replaces ``folder``.
    """
    from contextlib import nullcontext

    started = time.perf_counter()
    ids = token_ids if heldout_ids is None else torch.cat([token_ids, heldout_ids.to(token_ids.dtype)])
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    was_training = teacher.training
    teacher.eval()
    try:
        _write_arrays(staging, teacher, ids, k, batch_size, autocast or nullcontext)
        if sources is not None:
            np.savez(staging / "sources.npz", rows=sources[0].numpy(), heldout=sources[1].numpy())
        seconds = round(time.perf_counter() - started, 3)
        full = {**header, "format": CACHE_FORMAT, "k": k, "dtype": DTYPE, "rows": int(token_ids.shape[0]),
                "heldout_rows": int(ids.shape[0] - token_ids.shape[0]), "seq_len": int(ids.shape[1]),
                "seconds": seconds}
        (staging / HEADER).write_text(json.dumps(full, indent=1), encoding="utf-8")
        shutil.rmtree(folder, ignore_errors=True)  # an older cache of other targets: never mixed with these
        os.replace(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        teacher.train(was_training)
    logger.info("teacher cache: %d sequences, top-%d, written to %s in %.1f s", ids.shape[0], k, folder, seconds)
    return seconds


def prepare_cache(folder: Path | None, teacher: nn.Module, token_ids: torch.Tensor, heldout_ids: torch.Tensor | None,
                  k: int, *, precision: str, batch_size: int = 4, sources=None, request: dict | None = None,
                  meta: dict | None = None, autocast=None) -> TeacherCache:
    """The valid cache in ``folder``, written first when missing or made for another teacher, data or K.

    ``folder`` None writes to a temporary folder kept as long as the returned cache. The main process
    writes; the others wait and read. ``request`` is what ``distill.job`` matches without the teacher.

    Raises:
        LayercutError: ``k`` above the vocabulary.
    """
    from distill.processes import process_state

    vocab = int(teacher.get_input_embeddings().weight.shape[0])
    if k > vocab:
        raise LayercutError(f"--teacher-cache topk={k} keeps more classes than the vocabulary has ({vocab}): "
                            f"give K <= {vocab}")
    keep = None
    if folder is None:
        if process_state().num_processes > 1:  # each process's temporary folder would be its own
            raise LayercutError("--teacher-cache on several processes needs a work folder they share: pass --out "
                                "(or --work-dir)")
        keep = tempfile.TemporaryDirectory(prefix="layercut-teacher-cache-")
        folder = Path(keep.name) / CACHE_DIR
    key = cache_key(weights_fingerprint(teacher, sums=True), token_digest(token_ids, heldout_ids), k, precision)
    state = process_state()
    written = False
    if state.is_main_process and open_cache(folder, key=key) is None:
        if read_header(folder) is not None:
            logger.warning("the teacher cache in %s was written for another teacher, data or K: writing it again",
                           folder)
        header = {"key": key, "request": request, "precision": precision, "vocab": vocab, **(meta or {})}
        if not _copy_kept(key, folder, header):
            write_cache(folder, teacher, token_ids, heldout_ids, k, header, batch_size=batch_size, sources=sources,
                        autocast=autocast)
            written = True
            _keep(key, folder)
    state.wait_for_everyone()
    cache = open_cache(folder, key=key, keep=keep)
    if cache is None:
        raise LayercutError(f"the teacher cache in {folder} could not be read after writing it: check the disk "
                            "(free space, permissions) and run again")
    cache.written = written
    return cache


def kept_folder(key: str) -> Path | None:
    """Where the cache of ``key`` is kept across runs (``$LAYERCUT_CACHE/teacher-cache/<key>``).

    None with ``LAYERCUT_KEEP_TEACHER_CACHE=0`` (a benchmark timing the teacher's pass sets it).
    """
    from prune.loading.gguf import cache_dir

    if os.environ.get(KEEP_ENV, "1") == "0":
        return None
    return cache_dir() / KEPT_DIR / key


def _copy_kept(key: str, folder: Path, header: dict) -> bool:
    """Copy the cache kept under ``key`` into ``folder`` (its header this run's); False where none is kept."""
    kept = kept_folder(key)
    if kept is None or open_cache(kept, key=key) is None:
        return False
    # the arrays are the kept ones; what this run asked for (its request, its teacher's name) is its own
    stored = json.loads((kept / HEADER).read_text(encoding="utf-8"))
    _copy_folder(kept, folder, {**stored, **header, "kept_from": str(kept)})
    logger.info("teacher cache: the teacher's targets kept from an earlier run of the same teacher and token ids "
                "(%s), not computed again", kept)
    return True


def _keep(key: str, folder: Path) -> None:
    """Keep a copy of the cache just written in ``folder`` for later runs, if it is small enough.

    It never fails the run: a cache folder that cannot be written only loses the saving.
    """
    kept = kept_folder(key)
    if kept is None or sum(path.stat().st_size for path in folder.iterdir()) > KEPT_MAX_BYTES:
        return
    try:
        _copy_folder(folder, kept)
        others = sorted((p for p in kept.parent.iterdir() if p.is_dir() and not p.name.startswith(".")),
                        key=lambda p: p.stat().st_mtime, reverse=True)
        for old in others[KEPT_COUNT:]:
            shutil.rmtree(old, ignore_errors=True)
    except (OSError, LayercutError) as err:
        logger.warning("the teacher cache could not be kept for later runs in %s (%s)", kept, err)


def _copy_folder(source: Path, target: Path, header: dict | None = None) -> None:
    """``source``'s files into ``target``, replacing it whole (``prune.atomic.atomic_directory``).

    ``header``, when given, is written instead of ``source``'s.
    """
    from prune.atomic import atomic_directory

    with atomic_directory(target, overwrite=True) as staging:
        for path in source.iterdir():
            if header is None or path.name != HEADER:
                shutil.copy2(path, staging / path.name)
        if header is not None:
            (staging / HEADER).write_text(json.dumps(header, indent=1), encoding="utf-8")
