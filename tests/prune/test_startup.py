"""``import prune.run`` and ``python -m prune.run --help`` stay light: heavy libraries are imported where used.

transformers' model code (``modeling_utils``, ``models.*.modeling_*``), lm-eval, matplotlib, datasets, ...
cost seconds at start-up; ``prune.model.remote_code`` defines its transformers classes on first access.
Checked on the modules a fresh interpreter holds, not on timings.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# imported in a fresh interpreter: the modules after `import prune.run`, then after `--help` too
SCRIPT = textwrap.dedent("""
    import contextlib, io, json, sys
    import prune.run
    after_import = sorted(sys.modules)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        prune.run.main(["--help"])
    print(json.dumps({"import": after_import, "help": sorted(sys.modules)}))
""")

HEAVY = ("transformers", "lm_eval", "matplotlib", "datasets", "accelerate", "peft", "safetensors", "gguf", "scipy")


def test_import_prune_run_loads_no_model_code():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=True)
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    for when, modules in loaded.items():
        assert "transformers.models.llama.modeling_llama" not in modules, when
        model_code = [m for m in modules if m == "transformers.modeling_utils" or ".modeling_" in m]
        assert not model_code, f"{when}: {model_code[:5]}"
        heavy = sorted({m.split(".")[0] for m in modules} & set(HEAVY))
        assert not heavy, f"{when} imports {heavy}: import them inside the functions that use them"


# A room's package holds its docstring only (prune.replace alone imports its methods, so that they register):
# importing one is free, whatever its modules need.
ROOMS_SCRIPT = textwrap.dedent("""
    import json, sys
    import prune.checkpoint
    import prune.data
    import prune.loading
    import prune.measure
    import prune.model
    import prune.pipeline
    import prune.planner
    import prune.selection
    print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("prune", "torch"))))
""")


def test_the_rooms_packages_import_nothing():
    done = subprocess.run([sys.executable, "-c", ROOMS_SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=True)
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    rooms = ["prune." + room for room in ("checkpoint", "data", "loading", "measure", "model", "pipeline", "planner",
                                          "selection")]
    assert loaded == sorted(["prune", "prune.errors", *rooms]), "a room's __init__ imports a module"
