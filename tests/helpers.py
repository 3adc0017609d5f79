"""Test helpers: tiny random models of every supported architecture, a tiny tokenizer, data paths."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast

from prune.model.adapters import cache_keyword
from prune.model.tiny import TINY_BLOCKS, TINY_VOCAB, build_tiny

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
VOCAB = TINY_VOCAB  # 320
HIDDEN = 32
BLOCKS = TINY_BLOCKS  # 4

_SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

# The supported architectures the tests build tiny: prune.model.tiny shrinks each one's own default config, here
# narrower than its default (width 32, MLP 64, heads of 8), under whatever names the config gives those sizes.
TINY_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "opt", "gpt2", "gpt_neox")
TINY_SIZES = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "embed_dim", "n_embed", "dim", "word_embed_proj_dim"), HIDDEN),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "d_ff"), 64),
    "head_dim": 8,
}
_OVERRIDES = {"gemma2": {"sliding_window": 16}}  # a window shorter than the tests' sequences, so it is exercised


# llama.cpp's converter (prune.export_gguf): .ci/run unpacks it from the llama-cpp-python sdist and names it here
_converter = os.environ.get("LLAMA_CPP_CONVERTER")
CONVERTER = Path(_converter) if _converter and Path(_converter).is_file() else None
NO_CONVERTER = "llama.cpp's convert_hf_to_gguf.py: set LLAMA_CPP_CONVERTER (.ci/run does)"


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-2 style tokenizer (byte-fallback BPE) of VOCAB tokens: one llama.cpp's converter reads for Llama."""
    import string

    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    for char in ["\u2581", *string.ascii_letters, *"01234567"]:
        vocab[char] = len(vocab)
    assert len(vocab) == VOCAB
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def make_tiny_model(model_type: str, seed: int = 0, **overrides):
    """A random ``*ForCausalLM`` of ``model_type`` with BLOCKS blocks of width HIDDEN, in eval mode.

    ``overrides`` go to the config as they are (``hidden_size=48``). ``id2label=None``: prune.model.tiny passes the
    default config's ``id2label`` (keys 0, 1) on as if it were a per-layer entry, and transformers then leaves
    ``label2id`` unset; None gives both their defaults, as in a config made from scratch.
    """
    return build_tiny(model_type, seed=seed, sizes=TINY_SIZES,
                      **{**_SPECIAL, "id2label": None, **_OVERRIDES.get(model_type, {}), **overrides})


_TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be "
    "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
    "surrounding families, that he is considered the rightful property of some one or other of "
    "their daughters. "
)


def make_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with at most VOCAB tokens, trained in code (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator([_TEXT] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def run_prune_cli(capsys, *args, default_repair: bool = False) -> tuple[int, str, str]:
    """``python -m prune.run ARGS`` in process: (exit code, stdout, stderr).

    Without ``--replace`` or ``--recipe`` the run removes only (``--replace none``), as the tests written for
    removal expect; ``default_repair=True`` leaves the command's own default (``auto``).
    """
    from prune.run import main

    argv = [str(a) for a in args]
    if not default_repair and not {"--replace", "--recipe"} & set(argv):
        argv += ["--replace", "none"]
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def assert_cache_and_generate(model, ids: torch.Tensor) -> None:
    """Incremental decoding through the KV cache reproduces the full forward pass, and generate() runs."""
    with torch.no_grad():
        full = model(ids).logits
        prefix = model(ids[:, :8], use_cache=True)
        cache = cache_keyword(model)
        step = model(ids[:, 8:], **{cache: getattr(prefix, cache)}, use_cache=True).logits
    torch.testing.assert_close(step, full[:, 8:], rtol=1e-4, atol=1e-4)
    out = model.generate(ids[:, :4], max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape == (ids.shape[0], 9)


def make_student_pair(root: Path) -> dict[str, Path]:
    """teacher/ (tiny llama, tokenizer), student/ (blocks 1 and 2 removed, plain export), data.txt under ``root``."""
    import copy

    from prune.checkpoint.write import export_checkpoint
    from prune.model.surgery import drop_blocks_

    teacher, tokenizer = make_tiny_model("llama"), make_tiny_tokenizer()
    teacher.save_pretrained(root / "teacher")
    tokenizer.save_pretrained(root / "teacher")
    student = copy.deepcopy(teacher)
    drop_blocks_(student, [1, 2])
    report = {"source_model": str(root / "teacher"), "model_name": str(root / "teacher"), "num_blocks_before": 4,
              "num_blocks_after": 2, "dropped": [1, 2]}
    export_checkpoint(student, tokenizer, root / "student", report)
    (root / "data.txt").write_text(_TEXT * 20, encoding="utf-8")
    return {"teacher": root / "teacher", "student": root / "student", "data": root / "data.txt"}


def compiled_template_once():
    """lm-eval's ``apply_template`` with each Jinja template compiled once rather than once per row.

    lm-eval compiles a task's ``doc_to_text`` / ``doc_to_target`` / ``doc_to_choice`` template again for every row
    it renders (``Environment.from_string`` keeps no cache): over the real files' thousands of rows that is most of a
    test's time. The compiled template is the same object for the same text, so every row renders as before.
    """
    import functools

    from lm_eval import utils

    compile_template = functools.lru_cache(maxsize=256)(utils.env.from_string)

    def apply_template(template: str, doc: dict) -> str:
        return compile_template(template).render(**doc)

    return apply_template


_NOVEL_TOKENS: dict[tuple, torch.Tensor] = {}


def novel_tokens(tokenizer) -> torch.Tensor | None:
    """The shipped novel (``--data builtin``) as ``tokenizer``'s token stream, tokenised once a session per tokenizer.

    The stream is what ``prune.data.windows.token_stream`` makes of the novel alone without special tokens (680 kB:
    a second or more on 2 cores each time); it is kept per tokenizer class, vocabulary and rules (the Rust
    tokenizer's whole serialisation) and EOS id, which is all that stream depends on. None for a tokenizer without a
    Rust backend.
    """
    from prune.data.calibration import default_corpus_text
    from prune.data.windows import token_stream

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    key = (type(tokenizer).__qualname__, backend.to_str(), tokenizer.eos_token_id)
    if key not in _NOVEL_TOKENS:
        _NOVEL_TOKENS[key] = token_stream(tokenizer, [default_corpus_text()])
    return _NOVEL_TOKENS[key].clone()


_PIQA_ROWS = (  # goal, the two solutions, the right one
    ("To keep bread fresh for longer,", "wrap it and keep it in a cool dry place.", "leave it open in the sun.", 0),
    ("To dry wet shoes quickly,", "put them in the freezer overnight.", "stuff them with newspaper.", 1),
    ("To open a stuck jar lid,", "run the lid under hot water.", "paint the lid a new colour.", 0),
    ("To light a dark room,", "close every curtain.", "switch on a lamp.", 1),
)


def write_piqa(folder: Path) -> Path:
    """A data folder laid out like ``shared/data`` holding four PIQA rows (``piqa/valid.jsonl`` and its labels)."""
    import json

    (folder / "piqa").mkdir(parents=True, exist_ok=True)
    (folder / "piqa" / "valid.jsonl").write_text("".join(
        json.dumps({"goal": goal, "sol1": one, "sol2": two}) + "\n" for goal, one, two, _ in _PIQA_ROWS))
    (folder / "piqa" / "valid-labels.lst").write_text("".join(f"{label}\n" for *_, label in _PIQA_ROWS))
    return folder
