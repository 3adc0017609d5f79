import importlib.machinery
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import eval.speed.engines.vllm as vllm_engine
from eval.bench.cli import main
from eval.speed.engines import ENGINES, Engine, EngineModel, EngineSettings, get_engine
from eval.speed.engines.llamacpp import _DEFAULTS_TURNED, LlamaCppEngine
from eval.speed.engines.transformers import ENGINE as TRANSFORMERS
from eval.speed.engines.transformers import TransformersEngine
from eval.speed.engines.vllm import VllmEngine
from eval.speed.measure import SpeedOptions, benchmark_engine_speed, measure_engine_speed, memory_mode, noise_warnings
from eval.speed.timing import greedy_decode
from prune.checkpoint.load_config import LoadConfig
from prune.errors import LayercutError
from prune.measure.perplexity import Window, stream_nll
from prune.registry import Registry
from tests.helpers import make_tiny_model

SMALL = SpeedOptions(prompt_len=12, new_tokens=4, repeats=3, warmup=1)


# ---- the registry and the missing extras ----


def test_engines_are_a_registry():
    assert isinstance(ENGINES, Registry)
    names = ENGINES.names()  # the reference first, then by name; a new engine module joins without an edit here
    assert names[0] == "transformers" and {"llamacpp", "vllm"} <= set(names) and names[1:] == sorted(names[1:])
    with pytest.raises(LayercutError) as info:
        get_engine("tensorrt")
    message = str(info.value)
    assert message.startswith(f"unknown engine 'tensorrt' (--engine): choose one of {', '.join(names)}")
    assert "\n" not in message


def test_engines_are_registered_lazily_one_module_each():
    import pkgutil

    import eval.speed.engines as package
    from eval.speed.engines.base import EngineRegistry

    modules = {info.name for info in pkgutil.iter_modules(package.__path__)} - package.NOT_ENGINES
    assert set(ENGINES.names()) == modules  # a new engine is a new module: nothing else to list
    registry = EngineRegistry("engine", flag="--engine")
    registry.register("vllm", "eval.speed.engines.vllm:ENGINE")
    assert isinstance(registry._entries["vllm"], str)  # nothing imported until the engine is named
    assert registry.get("vllm") is vllm_engine.ENGINE and registry["vllm"] is vllm_engine.ENGINE
    registry.register("other", "eval.speed.engines.vllm:VllmEngine")  # a class is made once
    with pytest.raises(ValueError, match="calls itself 'vllm'"):
        registry.get("other")
    with pytest.raises(ValueError, match="module:object"):
        registry.register("bad", "eval.speed.engines.vllm")


def test_naming_an_engine_imports_its_package_only_when_it_loads():
    # a finder that records every look-up of an engine's package (installed or not)
    code = ("import sys\n"
            "asked = []\n"
            "class Spy:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('llama_cpp', 'vllm'): asked.append(name)\n"
            "sys.meta_path.insert(0, Spy())\n"
            "from eval.bench.cli import build_parser\n"
            "import eval.speed.engines as e\n"
            "build_parser()\n"
            "e.get_engine('vllm').describe(e.EngineSettings.build(gpu_memory=0.5))\n"
            "print(asked)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def _extras() -> dict[str, list[str]]:
    import tomllib

    pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"
    return tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]


@pytest.mark.parametrize("name", ENGINES.names())
def test_each_engine_declares_its_extra_layouts_and_settings(name):
    from prune.model.layouts import LAYOUTS, VANILLA, serving_entry

    engine = get_engine(name)
    assert engine.name == name and type(engine).__module__ == f"eval.speed.engines.{name}"
    assert engine.display and engine.summary
    if engine.extra is not None:  # the extra installs the package: pip install 'layercut[<extra>]'
        assert any(dep.startswith(engine.distribution) for dep in _extras()[engine.extra])
    assert VANILLA in engine.layouts and set(engine.layouts) <= set(LAYOUTS)
    for layout in LAYOUTS:
        assert engine.serves(serving_entry(layout)) == (layout in engine.layouts)
    for key, spec in engine.options.specs().items():
        assert spec.flag.startswith("--") and spec.help and key in engine.options.defaults()


