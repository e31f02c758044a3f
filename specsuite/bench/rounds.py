"""The order of methods in each round of a benchmark."""


def rotated(items: list, by: int) -> list:
    """`items` rotated left by `by`: the order of the methods in round (or prompt) `by`, so that
    each method runs first, second, ... alike and a machine's drift falls on all of them."""
    by %= len(items)
    return items[by:] + items[:by]
