"""Tokenizer checks that read no weights: the files that make a saved tokenizer, and the pad token batching needs."""

import pytest

from prune.errors import LayercutError
from prune.loading.tokenizer import check_tokenizer, has_tokenizer_files, set_pad_token
from tests.helpers import byte_fallback_tokenizer


def test_a_tokenizer_without_pad_pads_with_its_eos_and_one_with_none_of_the_four_is_refused():
    tokenizer = byte_fallback_tokenizer()  # <unk>, <s>, </s>; no pad token
    assert tokenizer.pad_token is None
    set_pad_token(tokenizer)
    assert tokenizer.pad_token == "</s>" and tokenizer.pad_token_id == tokenizer.eos_token_id
    tokenizer.pad_token = "<unk>"
    set_pad_token(tokenizer)  # a pad token already set is kept
    assert tokenizer.pad_token == "<unk>"
    bare = byte_fallback_tokenizer()
    bare.unk_token = bare.bos_token = bare.eos_token = None
    with pytest.raises(LayercutError, match="no pad, eos, unk or bos token") as err:
        set_pad_token(bare)
    assert "\n" not in str(err.value)


def test_a_model_folder_without_tokenizer_files_is_refused_unless_a_tokenizer_is_named(tmp_path, tiny_tokenizer):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert not has_tokenizer_files(folder)
    with pytest.raises(LayercutError, match="has no tokenizer files.*--tokenizer NAME") as err:
        check_tokenizer(str(folder))
    assert "\n" not in str(err.value)
    check_tokenizer(str(folder), tokenizer="some/tokenizer")  # named: nothing to check here
    check_tokenizer("HuggingFaceTB/SmolLM2-135M")  # not a folder: the hub decides
    tiny_tokenizer.save_pretrained(folder)
    assert has_tokenizer_files(folder)
    check_tokenizer(str(folder))
