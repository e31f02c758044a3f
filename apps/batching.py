"""Many items (texts, questions) decoded together in one `BatchEngine` run, their results in input order.

The engine yields generations in finishing order; an item may need several requests (a GEC text:
one per segment) or none. This is the one place that puts the results back in input order, for
`Corrector.correct_each` and `RagQA.answer_each` (and through them the batch jobs).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from specsuite.core.scheduler.engine import BatchEngine, Request
from specsuite.core.scheduler.sequence import Generation

Item, State, Result = TypeVar("Item"), TypeVar("State"), TypeVar("Result")


def decode_in_order(engine: BatchEngine, items: Iterable[Item],
                    plan: Callable[[Item], tuple[State, list[Request]]],
                    finish: Callable[[State, list[Generation]], Result],
                    longest_first: int = 0) -> Iterator[Result | Exception]:
    """For each item of `items` (read lazily), in order: `finish(state, generations)` of its
    `plan(item)` = (state, requests), or the exception that planning, a request or finishing raised
    (the other items go on). longest_first: start the request with the longest prompt of the next
    `longest_first` (0: each as it comes), so that a job ends on short ones, not on a few long ones decoding
    alone in a near-empty batch."""
    # item number -> [state, generations, requests left, first error]
    pending: dict[int, list[Any]] = {}
    owner: list[tuple[int, int]] = []  # request number -> (item number, request number within it)
    next_out = 0

    def requests() -> Iterator[Request]:
        waiting: list[tuple[int, int, int, Request]] = []  # a heap: (-prompt length, item, part, request)

        def start() -> Request:
            _, i, j, request = heapq.heappop(waiting)
            owner.append((i, j))
            return request

        for i, item in enumerate(items):
            try:
                state, parts = plan(item)
            except Exception as e:  # noqa: BLE001 - reported in its place
                pending[i] = [None, [], 0, e]
                continue
            pending[i] = [state, [None] * len(parts), len(parts), None]
            for j, request in enumerate(parts):
                heapq.heappush(waiting, (-len(request.prompt), i, j, request))
                if len(waiting) >= longest_first:
                    yield start()
        while waiting:
            yield start()

    def ready() -> Iterator[Result | Exception]:
        nonlocal next_out
        while next_out in pending and pending[next_out][2] == 0:
            state, generations, _, outcome = pending.pop(next_out)  # outcome: the first error, if any
            next_out += 1
            if outcome is None:
                try:
                    outcome = finish(state, generations)
                except Exception as e:  # noqa: BLE001
                    outcome = e
            yield outcome

    for index, result in engine.run(requests()):
        i, j = owner[index]
        entry = pending[i]
        if isinstance(result, Exception):
            entry[3] = entry[3] or result
        else:
            entry[1][j] = result
        entry[2] -= 1
        yield from ready()
    yield from ready()
