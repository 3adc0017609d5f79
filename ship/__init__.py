"""From a model and a budget to the best checkpoint an engine serves, verified there (``python -m prune.ship``).

The top floor: it uses ``eval`` (the serving engines, their checks in processes of their own) and ``distill``
(the heal), which use ``prune``. One module per stage, each with a typed result kept in ``OUT.work/``
(:mod:`ship.work`), so a run stopped anywhere continues where it stopped:

1. **plan** (:mod:`ship.plan`): the budget as a block count, the memory and time the planner gives the run;
   what cannot fit the machine or ``--time-budget`` is refused before a weight is read.
2. **shortlist** (:mod:`ship.shortlist`): block sets x servable repairs, each measured on rows no fit saw.
3. **build** (:mod:`ship.build`): ``prune.run``'s checkpoint of the lowest KL.
4. **heal** (:mod:`ship.heal`): distillation towards the original, kept when it helps on unseen rows.
5. **export**: the GGUF of ``--gguf-type`` for llama.cpp.
6. **verify** (:mod:`ship.verify`): the file that ships, in its engine, against transformers; its speed.
7. **card** (:mod:`ship.card`): ``OUT/README.md``, rendered once from sections.

:class:`ship.shipper.Shipper` runs them in turn; :mod:`ship.cli` is the command.
"""

from ship.config import ShipConfig
from ship.shipper import Shipper

__all__ = ["ShipConfig", "Shipper"]
