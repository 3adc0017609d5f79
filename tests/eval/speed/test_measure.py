import json
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

import eval.speed.measure as speed
from eval.bench.cli import SUBCOMMANDS, main
from eval.speed.measure import SpeedOptions, Spread, checkpoint_bytes, greedy_decode, measure_speed, weights_bytes
from prune.checkpoint.save_load import load
from prune.errors import LayercutError
from prune.replace import parameter_count

os.environ.setdefault("HF_HUB_OFFLINE", "1")
VOCAB = 128


def tiny_llama(blocks: int, seed: int = 0):
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=blocks,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config).eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 20], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def save(tmp_path, name: str, blocks: int, with_tokenizer: bool = True):
    folder = tmp_path / name
    tiny_llama(blocks).save_pretrained(folder)
    if with_tokenizer:
        tiny_tokenizer().save_pretrained(folder)
    return folder


SMALL = SpeedOptions(prompt_len=12, new_tokens=4, repeats=3, warmup=1)


def test_options_are_validated():
    with pytest.raises(LayercutError, match="repeats"):
        SpeedOptions(repeats=0)
    with pytest.raises(LayercutError, match="warmup"):
        SpeedOptions(warmup=-1)


def test_greedy_decode_with_cache_matches_generate():
    model = tiny_llama(2)
    prompt = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))  # [batch, prompt]
    tokens, seconds = greedy_decode(model, prompt, 6)
    expected = model.generate(prompt, do_sample=False, max_new_tokens=6, min_new_tokens=6, pad_token_id=0)
    assert torch.equal(tokens, expected[:, 10:])
    assert seconds > 0


def test_measure_speed_interleaves_and_computes_ratios(monkeypatch):
    models = {"base": tiny_llama(4), "cut": tiny_llama(2)}
    label = {id(m): name for name, m in models.items()}
    calls = []

    def fake_prefill(model, prompt):
        calls.append(label[id(model)])
        return 2.0 if label[id(model)] == "base" else 1.0

    def fake_decode(model, prompt, new_tokens):
        return 4.0 if label[id(model)] == "base" else 2.5

    monkeypatch.setattr(speed, "time_prefill", fake_prefill)
    monkeypatch.setattr(speed, "time_decode", fake_decode)
    result = measure_speed(models, "base", SMALL, progress=False)
    assert calls == ["base", "cut"] * 4  # one warm-up round then three timed rounds, interleaved
    assert result.baseline.prefill_tokens_per_s.median == pytest.approx(12 / 2.0)
    assert result.candidates[0].decode_tokens_per_s.median == pytest.approx(4 / 2.5)
    ratio = result.ratios[0]
    assert (ratio.ideal, ratio.prefill, ratio.decode) == (2.0, 2.0, 1.6)
    assert ratio.decode_paired == Spread(1.6, 1.6, 1.6, 1.6, 1.6)
    assert ratio.params == pytest.approx(parameter_count(models["cut"]) / parameter_count(models["base"]))
    assert len(result.baseline.prefill_s) == 3


def test_measure_speed_real_timings():
    result = measure_speed({"a": tiny_llama(4), "b": tiny_llama(2)}, "a", SMALL, progress=False)
    for model in (result.baseline, *result.candidates):
        assert len(model.decode_s) == 3 and all(s > 0 for s in model.decode_s)
        assert model.prefill_tokens_per_s.min <= model.prefill_tokens_per_s.median <= model.prefill_tokens_per_s.max
    assert (result.baseline.num_blocks, result.candidates[0].num_blocks) == (4, 2)
    assert json.loads(json.dumps(result.to_dict()))["ratios"][0]["ideal"] == 2.0


def test_context_too_long_is_an_error():
    with pytest.raises(LayercutError, match="positions"):
        measure_speed({"a": tiny_llama(1)}, "a", SpeedOptions(prompt_len=120, new_tokens=16), progress=False)


def test_sizes(tmp_path):
    model = tiny_llama(2)
    model.save_pretrained(tmp_path)
    on_disk = sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    assert checkpoint_bytes(tmp_path) == on_disk > 0
    assert checkpoint_bytes(tmp_path / "missing") is None
    assert weights_bytes(model) >= 4 * parameter_count(model)


def test_folder_without_tokenizer(tmp_path):
    bare = save(tmp_path, "bare", 2, with_tokenizer=False)
    with pytest.raises(LayercutError, match="has no tokenizer files") as info:
        load(str(bare))
    assert "\n" not in str(info.value)
    tok_folder = tmp_path / "tok"
    tiny_tokenizer().save_pretrained(tok_folder)
    loaded = load(str(bare), tokenizer=str(tok_folder))
    assert loaded.source == str(bare.resolve())
    assert loaded.tokenizer("the fox")["input_ids"] == tiny_tokenizer()("the fox")["input_ids"]
    assert parameter_count(loaded.model) == parameter_count(tiny_llama(2))


def test_bench_speed_cli(tmp_path, capsys):
    base, cut = save(tmp_path, "base", 4), save(tmp_path, "cut", 2)
    argv = ["speed", "--baseline", str(base), "--model", str(cut), "--prompt-len", "8", "--new-tokens", "3",
            "--repeats", "2", "--memory", "inprocess", "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "ideal L/(L-k) x2.000" in printed
    report = json.loads((tmp_path / "out" / "speed.json").read_text())
    assert report["ratios"][0]["ideal"] == 2.0
    assert report["baseline"]["peak_memory_bytes"] > report["baseline"]["weights_bytes"] > 0
    assert report["baseline"]["checkpoint_bytes"] > report["candidates"][0]["checkpoint_bytes"] > 0
    assert "| decode x |" in (tmp_path / "out" / "speed.md").read_text()


def test_bench_same_model_twice_gets_distinct_labels(tmp_path, capsys):
    base = save(tmp_path, "base", 2)
    argv = ["speed", "--baseline", str(base), "--model", str(base), "--prompt-len", "8", "--new-tokens", "2",
            "--repeats", "1", "--memory", "off"]  # fmt: skip
    assert main(argv) == 0
    assert f"{base}#2: prefill x" in capsys.readouterr().out


def test_bench_bad_input_is_one_line(tmp_path, capsys):
    bare = save(tmp_path, "bare", 2, with_tokenizer=False)
    capsys.readouterr()  # drop the output of saving
    assert main(["speed", "--baseline", str(bare), "--model", str(bare)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "has no tokenizer files" in err and "\n" not in err


def test_bench_has_a_subcommand_registry():
    assert "speed" in SUBCOMMANDS
    assert callable(SUBCOMMANDS["speed"].add_arguments) and callable(SUBCOMMANDS["speed"].run)
