"""The model's own text as calibration (``--data self``): sampled in batches with the KV cache, kept on disk.

:func:`cached_samples` is what :func:`prune.data.calibration.calibration_data` calls for a ``self`` source; a
sample is keyed by everything its tokens depend on, kept in the converted-checkpoint cache, and the embedded
model's default sample ships with layercut (:data:`SHIPPED_SAMPLES`). :func:`self_batches` says from the settings
alone how many batches a run will sample, so the planner can cost it before any weight is read.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

import torch
from tqdm.auto import tqdm

from prune.atomic import write_file_atomic
from prune.data.sources import SELF_DEFAULTS, shares
from prune.errors import LayercutError
from prune.loading.loader import cache_dir
from prune.model.adapters import cache_keyword
from prune.stamps import weights_fingerprint

logger = logging.getLogger(__name__)

SELF_BATCH = 8  # rows sampled together: a sample is drawn, kept and read in whole batches of this many


def _top_p_sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``logits`` [batch, vocab] from the smallest set holding ``top_p`` of the mass."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [batch, vocab]
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # keep a token while the mass before it is under top_p: the most likely token always stays
    keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) < top_p
    sorted_probs = sorted_probs * keep
    picked = torch.multinomial(sorted_probs, 1, generator=generator)  # [batch, 1], index into the sorted order
    return order.gather(-1, picked)  # [batch, 1]


# stands where a user's first words go when the chat template is rendered, to cut the opening before them
_USER_MARK = "LAYERCUTUSERTURN"
CHAT_DATE = "26 Jul 2024"  # the date a template that writes one is given (Llama-3.1's default text)


def chat_opening(tokenizer) -> list[int]:
    """The tokens the model's chat template opens a conversation with, up to where the user's first words go.

    Its system turn (where the template writes a default one) and the user's turn header: sampled on from there,
    an instruct model writes a request in its own words and then, past its end-of-turn and the assistant's header,
    its answer, the conversations it was tuned on as it would hold them itself (the pre-query sampling of Xu et
    al., "Magpie", 2024).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise LayercutError("--data self:chat opens the model's conversations with its chat template and this "
                            "tokenizer has none: use self, or load a tokenizer with a chat template")
    try:  # a fixed date: templates that write today's (Llama-3.1's) would open, and sample, otherwise each day
        text = tokenizer.apply_chat_template([{"role": "user", "content": _USER_MARK}], tokenize=False,
                                             date_string=CHAT_DATE)
    except Exception as err:  # noqa: BLE001 - a template's own raise_exception, or one that reads other fields
        raise LayercutError(f"--data self:chat: the chat template refuses a lone user turn ({type(err).__name__}: "
                            f"{str(err).splitlines()[0] if str(err) else ''}); use self") from None
    if _USER_MARK not in text:
        raise LayercutError("--data self:chat: this chat template does not write the user's words as given; use self")
    opening = tokenizer(text[:text.index(_USER_MARK)], add_special_tokens=False)["input_ids"]
    if not opening:
        raise LayercutError("--data self:chat: this chat template writes nothing before the user's words; use self")
    return opening


def check_chat_sources(tokenizer, config) -> None:
    """Refuse a ``self:chat`` source that ``tokenizer`` cannot open, before the work ahead of its draw.

    ``config``: a :class:`prune.data.calibration.DataConfig`. A ship's heal draws its text after the shortlist.
    """
    if any(source.is_self and dict(source.sampling).get("chat") for source in config.sources):
        _check_opening(chat_opening(tokenizer), config.seq_len)


def _check_opening(opening: list[int], seq_len: int) -> None:
    if len(opening) >= seq_len:
        raise LayercutError(f"--data self:chat: the chat template opens with {len(opening)} tokens, no fewer than "
                            f"the {seq_len} of a sequence; raise --seq-len")


