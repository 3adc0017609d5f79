"""Shared fixtures; the helpers they use are in :mod:`tests.helpers`."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

# before transformers is imported (it reads them once): no test reaches the hub, and the modeling code of
# trust_remote_code loads goes to a throw-away folder, not the user's ~/.cache/huggingface/modules
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
if "HF_MODULES_CACHE" not in os.environ:  # a folder of this run's own, removed when the run ends
    os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="layercut-test-modules-")
    atexit.register(shutil.rmtree, os.environ["HF_MODULES_CACHE"], ignore_errors=True)
# the planner's CPU rates at the reference machine's speed: a plan a test checks must not move with the machine's load
# (prune.planner.machine; tests of the probe itself unset it)
os.environ["LAYERCUT_MACHINE_SPEED"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from tests.helpers import (  # noqa: E402
    _TEXT,
    SHARED_DATA,
    compiled_template_once,
    make_tiny_model,
    make_tiny_tokenizer,
    novel_tokens,
)


@pytest.fixture(scope="session", autouse=True)
def _sample_cache(tmp_path_factory):
    """Sampled calibration text is kept for this session only, never in the user's ~/.cache/layercut."""
    import prune.data.self_text

    folder = tmp_path_factory.mktemp("self-text")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prune.data.self_text, "self_cache_dir", lambda: folder)
        yield folder


@pytest.fixture(autouse=True)
def _kept_teacher_caches(tmp_path_factory, monkeypatch):
    """Teacher caches kept across runs go to a folder of this test's own, never ~/.cache/layercut: no test reads
    another's (a test of the keeping runs twice within itself)."""
    import distill.teacher_cache

    folder = tmp_path_factory.mktemp("kept-teacher-caches")
    real = distill.teacher_cache.kept_folder
    monkeypatch.setattr(distill.teacher_cache, "kept_folder",
                        lambda key: None if real(key) is None else folder / key)
    return folder


@pytest.fixture(scope="session")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def novel_stream(tiny_tokenizer) -> torch.Tensor:
    """The shipped novel (``--data builtin``) as the tiny tokenizer's token stream: 680 kB tokenised once a session."""
    return novel_tokens(tiny_tokenizer)


@pytest.fixture(autouse=True)
def tokenised_novel(monkeypatch, tiny_tokenizer):
    """``prune.data.calibration`` reads the novel's tokens from :func:`novel_tokens` rather than tokenising it again.

    Every test calibrating on the novel in this process (``prune.run``, ``eval.compare``, ``prune.slim``... with the
    default ``--data``) would tokenise its 680 kB again. Only the novel read alone, without special tokens, by a
    tokenizer with a Rust backend is served from the session's copy for that tokenizer (the same ids: made by the
    same function); any other text is tokenised as usual. Returns the tiny tokenizer.
    """
    import prune.data.calibration as calibration

    real, novel = calibration.token_stream, calibration.default_corpus_text()

    def token_stream(tokenizer, documents, **kwargs):
        documents = list(documents)
        if documents == [novel] and not kwargs.get("special_tokens"):
            tokens = novel_tokens(tokenizer)
            if tokens is not None:
                return tokens
        return real(tokenizer, documents, **kwargs)

    monkeypatch.setattr(calibration, "token_stream", token_stream)
    return tiny_tokenizer


@pytest.fixture(scope="session")
def sample_text() -> str:
    return _TEXT * 40


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder {SHARED_DATA} not present")
    return SHARED_DATA


@pytest.fixture
def one_thread():
    """Tiny models run far faster on one torch thread on a shared 2-core machine (no oversubscription)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny llama checkpoint with its tokenizer, saved once, for the CLI tests."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama").save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def lm_eval_once():
    """lm-eval's per-call costs that change no score, paid once a session rather than per row or per run.

    Each Jinja template of a task is compiled once (:func:`compiled_template_once`), and torch's environment report,
    which ``simple_evaluate`` adds to its results by running ``pip`` and other commands (2 s a call on 2 cores), is
    collected once: the same text, since the environment does not change within a session.
    """
    import functools

    from lm_eval import utils
    from torch.utils import collect_env

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(utils, "apply_template", compiled_template_once())
        patch.setattr(collect_env, "get_pretty_env_info", functools.cache(collect_env.get_pretty_env_info))
        yield
