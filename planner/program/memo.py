"""Values a stage computes once per program (or per plan), held in an explicit cache the stage
owns, while the object they were computed for lives.

Programs are large frozen values: hashing one by value on every lookup would cost more than most
of what is cached, so a :class:`PerObject` cache keys by identity and forgets an entry when its
object is collected. Each cache is a module-level name in the stage that fills it (the simulator's
per-op prices, the cost model's kernels, the memory model's lifetimes, ...), so what is cached, and
by whom, is in one place.

Example:
    >>> from planner.program.memo import PerObject
    >>> class Box: ...
    >>> box, sizes = Box(), PerObject("sizes of boxes")
    >>> sizes.get(box, lambda: 3), sizes.get(box, lambda: 4)
    (3, 3)
    >>> del box; len(sizes)
    0
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class PerObject(Generic[T]):
    """A cache of one value per object (a program, a plan), by identity, dropped with the
    object; ``what`` says what it holds (for ``repr``).

    Example:
        >>> kernels = PerObject("kernels per backend")          # doctest: +SKIP
        >>> kernels.get(prog, dict).setdefault("cpu", fusion_of(prog))   # doctest: +SKIP
    """

    def __init__(self, what: str):
        self.what = what
        self._held: dict[int, T] = {}

    def get(self, obj: object, make: Callable[[], T]) -> T:
        """The value held for ``obj``, made by ``make()`` the first time."""
        key = id(obj)
        if key not in self._held:
            self.put(obj, make())
        return self._held[key]

    def put(self, obj: object, value: T) -> None:
        """Hold ``value`` for ``obj`` (a window of a program sharing the program's prices)."""
        key = id(obj)
        if key not in self._held:
            weakref.finalize(obj, self._held.pop, key, None)
        self._held[key] = value

    def __len__(self) -> int:
        return len(self._held)

    def __repr__(self) -> str:
        return f"PerObject({self.what!r}, {len(self)} held)"
