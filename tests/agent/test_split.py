"""Every architecture split across 2 and 3 ranks generates what one process generates,
with every decode step timed apart (the pace) on every rank.

Each rank is a real process on a real mlx ring (loopback), loading its shard through the
runner's own code (`connect_group`, `load_shard`); the reference is plain `mlx_lm` in one
process. Greedy decoding; the chosen tokens must be equal and every logprob within 1e-5.
"""

from __future__ import annotations

import multiprocessing
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from mlx.nn.layers.base import Module

from rankscope.services.agent.runner.generation import barrier
from rankscope.services.agent.runner.pace import Pace
from rankscope.services.agent.runner.pipeline import split_layers
from rankscope.services.agent.runner.shard import connect_group, load_shard, ring_hosts
from rankscope.shared.tiny_model import ARCHITECTURES, TinyModelSpec, write_tiny_model
from rankscope.shared.wire import RunnerAssignment
from tests.stack_up import free_port

pytestmark = pytest.mark.mlx

LAYERS = 6
SPLITS = {"2 ranks": (3, 3), "3 ranks, uneven": (1, 4, 1)}
PROMPTS = [
    "hello",
    "Which node holds layer seven? How much memory does it hold?",
    # longer than one prefill chunk and than gemma3's sliding window
    " ".join(["the whole cluster hangs when a rank stops making progress"] * 6),
]
MAX_TOKENS = 8
PREFILL_CHUNK = 16

Run = list[tuple[list[int], list[list[float]]]]
"""Per prompt: the tokens and, per token, the logprobs over the whole vocabulary."""


def _generate(model: Any, tokenizer: Any) -> Run:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    runs: Run = []
    for prompt in PROMPTS:
        tokens: list[int] = []
        logprobs: list[list[float]] = []
        for token, probs in generate_step(
            mx.array(tokenizer.encode(prompt)),
            model,
            max_tokens=MAX_TOKENS,
            prompt_cache=make_prompt_cache(model),
            prefill_step_size=PREFILL_CHUNK,
        ):
            tokens.append(int(token))
            logprobs.append(cast(list[float], probs.tolist()))
        runs.append((tokens, logprobs))
    return runs


def _rank(
    assignments: list[RunnerAssignment],
    rank: int,
    models: multiprocessing.Queue[str | None],
    out: multiprocessing.Queue[Any],
) -> None:
    """One rank of a ring: connects once, then loads, runs and answers for each model it
    is sent until it is sent None."""
    me = assignments[rank]
    try:
        group = connect_group(me, ring_hosts(assignments))
        while (path := models.get()) is not None:
            pace = Pace(every=1, gap=0)  # every step timed: what it does to results shows
            shard = load_shard(Path(path), group, assignments, me, pace)
            run = _generate(shard.model, shard.tokenizer)
            barrier(group)  # after the step generate_step starts ahead, still in flight
            out.put((rank, shard.parameter_bytes, (run, pace.take())))
    except Exception as exc:  # the test shows it rather than waiting for a silent rank
        out.put((rank, -1, f"{type(exc).__name__}: {exc}"))
        models.get()  # no rank closes its sockets while a peer may still be reading them


def _assignments(split: tuple[int, ...]) -> list[RunnerAssignment]:
    starts = [sum(split[:i]) for i in range(len(split))]
    return [
        RunnerAssignment(
            runnerId=f"r{rank}",
            nodeId="node",
            deviceRank=rank,
            worldSize=len(split),
            startLayer=start,
            endLayer=start + size,
            nLayers=size,
            host="127.0.0.1",
            port=free_port(),
        )
        for rank, (start, size) in enumerate(zip(starts, split, strict=True))
    ]


class _Ring:
    """The ranks of `split`, each a process on one real mlx ring (loopback), connected
    once and kept for every architecture: a process per rank and model would import mlx-lm
    fourteen times per split."""

    def __init__(self, split: tuple[int, ...]) -> None:
        context = multiprocessing.get_context("spawn")
        self._out: multiprocessing.Queue[Any] = context.Queue()
        self._models: list[multiprocessing.Queue[str | None]] = [context.Queue() for _ in split]
        assignments = _assignments(split)
        self._ranks = [
            context.Process(target=_rank, args=(assignments, r, models, self._out), daemon=True)
            for r, models in enumerate(self._models)
        ]
        for process in self._ranks:
            process.start()

    def run(self, path: Path) -> list[tuple[int, Any]]:
        """Each rank's weight in bytes (-1: it failed) and its run (or its error) of the
        model at `path`; raises `queue.Empty` when a rank does not answer."""
        for models in self._models:
            models.put(str(path))
        results = sorted(self._out.get(timeout=120) for _ in self._ranks)
        return [(weights, run) for _, weights, run in results]

    def close(self) -> None:
        for models in self._models:
            models.put(None)
        for process in self._ranks:
            process.join(10)
            if process.is_alive():
                process.kill()


