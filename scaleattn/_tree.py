"""The fixed-order tree reduction (DESIGN §6): partials combined ``split_every`` neighbours at a time, level by
level, always in the same order, so floating-point sums do not depend on which worker finished first, on the
worker count, retries or resumes. Base-level (no scaleattn imports) so that in-process code below
:mod:`scaleattn.distributed` (the streaming operator of :mod:`scaleattn.linalg._stream`) sums its partials in the
very tree :func:`scaleattn.distributed.reduction.submit_tree` builds on a cluster: the same bits either way.
"""
from __future__ import annotations

__all__ = ["SPLIT_EVERY", "TreeReducer", "tree_reduce"]


#: partials combined per reduction task: a binary tree, so an in-process build holds about log2(groups)
#: partials at once (its peak memory hardly grows with the number of rows)
SPLIT_EVERY = 2


class TreeReducer:
    """Streaming tree reduction: :meth:`add` items in order, :meth:`result` combines them ``split_every``
    neighbours at a time, level by level, exactly as :func:`tree_reduce` would, while holding only
    ``O(split_every * log n)`` items (a fit's memory does not grow with the number of row groups)."""

    def __init__(self, combine, split_every: int = SPLIT_EVERY):
        self.combine, self.split_every = combine, max(2, int(split_every))
        self.levels: list[list] = []  # levels[k]: items at depth k not yet in a full group
        self.count = 0

    def add(self, item) -> None:
        self.count += 1
        k = 0
        while True:
            if len(self.levels) == k:
                self.levels.append([])
            self.levels[k].append(item)
            if len(self.levels[k]) < self.split_every:
                return
            item, self.levels[k] = self.combine(*self.levels[k]), []
            k += 1

    def result(self):
        if not self.count:
            raise ValueError("nothing to reduce")
        carry = None
        for k, pending in enumerate(self.levels):  # each level's last, partial group; a lone item passes up
            items = pending + ([carry] if carry is not None else [])
            if not items:
                continue
            if len(items) == 1 and not any(self.levels[k + 1:]):
                return items[0]
            carry = self.combine(*items) if len(items) > 1 else items[0]
        return carry


def tree_reduce(parts, combine, split_every: int = SPLIT_EVERY):
    """Reduce ``parts`` by combining ``split_every`` neighbours at a time, level by level, in a fixed order
    (so floating-point results do not depend on which worker finished first). Raises ``ValueError`` when
    ``parts`` is empty."""
    red = TreeReducer(combine, split_every)
    for p in parts:
        red.add(p)
    return red.result()