def test_which_engines_serve_a_layout_is_the_registry_s_answer():
    from eval.speed.engines import engines_for, serves_label
    from prune.model.layouts import DECILM, LAYERCUT, VANILLA, serving_entry

    def shipped(names):  # the engines layercut ships with, in the registry's order (another module may add one)
        return [name for name in names if name in ("transformers", "llamacpp", "vllm", "llama.cpp", "vLLM")]

    assert shipped(engines_for(serving_entry(VANILLA))) == ["transformers", "llamacpp", "vllm"]
    assert shipped(serves_label(serving_entry(VANILLA)).split(", ")) == ["transformers", "llama.cpp", "vLLM"]
    decilm = serves_label(serving_entry(DECILM))
    assert decilm.endswith(" (DeciLM layout)")
    assert shipped(decilm.removesuffix(" (DeciLM layout)").split(", ")) == ["llama.cpp", "vLLM"]
    refused = serves_label({**serving_entry(DECILM), "why_not": {"llamacpp": "no deci"}})
    assert shipped(refused.removesuffix(" (DeciLM layout)").split(", ")) == ["vLLM"]
    assert serves_label(serving_entry(LAYERCUT)) == "no (maps)" and serves_label(None) == "-"


def test_a_registered_engine_appears_in_every_choice_and_label():
    """A new engine module is all it takes: registered, it is a choice of every command and named in the labels."""
    from eval.bench.cli import build_parser as bench_parser
    from eval.compare.cli import build_parser as compare_parser
    from eval.compare.leaderboard import serves
    from eval.speed.engines import engines_for
    from prune.model.layouts import DECILM, VANILLA, serving_entry
    from ship.config import ship_engines

    class ToyEngine(Engine):
        name, display, summary, module, distribution = "toy", "Toy-LLM", "a toy", "toy_llm", "toy-llm"
        layouts = (VANILLA, DECILM)

    ENGINES.register("toy", ToyEngine())
    try:
        assert "toy" in engines_for(serving_entry(VANILLA)) and "toy" in ship_engines()
        assert serves({"serving": serving_entry(DECILM)}) == "llama.cpp, vLLM, Toy-LLM (DeciLM layout)"
        engine_flag = next(a for a in compare_parser()._actions if "--engine" in a.option_strings)
        assert "toy" in engine_flag.choices and "toy (a toy)" in engine_flag.help
        commands = bench_parser()._subparsers._group_actions[0].choices  # eval.bench's
        assert "toy (a toy)" in " ".join(commands["speed"].format_help().split())
        assert "toy" in [word.strip(",.;:()") for word in commands["serving"].format_help().split()]
        assert ToyEngine().refusal({**serving_entry(DECILM), "why_not": {"toy": "too small"}}) == "too small"
    finally:
        ENGINES.unregister("toy")
    assert "toy" not in engines_for(serving_entry(VANILLA))


def test_a_serving_entry_says_why_an_engine_does_not_run_it():
    llamacpp, transformers = get_engine("llamacpp"), get_engine("transformers")
    entry = {"layout": "decilm", "why_not": {"llamacpp": "no deci for this one"}}
    assert llamacpp.refusal(entry) == "no deci for this one" and get_engine("vllm").refusal(entry) is None
    maps = {"layout": "layercut", "why": "maps are part of no vLLM or llama.cpp"}
    assert "vLLM or llama.cpp" in llamacpp.refusal(maps)
    assert transformers.refusal(maps) is None  # prune.load runs every layout
    assert not transformers.serves(maps), "as it ships, a checkpoint with maps needs layercut"