@pytest.fixture(scope="module")
def rings() -> Iterator[dict[tuple[int, ...], _Ring]]:
    """The ring of each split, made when a test first asks for it."""
    made: dict[tuple[int, ...], _Ring] = {}
    yield made
    for ring in made.values():
        ring.close()


def _run_split(
    rings: dict[tuple[int, ...], _Ring], path: Path, split: tuple[int, ...]
) -> list[tuple[int, Any]]:
    ring = rings.get(split) or rings.setdefault(split, _Ring(split))
    try:
        ranks = ring.run(path)
    except queue.Empty:
        rings.pop(split).close()
        pytest.fail(f"a rank of {split} did not answer")
    if any(weights < 0 for weights, _ in ranks):  # its peers may be left in a collective
        rings.pop(split).close()
    return ranks


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch = str(request.param)
    return write_tiny_model(
        tmp_path_factory.mktemp(arch), TinyModelSpec(layers=LAYERS, hidden=64, arch=arch)
    )


@pytest.mark.parametrize("split", list(SPLITS.values()), ids=list(SPLITS))
def test_split_generates_what_one_process_generates(
    rings: dict[tuple[int, ...], _Ring], model: Path, split: tuple[int, ...]
) -> None:
    import mlx_lm
    from mlx.utils import tree_flatten

    reference, tokenizer = mlx_lm.load(str(model))[:2]
    expected = _generate(reference, tokenizer)
    whole = sum(a.nbytes for _, a in cast(list[Any], tree_flatten(reference.parameters())))
    ranks = _run_split(rings, model, split)
    for rank, (weights, answer) in enumerate(ranks):
        assert 0 < weights < whole, f"rank {rank} holds {weights} of {whole} bytes: {answer}"
        run, pace = answer
        decoded = sum(len(tokens) - 1 for tokens, _ in expected)
        assert pace.steps >= decoded, f"rank {rank} timed {pace.steps} of {decoded} steps"
        assert pace.workSeconds > 0, pace
        assert pace.waitSeconds > 0, pace
        assert pace.waitCpuSeconds, pace  # its waits spin: the CPU time in them is said
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(run, expected, strict=True):
            assert tokens == want_tokens, f"rank {rank}"
            worst = max(
                abs(a - b)
                for got, want in zip(logprobs, want_logprobs, strict=True)
                for a, b in zip(got, want, strict=True)
            )
            assert worst <= 1e-5, f"rank {rank}: logprobs differ by {worst}"


class _Multimodal(Module):
    """A language model inside a wrapper, as multimodal mlx-lm models hold theirs."""

    def __init__(self, language_model: Any) -> None:
        super().__init__()
        self.language_model = language_model

    @property
    def layers(self) -> list[Any]:
        return cast(list[Any], self.language_model.layers)


class _Ranks:
    """Rank 1 of 2, for a split that is built here and never run."""

    def rank(self) -> int:
        return 1

    def size(self) -> int:
        return 2


def test_the_split_finds_a_layer_list_held_deep_inside(tmp_path: Path) -> None:
    import mlx_lm
    from mlx.utils import tree_flatten

    path = write_tiny_model(tmp_path / "m", TinyModelSpec(layers=4, hidden=32, arch="llama"))
    language = mlx_lm.load(str(path))[0]
    wrapped = _Multimodal(language)
    split_layers(wrapped, _Ranks(), 2, 4)
    held = [type(block).__name__ for block in language.model.layers]
    assert held == ["_Stage"] * 4
    sizes = [
        sum(a.size for _, a in cast(list[Any], tree_flatten(b.parameters())))
        for b in language.model.layers
    ]
    assert sizes[0] == sizes[1] == 0 < sizes[2] == sizes[3]  # shells of rank 0's, weightless
    with pytest.raises(ValueError, match="no layer list"):
        split_layers(Module(), _Ranks(), 0, 1)
