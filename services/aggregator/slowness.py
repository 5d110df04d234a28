"""Which of one job's ranks are slow, every comparison weighed in one place: ranks that
sample the same steps by who the others wait on (`arrivals.py`); a pipeline's stages by
their work per layer against each other's (`stages.py`), with each stage's own usual pace
(`pace.py`) as corroboration; ranks that can be compared neither way by their own usual
alone.

Pure: pace histories, the layers each stage holds and the time in, a verdict out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rankscope.services.aggregator.arrivals import Straggle, judge_arrivals
from rankscope.services.aggregator.pace import PaceHistory, SlowVerdict, judge_pace, strays
from rankscope.services.aggregator.stages import judge_stages, vs_peers

if TYPE_CHECKING:
    from rankscope.services.aggregator.rules import Thresholds

__all__ = ["Ranks", "compared", "judge_slowness"]


@dataclass(frozen=True, slots=True)
class Ranks:
    """One job's ranks, in rank order: each one's pace history and node, and the layers
    each holds where they are a pipeline's stages (None: they are not)."""

    histories: Sequence[PaceHistory | None]
    nodes: Sequence[str]
    layers: Sequence[int] | None


def compared(
    ranks: Ranks, now: float, limits: Thresholds, named: frozenset[int] = frozenset()
) -> Straggle | None:
    """Who the ranks wait on, compared with each other: on the same steps where they
    sample the same steps (a recorded job), else per layer over the same span where they
    are a pipeline's stages; None when they cannot be compared."""
    histories, nodes, layers = ranks.histories, ranks.nodes, ranks.layers
    arrivals = [h.arrivals if h is not None else None for h in histories]
    found = judge_arrivals(arrivals, now, limits.arrivals, named, nodes)
    if found is not None or layers is None:
        return found
    window = limits.stages.window

    def wander(stage: int) -> float:
        history = histories[stage]
        return strays(history, now - window, window, limits.slow) if history else 0.0

    return judge_stages(histories, layers, now, limits.stages, named, wander)


def judge_slowness(
    ranks: Ranks, now: float, limits: Thresholds, named: frozenset[int] = frozenset()
) -> Straggle | SlowVerdict | None:
    """The slow ranks (`stragglers` or `slow`, empty: none is) and the comparison that
    found them; None when the ranks cannot be judged. A pipeline's stage is named by the
    stages compared (or held while named before); else by its own usual when the stages
    compared back it: its work per layer over their window and their glance at their
    holding bar, or over their glance at their naming bar while over the window it does
    more per layer than its peers (a stage its peers' stops leave waiting works unevenly
    for a glance too). So a stage slowed mid-run by less
    than healthy stages stray apart is named, while a stage's own pace wobbling with the
    machine's load, in line with its peers' per layer, is not."""
    histories, layers = ranks.histories, ranks.layers
    judged = compared(ranks, now, limits, named)
    if judged is not None and judged.layers is None:
        return judged
    if judged is None and layers is not None:
        return None  # a pipeline's own usual alone names no stage
    fresh = compared(ranks, now, limits) if named else judged
    if fresh is not None and fresh.stragglers:
        return fresh
    if judged is None or layers is None:
        return judge_pace(histories, now, limits.slow, named)
    kept = [h for h in histories if h is not None]
    stages = limits.stages
    ratios = vs_peers(kept, layers, now, stages.window, stages)
    glance = vs_peers(kept, layers, now, stages.glance, stages)  # a relapse, seen sooner
    backing = {
        i
        for i in range(len(kept))
        if min(ratios[i], glance[i]) >= stages.clear
        or (glance[i] >= stages.apart and ratios[i] > 1)  # and not the one waited on before
    }
    own = judge_pace(histories, now, limits.slow, named) if backing else None
    backed = [i for i in own.slow if i in backing] if own is not None else []
    if own is None or not backed:
        return judged
    shown = [max(pair) for pair in zip(ratios, glance, strict=True)]
    return dataclasses.replace(own, slow=backed, backed=shown)