@torch.no_grad()
def sample_sequences(model, tokenizer, count: int, seq_len: int, seed: int, temperature: float = 1.0,
                     top_p: float = 0.95, batch_size: int = SELF_BATCH, chat: int = 0) -> torch.Tensor:
    """``count`` sequences of ``seq_len`` tokens sampled from ``model``, each from the same opening tokens.

    The sequences start where a document starts (BOS, else EOS, which separates documents) so the
    model writes what it considers typical text; ``chat``: where its chat template opens a conversation
    (:func:`chat_opening`), so an instruct model writes requests and its answers. Sampling runs past an EOS:
    what follows is the next document, as in packed text. Same model, seed and device give the same tokens.
    """
    if chat:
        opening = chat_opening(tokenizer)
        _check_opening(opening, seq_len)
    else:
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if start is None:
            raise LayercutError("--data self starts sampling at the BOS or EOS token and this tokenizer has neither: "
                                "use a text source for --data")
        opening = [start]
    device = model.get_input_embeddings().weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    cache_name = cache_keyword(model)
    rows = []
    with tqdm(total=count * seq_len, desc="sampling calibration text", unit="tok") as bar:
        for first in range(0, count, batch_size):
            batch = min(batch_size, count - first)
            ids = torch.tensor([opening], dtype=torch.long, device=device).repeat(batch, 1)  # [batch, opening]
            tokens, past = [ids], None  # the first step reads the whole opening, the others one token
            bar.update(batch * len(opening))
            for _ in range(seq_len - len(opening)):
                out = model(input_ids=tokens[-1], use_cache=True, **{cache_name: past})
                past = getattr(out, cache_name)
                tokens.append(_top_p_sample(out.logits[:, -1], temperature, top_p, generator))
                bar.update(batch)
            rows.append(torch.cat(tokens, dim=1).cpu())  # [batch, seq_len]
    return torch.cat(rows)  # [count, seq_len]


SELF_CACHE_FORMAT = 1  # bumped when what a cached sample means changes
# Text the embedded model (SmolLM2-135M, float32 on a CPU) sampled for the default calibration of a first
# run (36 x 512 tokens), shipped so that run takes 1.5 minutes on two cores rather than the 6.5 more its
# sampling takes when idle. Keyed like the cache: only the same weights, tokenizer, seed, options and
# device read it, so it is the text such a run would sample itself.
SHIPPED_SAMPLES = Path(str(resources.files("prune.data"))) / "corpus" / "self-text"
SHIPPED_ROWS = 36  # the rows of that sample (32 + 4 held out: half of the default 64 + 8)


def self_cache_dir() -> Path:
    """Where sampled text is kept: ``self-text`` in the converted-checkpoint cache (``$LAYERCUT_CACHE``)."""
    return cache_dir() / "self-text"


# folders that also keep every sampled text read or drawn while they are set (samples_kept_in)
_KEPT_IN: list[Path] = []


@contextmanager
def samples_kept_in(folder: str | Path) -> Iterator[None]:
    """Inside the ``with``, sampled text is read from ``folder`` first, and whatever is read or drawn is kept there.

    Sampling is not bit-for-bit the same on every machine (the float order of another CPU's or GPU's kernels
    changes a token, and every token after it): a comparison resumed elsewhere would draw other text and
    could no longer add cells to its table. Its folder keeps the sampled tokens it was measured on, under the
    cache's names (the digest of the weights, tokenizer, seed and options), so only the same model reads them.
    """
    _KEPT_IN.append(Path(folder))
    try:
        yield
    finally:
        _KEPT_IN.pop()


def _sample_key(model, tokenizer, count: int | None, seq_len: int, seed: int, options: dict,
                batch_size: int = SELF_BATCH) -> str | None:
    """What the sampled tokens depend on, hashed; ``None`` when the weights cannot be stamped.

    ``count`` None: the key of every sample of these settings, whatever its rows (:func:`cached_samples`).
    """
    stamp = weights_fingerprint(model, sums=True)
    if stamp is None:
        return None
    weight = model.get_input_embeddings().weight
    fields = [SELF_CACHE_FORMAT, stamp, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, count,
              seq_len, seed, {**SELF_DEFAULTS, **options}, batch_size, weight.device.type, str(weight.dtype)]
    if options.get("chat"):  # another template opens other conversations (a plain sample's key stays as it was)
        fields.append(chat_opening(tokenizer))
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def cached_samples(model, tokenizer, count: int, seq_len: int, seed: int, batch: int = SELF_BATCH,
                   **options: float) -> torch.Tensor:
    """:func:`sample_sequences`, kept on disk: the same model, tokenizer, seed and options sample once.

    Sampling is the slow part of the default calibration on a CPU (256 x 128 tokens of SmolLM2-135M take
    about 9 minutes on 2 cores), and every distillation and comparison cell of one model asks for the same
    tokens. A sample is drawn in whole batches of ``batch`` rows (the last one too, its surplus rows kept)
    and named by a digest of everything the tokens depend on but the row count, the weights' values included
    (:func:`prune.stamps.weights_fingerprint` with sums), and its rows: ``KEY-ROWS.safetensors``. The first
    rows of a sample are the rows of any smaller one, batch for batch, so a kept sample serves every request
    its whole batches cover (``--samples 32`` reads the first 20 rows of the 36 the default calibration keeps).
    Anything else, an unreadable file or weights that cannot be stamped, samples again.
    """
    every = _sample_key(model, tokenizer, None, seq_len, seed, options, batch)
    if every is None:
        return sample_sequences(model, tokenizer, count, seq_len, seed, batch_size=batch, **options)
    # an earlier version named a sample by its exact row count: read first, it is what that request drew then
    exact = f"{_sample_key(model, tokenizer, count, seq_len, seed, options, batch)}.safetensors"
    # a folder keeping its own samples first: it holds what an earlier run, maybe on another machine, measured on
    kept = list(reversed(_KEPT_IN))
    whole = source = None
    for folder in (*kept, self_cache_dir(), SHIPPED_SAMPLES):  # shipped: the embedded model's first run
        for candidate in (folder / exact, *_covering(folder, every, count, batch)):
            whole = _read_samples(candidate, count, seq_len)
            if whole is not None:
                source = candidate
                break
        if whole is not None:
            break
    if whole is None:
        rows = _whole_batches(count, batch)
        whole = sample_sequences(model, tokenizer, rows, seq_len, seed, batch_size=batch, **options)
        source = self_cache_dir() / f"{every}-{rows}.safetensors"
        _keep_samples(whole, source)
    for folder in kept:  # the cache is not filled from a folder: its copy would outlive the folder's run
        if source.parent != folder and _read_samples(folder / source.name, count, seq_len) is None:
            _keep_samples(whole, folder / source.name)
    return whole[:count]


