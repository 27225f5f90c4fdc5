"""Stage 4b, lowering: a schedule run as one SPMD program (``jax.shard_map`` inside ``jax.jit``).

Takes a program, a schedule and a ``jax.sharding.Mesh``; gives a :class:`Lowered` (:mod:`.spmd`):
a function of the program's inputs that runs every op on its tiles, moves operands between
layouts with ``redist`` or XLA's partitioner, whichever is predicted cheaper
(:mod:`.xla_moves`), combines partial results with collectives, and runs pipelined scans as GPipe
(:mod:`.gpipe`).

Example:
    >>> low = lower(prog, sched, mesh)                               # doctest: +SKIP
    >>> outs = low(*arrays)
"""

from planner.lowering.spmd import Lowered, lower

__all__ = ["Lowered", "lower"]