def test_each_engine_reads_its_own_settings_and_flags():
    from eval.bench.cli import build_parser
    from eval.speed.engines import setting_specs, setting_values

    llamacpp, vllm = get_engine("llamacpp"), get_engine("vllm")
    assert EngineSettings().of(llamacpp).gpu_layers == 0 and EngineSettings().of(vllm).gpu_memory == 0.85
    settings = EngineSettings.build(context=64, gpu_layers=3, eager=True)
    assert settings.of(llamacpp).values() == {"gpu_layers": 3, "converter": None, "gguf_type": "f32",
                                              "no_repack": False}
    assert settings.of(vllm).values() == {"gpu_memory": 0.85, "eager": True}
    assert llamacpp.describe(settings)["gpu_layers"] == 3 and vllm.describe(settings)["enforce_eager"] is True
    with pytest.raises(TypeError, match="no engine has the setting"):
        EngineSettings.build(n_gpu=1)
    specs = setting_specs()
    assert [spec.flag for spec in specs.values()] == ["--gpu-layers", "--converter", "--gguf-type", "--no-repack",
                                                       "--gpu-memory", "--eager"]
    with pytest.raises(LayercutError, match="--gguf-type is one of f32, f16"):
        EngineSettings.build(gguf_type="q5")
    for command in ("speed", "serving"):  # every engine's flags, in both subcommands that load engines
        usage = build_parser()._subparsers._group_actions[0].choices[command].format_help()
        assert all(spec.flag in usage for spec in specs.values())
    args = build_parser().parse_args(["speed", "--baseline", "a", "--model", "b", "--gpu-memory", "0.5", "--eager"])
    assert setting_values(args) == {"gpu_memory": 0.5, "eager": True}  # flags not given: each engine's default
    assert not hasattr(args, "gpu_layers")


def test_no_repack_loads_llamacpp_with_its_extra_buffer_types_off_for_that_load_alone(tmp_path, monkeypatch):
    """``Llama`` has no argument for ``use_extra_bufts``: the defaults it starts from are turned for the load alone."""
    import types

    seen = []

    class Params:
        _fields_ = [("n_gpu_layers", int), ("use_extra_bufts", bool)]  # as ctypes declares llama_model_params
        use_extra_bufts = True

    bindings = types.SimpleNamespace(llama_model_default_params=Params)

    class Llama:  # reads the defaults while it loads, as llama_cpp.Llama does
        def __init__(self, **kwargs):
            seen.append((bindings.llama_model_default_params().use_extra_bufts, kwargs["n_gpu_layers"]))

    module = types.SimpleNamespace(Llama=Llama, llama_cpp=bindings)
    engine = LlamaCppEngine()
    monkeypatch.setattr(engine, "import_module", lambda: module)
    for no_repack in (True, False):
        engine._open(tmp_path / "m.gguf", EngineSettings.build(no_repack=no_repack, gpu_layers=2), 16, False)
    assert seen == [(False, 2), (True, 2)]
    assert bindings.llama_model_default_params is Params  # given back after the load
    assert not _DEFAULTS_TURNED.locked()
    assert engine.describe(EngineSettings.build(no_repack=True))["no_repack"] is True
    assert "no_repack" not in engine.describe(EngineSettings())

    class Older:  # a llama.cpp before the setting: refused, not silently ignored
        _fields_ = [("n_gpu_layers", int)]

    bindings.llama_model_default_params = Older
    with pytest.raises(LayercutError, match=r"^llama.cpp's extra buffer types cannot be turned off \(--no-repack\)"):
        engine._open(tmp_path / "m.gguf", EngineSettings.build(no_repack=True), 16, False)


def test_a_folder_runs_in_llamacpp_as_its_export_of_the_type_asked_made_once(tiny_folder, tmp_path, monkeypatch):
    import prune.checkpoint.gguf as export
    from eval.speed.engines.llamacpp import gguf_export_path, gguf_file

    monkeypatch.setenv("LAYERCUT_CACHE", str(tmp_path / "cache"))
    written = []

    def fake_export(folder, out, outtype, converter):
        written.append(outtype)
        Path(out).write_bytes(outtype.encode())
        return Path(out)

    monkeypatch.setattr(export, "export_gguf", fake_export)
    quantized = gguf_file(str(tiny_folder), outtype="q4_k_m")
    assert quantized == gguf_export_path(tiny_folder, "q4_k_m") != gguf_export_path(tiny_folder)
    assert gguf_file(str(tiny_folder), outtype="q4_k_m") == quantized and written == ["q4_k_m"]  # once
    assert gguf_file(str(tiny_folder)).read_bytes() == b"f32" and written == ["q4_k_m", "f32"]
    given = tmp_path / "model.gguf"
    given.write_bytes(b"GGUF")
    assert gguf_file(str(given), outtype="q4_k_m") == given.resolve()  # a file runs as it is


