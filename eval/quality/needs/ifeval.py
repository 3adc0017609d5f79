"""What lm-eval's IFEval checks need, checked before anything imports them.

    from eval.quality.needs.ifeval import check_ifeval_ready
    check_ifeval_ready()   # a one-line LayercutError naming the fix, or nothing

lm-eval scores IFEval with ``lm_eval.tasks.ifeval``, which imports ``langdetect``, ``immutabledict`` and
``nltk`` (3.9.1 or newer), and on import calls ``nltk.download("punkt_tab")`` when NLTK's sentence splitter data
is missing: with no network that fails (or hangs) deep inside a run, after the model is loaded. So a task whose
YAML says ``needs: [ifeval]`` has :func:`check_ifeval_ready` run by the run planner
(:func:`eval.quality.lmeval.plan_tasks`) first, and nothing here imports lm-eval's IFEval code.
"""

from __future__ import annotations

import importlib.util
from importlib import metadata

from packaging.version import Version

from eval.quality.needs import TASK_NEEDS
from prune.errors import LayercutError

IFEVAL_PACKAGES = ("langdetect", "immutabledict", "nltk")  # the modules lm-eval's checks import
NLTK_MIN = "3.9.1"  # lm-eval refuses older nltk: downloading punkt with it could run remote code
PUNKT_TAB = "tokenizers/punkt_tab"

_INSTALL = 'pip install "layercut[ifeval]"'
_PUNKT_FIX = ("run `python -m nltk.downloader punkt_tab` once online, or point NLTK_DATA at a folder holding "
              f"{PUNKT_TAB} (eval/tasks/README.md, IFEval, says where to get it offline)")


def check_ifeval_ready() -> None:
    """Check the packages and NLTK data that lm-eval's IFEval scoring imports, without importing it.

    Raises:
        LayercutError: a package is missing, nltk is older than 3.9.1, or NLTK's ``punkt_tab`` is not found
            (one line naming the fix).
    """
    missing = [name for name in IFEVAL_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise LayercutError(f"ifeval needs {', '.join(missing)} (lm-eval's IFEval checks import them); {_INSTALL}")
    found = metadata.version("nltk")
    if Version(found) < Version(NLTK_MIN):
        raise LayercutError(f"ifeval needs nltk>={NLTK_MIN}, found {found} (lm-eval refuses "
                            f"older ones); {_INSTALL}")
    import nltk.data  # nltk itself downloads nothing on import; lm-eval's IFEval module does

    try:
        nltk.data.find(PUNKT_TAB)
    except LookupError:
        raise LayercutError(f"ifeval needs NLTK's punkt_tab sentence splitter, not found in NLTK's data path "
                            f"(lm-eval would try to download it); {_PUNKT_FIX}") from None


# a task whose YAML says ``needs: [ifeval]`` (its scoring imports lm_eval.tasks.ifeval) is checked by this first
TASK_NEEDS.register("ifeval", check_ifeval_ready)