def self_batches(config, model: str) -> int:
    """Batches of the model's own text ``config`` samples (``self:batch=N`` rows each), 0 where none or it ships.

    ``config``: a :class:`prune.data.calibration.DataConfig`. Read from the settings alone, before any weight, so
    the planner can cost the sampling (a batch's steps cost alike whatever its rows): the embedded model's default
    sample ships with layercut (:data:`SHIPPED_SAMPLES`, :data:`SHIPPED_ROWS` rows), so its runs sample nothing.
    """
    return sum(_whole_batches(count, batch) // batch for count, batch in _sampled(config, model))


def _sampled(config, model: str) -> list[tuple[int, int]]:
    """(rows wanted, batch) of each ``self`` source of ``config`` that samples (its text not shipped)."""
    from prune.loading.names import EMBEDDED_MODEL

    sources = config.sources
    weights = [source.weight for source in sources]
    wanted = {index: samples + heldout for index, (samples, heldout) in enumerate(zip(
        shares(config.samples, weights), shares(config.heldout_samples, weights), strict=True))}
    sampled = []
    for index, source in enumerate(sources):
        if not source.is_self:
            continue
        count, batch = wanted[index], int(dict(source.sampling).get("batch", SELF_BATCH))
        shipped = (model.lower() == EMBEDDED_MODEL and config.seq_len == 512 and config.seed == 0
                   and dict(source.sampling) == SELF_DEFAULTS and _holds(SHIPPED_ROWS, count, batch))
        if not shipped and count:
            sampled.append((count, batch))
    return sampled


def _whole_batches(count: int, batch: int) -> int:
    """The rows a sample of ``count`` draws: whole batches of ``batch``."""
    return -(-count // batch) * batch


def _holds(rows: int, count: int, batch: int) -> bool:
    """Whether a sample of ``rows`` rows serves ``count``: all of it, or rows its whole batches cover.

    An earlier version drew a last, smaller batch: its rows are not those of a whole one.
    """
    return count == rows or count <= rows // batch * batch


def _covering(folder: Path, every: str, count: int, batch: int) -> list[Path]:
    """The samples of key ``every`` in ``folder`` that hold ``count`` rows (:func:`_holds`), fewest first."""
    found = []
    for path in folder.glob(f"{every}-*.safetensors") if folder.is_dir() else ():
        rows = path.stem.rpartition("-")[2]
        if rows.isdigit() and _holds(int(rows), count, batch):
            found.append((int(rows), path))
    return [path for _, path in sorted(found)]


def _keep_samples(ids: torch.Tensor, path: Path) -> None:
    from safetensors.torch import save_file

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(path, lambda staging: save_file({"ids": ids.contiguous()}, str(staging)))
    except OSError as err:
        logger.warning("could not keep the sampled text in %s (%s): the next run samples again", path, err)


def _read_samples(path: Path, count: int | None, seq_len: int) -> torch.Tensor | None:
    """The [rows, seq_len] token ids kept in ``path``, ``count`` rows at least.

    None when the file is missing, unreadable, of another shape or too short.
    """
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    try:
        ids = load_file(path)["ids"]
    except Exception as err:  # a truncated or foreign file is only a missed cache entry
        logger.warning("ignoring the unreadable sample cache %s (%s): sampling again", path, err)
        return None
    if ids.dim() != 2 or ids.shape[1] != seq_len or ids.dtype != torch.long or ids.shape[0] < (count or 1):
        return None
    logger.info("sampled text read from %s (%d x %d tokens)", path, ids.shape[0], seq_len)
    return ids