@pytest.mark.parametrize(("name", "module", "line"), [
    ("llamacpp", "llama_cpp", "--engine llamacpp needs llama-cpp-python: pip install 'layercut[llamacpp]' (pip "
                              "compiles llama.cpp from source: 6-26 minutes on 2 CPU cores, once)"),
    ("vllm", "vllm", "--engine vllm needs vllm: pip install 'layercut[vllm]'"),
])  # fmt: skip
def test_a_missing_engine_is_one_line_naming_its_extra(monkeypatch, name, module, line):
    monkeypatch.setitem(sys.modules, module, None)  # import fails, as when the package is not installed
    engine = get_engine(name)
    assert not engine.available()
    with pytest.raises(LayercutError) as info:
        engine.check()
    assert str(info.value) == line
    with pytest.raises(LayercutError, match="needs"):
        engine.load("anything", EngineSettings())


def test_bench_speed_names_the_missing_extra(monkeypatch, tiny_folder, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    code = main(["speed", "--engine", "llamacpp", "--baseline", str(tiny_folder), "--model", str(tiny_folder)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("error: --engine llamacpp needs llama-cpp-python: pip install 'layercut[llamacpp]' (pip "
                          "compiles llama.cpp") and "\n" not in err


def test_bench_speed_unknown_engine_is_one_line(tiny_folder, capsys):
    assert main(["speed", "--engine", "tgi", "--baseline", str(tiny_folder), "--model", str(tiny_folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown engine 'tgi'") and "\n" not in err


def test_memory_is_measured_for_transformers_only():
    assert memory_mode("transformers", None) == "subprocess"
    assert memory_mode("transformers", "inprocess") == "inprocess"
    assert memory_mode("llamacpp", None) == memory_mode("vllm", "off") == "off"
    with pytest.raises(LayercutError, match="--memory subprocess measures transformers models only"):
        memory_mode("llamacpp", "subprocess")


def test_llamacpp_times_one_sequence():
    with pytest.raises(LayercutError, match="--batch-size 1"):
        LlamaCppEngine().check_batch(2)
    LlamaCppEngine().check_batch(1)


def test_engine_settings_are_validated():
    with pytest.raises(LayercutError, match="--threads"):
        EngineSettings(threads=0)
    with pytest.raises(LayercutError, match="--gpu-memory"):
        EngineSettings.build(gpu_memory=1.5)


# ---- the interleaved rounds, the ideal and the noise flags, with a fake engine ----


class FakeEngine(Engine):
    """Seconds proportional to the block count: the ratio to the ideal is known exactly."""

    name, module, distribution = "fake", "json", "fake-engine"

    def __init__(self, noisy: str | None = None):
        self.calls: list[tuple[str, str]] = []
        self.noisy = noisy  # this model's decodes alternate between 1x and 3x their time
        self.closed: list[str] = []

    def available(self) -> bool:
        return True

    def version(self) -> str:
        return "9.9"

    def load(self, path, settings=None):
        blocks = int(Path(path).name.removeprefix("blocks"))
        return EngineModel(model=path, source=str(path), blocks=blocks, params=1000 * blocks,
                           weights_bytes=4000 * blocks, checkpoint_bytes=None, vocab_size=64, max_positions=128,
                           device="fake", settings=settings or EngineSettings())  # fmt: skip

    def prefill_seconds(self, handle, prompt_ids):
        assert prompt_ids.shape == (1, SMALL.prompt_len)
        self.calls.append(("prefill", handle.source))
        return 0.01 * handle.blocks

    def decode_seconds(self, handle, prompt_ids, new_tokens):
        self.calls.append(("decode", handle.source))
        seconds = 0.02 * handle.blocks + 0.01 * new_tokens
        turn = sum(1 for kind, source in self.calls if kind == "decode" and source == handle.source)
        return seconds * (3 if handle.source == self.noisy and turn % 2 else 1)

    def close(self, handle):
        self.closed.append(handle.source)


def test_engine_speed_interleaves_and_uses_the_engines_block_count():
    engine = FakeEngine()
    handles = {name: engine.load(name) for name in ("blocks8", "blocks6", "blocks4")}
    result = measure_engine_speed(engine, handles, "blocks8", SMALL, progress=False)
    decodes = [source for kind, source in engine.calls if kind == "decode"]
    assert decodes == ["blocks8", "blocks6", "blocks4"] * 4  # one warm-up round, three timed, interleaved
    assert engine.calls[:2] == [("decode", "blocks8"), ("prefill", "blocks8")]  # decode first, as measure_speed
    assert [r.ideal for r in result.ratios] == [8 / 6, 8 / 4]
    assert result.ratios[1].prefill == pytest.approx(2.0)  # prefill time is all blocks: the ideal is reached
    assert result.ratios[1].decode == pytest.approx((0.16 + 0.04) / (0.08 + 0.04))
    assert result.baseline.prefill_tokens_per_s.median == pytest.approx(12 / 0.08)
    assert result.baseline.memory_method == "off: not measured for --engine fake"
    assert (result.engine, result.engine_version, result.device) == ("fake", "9.9", "fake")
    assert noise_warnings(result) == []
    assert json.loads(json.dumps(result.to_dict()))["engine"] == "fake"


def test_engine_speed_flags_noisy_decodes():
    engine = FakeEngine(noisy="blocks2")
    handles = {name: engine.load(name) for name in ("blocks4", "blocks2")}
    lines = noise_warnings(measure_engine_speed(engine, handles, "blocks4", SMALL, progress=False))
    assert any(line.startswith("blocks2 decode:") and "the figure is noise" in line for line in lines)
    assert any(line.startswith("blocks2 decode speed-up ranges") for line in lines)
    assert not any("prefill" in line or line.startswith("blocks4") for line in lines)


def test_engine_speed_refuses_a_context_past_the_models_positions():
    engine = FakeEngine()
    with pytest.raises(LayercutError, match="exceeds the 128 positions"):
        measure_engine_speed(engine, {"blocks2": engine.load("blocks2")}, "blocks2",
                             SpeedOptions(prompt_len=120, new_tokens=16), progress=False)  # fmt: skip


def test_benchmark_engine_speed_frees_every_model():
    engine = FakeEngine()
    result = benchmark_engine_speed(engine, "blocks4", ["blocks2", "blocks4"], EngineSettings(), SMALL, progress=False)
    assert [m.name for m in result.candidates] == ["blocks2", "blocks4#2"]
    assert sorted(engine.closed) == ["blocks2", "blocks4", "blocks4"]


@pytest.fixture
def fake_engine():
    engine = FakeEngine()
    ENGINES.register(engine.name, engine)
    yield engine
    ENGINES.unregister(engine.name)


def test_bench_speed_with_an_engine_end_to_end(fake_engine, tmp_path, capsys):
    argv = ["speed", "--engine", "fake", "--baseline", "blocks4", "--model", "blocks3", "--prompt-len", "12",
            "--new-tokens", "4", "--repeats", "3", "--threads", "1", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "engine: fake 9.9" in printed and "ideal L/(L-k) x1.333" in printed
    report = json.loads((tmp_path / "speed.json").read_text())
    assert (report["engine"], report["engine_version"]) == ("fake", "9.9")
    assert report["ratios"][0]["ideal"] == pytest.approx(4 / 3)
    assert report["baseline"]["peak_memory_bytes"] is None
    table = (tmp_path / "speed.md").read_text()
    assert "| off |" in table and "- engine `fake` 9.9 (" in table
    assert main(argv[:-2] + ["--memory", "subprocess"]) == 2
    assert "measures transformers models only" in capsys.readouterr().err


# ---- the transformers engine ----


def test_transformers_engine_nll_is_the_one_perplexity(tiny_folder, one_thread):
    engine = get_engine("transformers")
    assert engine is TRANSFORMERS and isinstance(engine, TransformersEngine)  # the registry's entry is the module's
    handle = engine.load(str(tiny_folder), EngineSettings(load=LoadConfig(dtype="float32")))
    ids = torch.randint(3, 320, (40,), generator=torch.Generator().manual_seed(0))
    total, count = engine.nll(handle, ids)
    assert count == 39
    assert total == pytest.approx(stream_nll(handle.model, ids, [Window(0, 40, 1)], 1), rel=1e-12)
    assert engine.block_count(handle) == 4 and handle.vocab_size == 320
    result = measure_engine_speed(engine, {"a": handle}, "a", SpeedOptions(prompt_len=8, new_tokens=2, repeats=1),
                                  progress=False)  # fmt: skip
    assert result.baseline.num_blocks == 4 and result.baseline.decode_s[0] > 0
    prompt = ids[:6].reshape(1, -1)
    expected = greedy_decode(handle.model, prompt, 3)[0][0].tolist()
    assert engine.greedy(handle, prompt, 3) == expected and len(expected) == 3  # the new tokens only


# ---- vLLM's calls, against a stand-in module (vLLM itself needs a GPU and is not installed here) ----


class _Logprob:
    def __init__(self, logprob):
        self.logprob = logprob


class _FakeLLM:
    instances: list = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.requests = []
        text_config = types.SimpleNamespace(num_hidden_layers=4, vocab_size=320)
        self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(hf_text_config=text_config))
        _FakeLLM.instances.append(self)

    def generate(self, prompts, params, use_tqdm=True):
        self.requests.append((prompts, params))
        outputs = []
        for prompt in prompts:
            ids = prompt["prompt_token_ids"]
            # position i: -0.5 * i for its own token, a better-ranked other token beside it
            logprobs = [None] + [{tok: _Logprob(-0.5 * i), tok + 1: _Logprob(-0.1)} for i, tok in enumerate(ids) if i]
            outputs.append(types.SimpleNamespace(prompt_logprobs=logprobs if params.prompt_logprobs else None))
        return outputs


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    module.__version__ = "0.0-test"
    module.LLM = _FakeLLM
    module.SamplingParams = lambda **kwargs: types.SimpleNamespace(**{"prompt_logprobs": None, **kwargs})
    monkeypatch.setitem(sys.modules, "vllm", module)
    _FakeLLM.instances.clear()
    return module


def test_vllm_engine_calls(fake_vllm, tiny_folder, monkeypatch):
    engine = VllmEngine()
    settings = EngineSettings.build(context=64, gpu_memory=0.8, sharing=2)
    handle = engine.load(str(tiny_folder), settings)
    (llm,) = _FakeLLM.instances
    assert llm.kwargs["enable_prefix_caching"] is False and llm.kwargs["dtype"] == "float32"
    assert llm.kwargs["gpu_memory_utilization"] == pytest.approx(0.4) and llm.kwargs["max_model_len"] == 65
    assert engine.block_count(handle) == 4 and engine.version() == "0.0-test"
    assert handle.params == sum(p.numel() for p in make_tiny_model("llama").parameters())
    total, count = engine.nll(handle, [5, 6, 7, 8])
    assert (total, count) == (pytest.approx(0.5 + 1.0 + 1.5), 3)
    prompt = torch.tensor([[5, 6, 7], [8, 9, 10]])  # two concurrent requests
    clock = iter([0.0, 1.0, 1.0, 3.5])  # max_tokens=1 takes 1 s, max_tokens=5 takes 2.5 s
    monkeypatch.setattr(vllm_engine.time, "perf_counter", lambda: next(clock))
    assert engine.decode_seconds(handle, prompt, 4) == pytest.approx(1.5)
    prompts, params = llm.requests[-1]
    assert prompts == [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9, 10]}]
    assert (params.max_tokens, params.temperature, params.ignore_eos) == (5, 0.0, True)
    assert engine.nll(handle, list(range(64)))[1] == 63  # a whole context's window
    with pytest.raises(LayercutError, match="shorter windows"):
        engine.nll(handle, list(range(65)))
    capped = engine.load(str(tiny_folder), EngineSettings(context=256))  # the tiny model has 256 positions
    assert _FakeLLM.instances[-1].kwargs["max_model_len"] == 256 and capped.context == 256


def test_vllm_refuses_a_checkpoint_with_maps(fake_vllm, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "layercut"}))
    with pytest.raises(LayercutError, match="cannot run .* layercut's own modules"):
        VllmEngine().load(str(tmp_path), EngineSettings())


# ---- llama.cpp on a tiny GGUF (slow: a conversion and a real engine) ----


def _tiny_checkpoint(folder: Path, blocks: int, tokenizer) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=blocks,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def llamacpp_setup(tmp_path, monkeypatch):
    """Converter and a real tokenizer (llama.cpp's converter knows SmolLM2's, not a tiny trained one)."""
    if not LlamaCppEngine().available():
        pytest.skip("llama-cpp-python is not installed (pip install 'layercut[llamacpp]')")
    export = pytest.importorskip("prune.checkpoint.gguf", reason="prune.checkpoint.gguf is not there")
    try:
        converter = export.find_converter()
    except LayercutError as err:
        pytest.skip(str(err))
    from prune.loading.gguf import embedded_model_dir
    from prune.loading.loader import load_tokenizer

    try:
        tokenizer = load_tokenizer(str(embedded_model_dir()))
    except LayercutError as err:
        pytest.skip(str(err))
    monkeypatch.setenv("LAYERCUT_CACHE", str(tmp_path / "cache"))  # the GGUF exports go there
    return converter, {blocks: _tiny_checkpoint(tmp_path / f"blocks{blocks}", blocks, tokenizer) for blocks in (4, 2)}


@pytest.mark.slow
def test_llamacpp_nll_matches_transformers(llamacpp_setup, one_thread):
    converter, folders = llamacpp_setup
    settings = EngineSettings.build(load=LoadConfig(dtype="float32"), threads=1, context=256, converter=str(converter))
    llamacpp, transformers = get_engine("llamacpp"), get_engine("transformers")
    handle = llamacpp.load(str(folders[4]), settings)
    try:
        assert Path(handle.source).suffix == ".gguf" and llamacpp.block_count(handle) == 4
        ids = torch.randint(16, handle.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
        total, count = llamacpp.nll(handle, ids)
        reference, reference_count = transformers.nll(transformers.load(str(folders[4]), settings), ids)
        assert count == reference_count == 199
        assert total == pytest.approx(reference, rel=1e-3)
        assert llamacpp.decode_seconds(handle, ids[None, :16], 4) > 0
    finally:
        llamacpp.close(handle)


@pytest.mark.slow
def test_bench_speed_llamacpp_end_to_end(llamacpp_setup, tmp_path, capsys):
    converter, folders = llamacpp_setup
    argv = ["speed", "--engine", "llamacpp", "--baseline", str(folders[4]), "--model", str(folders[2]),
            "--prompt-len", "16", "--new-tokens", "4", "--repeats", "2", "--threads", "1",
            "--converter", str(converter), "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 0
    assert "ideal L/(L-k) x2.000" in capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "speed.json").read_text())
    assert report["engine"] == "llamacpp" and report["engine_version"]
    assert (report["baseline"]["num_blocks"], report["candidates"][0]["num_blocks"]) == (4, 2)
    assert report["engine_settings"]["threads"] == 1
    assert report["baseline"]["checkpoint_bytes"] > report["candidates"][0]["checkpoint_bytes"] > 0
    assert "| off |" in (tmp_path / "out" / "speed.md").read_text()
