"""Peak memory of one prefill + decode: weights and RSS growth in this process, or a fresh child's peak."""

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from eval.speed.peak_memory import peak_memory_inprocess, peak_memory_subprocess, weights_bytes
from eval.speed.timing import SpeedOptions
from tests.helpers import VOCAB, make_tiny_model

SMALL = SpeedOptions(prompt_len=12, new_tokens=4, repeats=3, warmup=1)


def test_weights_bytes_counts_tied_weights_once():
    model = make_tiny_model("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight  # tied: one tensor under two names
    every = sum(p.numel() * p.element_size() for _, p in model.named_parameters(remove_duplicate=False))
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert weights_bytes(model) == every - model.lm_head.weight.numel() * 4 + buffers


def test_peak_memory_inprocess_counts_weights():
    model = make_tiny_model("llama")
    peak, method = peak_memory_inprocess(model, SMALL)
    assert peak >= weights_bytes(model)
    assert method.startswith("cpu")


def test_peak_memory_subprocess_grows_with_the_model(tmp_path, tiny_tokenizer):
    from concurrent.futures import ThreadPoolExecutor

    weights = {}
    for blocks in (1, 12):
        torch.manual_seed(0)
        config = AutoConfig.for_model(
            "llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=1024, num_hidden_layers=blocks,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        )  # fmt: skip
        model = AutoModelForCausalLM.from_config(config)
        model.save_pretrained(tmp_path / str(blocks))
        tiny_tokenizer.save_pretrained(tmp_path / str(blocks))
        weights[blocks] = weights_bytes(model)
    # the two children side by side: each measures its own peak, and most of each one's time is Python's start
    with ThreadPoolExecutor(2) as pool:
        runs = {blocks: pool.submit(peak_memory_subprocess, str(tmp_path / str(blocks)), SMALL) for blocks in weights}
        measured = {blocks: run.result() for blocks, run in runs.items()}
    sizes = {}
    for blocks, (peak, method) in measured.items():
        sizes[blocks] = (peak, weights[blocks])
        assert "fresh process" in method
    # 11 more blocks of ~0.8 MiB each: the peak grows by at least their weights, and not by hundreds of MiB
    extra_weights = sizes[12][1] - sizes[1][1]
    assert 0.8 * extra_weights <= sizes[12][0] - sizes[1][0] < extra_weights + 200 * 1024**2
    assert sizes[12][0] >= sizes[12][1]
