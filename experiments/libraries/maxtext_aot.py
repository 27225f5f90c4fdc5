"""MaxText's own training step at full size, built from shapes as its ahead-of-time compile
(``maxtext/trainers/pre_train/train_compile.py``) builds it, for a TPU topology.

:func:`build` runs ``train_compile``'s own functions: ``get_topology_mesh`` (the topology's
compile-only devices, MaxText's 12-axis mesh from the config's ``ici_*`` / ``dcn_*``
parallelism), ``get_shaped_inputs`` (the train state and batch as ``jax.ShapeDtypeStruct``s
with MaxText's shardings), ``maybe_update_params_sharding_with_opt`` and
``get_functional_train_with_signature``. :meth:`AotStep.authors_compile` is ``train_compile``'s
``jit_and_compile``: MaxText's recipe compiled as MaxText compiles it. Like ``train_compile.
main``, PRNG keys use ``unsafe_rbg`` and libtpu gets ``--xla_tpu_spmd_rng_bit_generator_unsafe``.

Needs Python >= 3.12 with :data:`experiments.libraries.maxtext_step.REQUIREMENTS` and libtpu.

Example:
    >>> built = build("llama2-7b", "v5p-128", per_device_batch_size=4)  # doctest: +SKIP
    >>> with built.context():  # doctest: +SKIP
    ...     plan = planner.plan(built.step, *built.args, mesh=built.mesh, donate_argnums=(0,))
    >>> compiled = built.authors_compile()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from experiments.libraries.maxtext_step import QUIET

#: ``base.yml`` overrides every build takes (synthetic data, nothing written).
DEFAULTS = dict(QUIET, dataset_type="synthetic", compile_topology_num_slices=1)


@dataclasses.dataclass(frozen=True)
class AotStep:
    """MaxText's train step built from shapes for a topology: ``step(state, batch)``, ``args``
    (``jax.ShapeDtypeStruct``s with MaxText's shardings), the topology ``mesh``, MaxText's
    ``in_shardings`` / ``out_shardings`` / ``donate_argnums``, the ``context`` it traces under
    (``jax.set_mesh`` and the logical axis rules) and ``config`` (MaxText's pyconfig)."""

    step: Callable
    args: tuple
    mesh: Any
    in_shardings: Any
    out_shardings: Any
    donate_argnums: tuple[int, ...]
    context: Callable[[], contextlib.AbstractContextManager]
    config: Any

    def authors_compile(self) -> Any:
        """MaxText's ``train_compile.jit_and_compile`` of its own layout: the compiled step."""
        from flax.core.spmd import logical_axis_rules
        from maxtext.trainers.pre_train import train_compile

        return train_compile.jit_and_compile(
            self.step, self.args, {}, self.mesh, self.in_shardings, self.out_shardings, (),
            self.donate_argnums, self.config, logical_axis_rules(self.config.logical_axis_rules),
        )  # fmt: skip


_LIBTPU_FLAGS: list[tuple[str, ...]] = []  # the flags libtpu was given in this process


def libtpu_flags(flags: tuple[str, ...]) -> None:
    """Give libtpu ``flags`` (``LIBTPU_INIT_ARGS``, which it reads once per process, so that
    every compile of it, MaxText's and the plan's, runs with them): a recipe's flags that change
    what compiles (MaxText's ``--xla_tpu_scoped_vmem_limit_kib`` for its MoE recipes, without
    which the splash kernel runs out of scoped VMEM). Raises ``ValueError`` where this process
    gave libtpu other flags already."""
    if _LIBTPU_FLAGS and _LIBTPU_FLAGS[0] != tuple(flags):
        raise ValueError(
            f"libtpu reads its flags once per process: this one has {_LIBTPU_FLAGS[0]}, the "
            f"recipe needs {tuple(flags)}; run it in a process of its own (--config.recipes=...)"
        )
    if not _LIBTPU_FLAGS:
        _LIBTPU_FLAGS.append(tuple(flags))
        given = os.environ.get("LIBTPU_INIT_ARGS", "")
        os.environ["LIBTPU_INIT_ARGS"] = " ".join([given, *flags]).strip()


def _prng_as_train_compile() -> None:
    """``train_compile.main``'s PRNG settings: ``unsafe_rbg`` keys, partitionable by libtpu."""
    import jax

    jax.config.update("jax_default_prng_impl", "unsafe_rbg")
    # no TPU attached: libtpu only compiles here, and need not hold the host-wide lock that keeps
    # two processes off one TPU (as planner.topology_mesh does)
    if not glob.glob("/dev/accel*") and not os.path.isdir("/dev/vfio"):
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    flag = "--xla_tpu_spmd_rng_bit_generator_unsafe=true"
    if flag not in os.environ.get("LIBTPU_INIT_ARGS", ""):
        os.environ["LIBTPU_INIT_ARGS"] = (
            os.environ.get("LIBTPU_INIT_ARGS", "") + " " + flag
        ).strip()


def build(model_name: str, topology: str, flags: tuple[str, ...] = (), **overrides: Any) -> AotStep:
    """MaxText's step for ``model_name`` (a file of ``configs/models/``) compiled for
    ``topology`` (MaxText's name: ``"v5p-128"``, ``"v6e-256"``), with ``overrides`` of
    ``base.yml`` (``per_device_batch_size``, ``remat_policy``, ``ici_fsdp_parallelism``, ...)
    and libtpu's ``flags`` (:func:`libtpu_flags`).

    Example:
        >>> built = build("llama2-7b", "v5p-128", remat_policy="minimal")  # doctest: +SKIP
        >>> dict(built.mesh.shape)["fsdp"]  # doctest: +SKIP
        64
    """
    from experiments.libraries.maxtext_step import _import_maxtext

    train = _import_maxtext()
    libtpu_flags(flags)
    _prng_as_train_compile()
    import jax
    from flax.core.spmd import logical_axis_rules
    from maxtext.configs import pyconfig
    from maxtext.trainers.pre_train import train_compile
    from maxtext.utils import maxtext_utils, sharding

    base = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    with tempfile.TemporaryDirectory(prefix="maxtext_aot_") as out:  # left empty
        config = pyconfig.initialize(["", base], **{**DEFAULTS, "model_name": model_name,
                                                   "compile_topology": topology,
                                                   "base_output_directory": out,
                                                   **overrides})  # fmt: skip
    mesh = train_compile.get_topology_mesh(config)
    args, _, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, config)
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(
        config, state_shardings
    )
    state_in = sharding.build_zero1_input_state_mesh_shardings(
        config, state_shardings, params_shardings
    )
    data_sharding = sharding.get_input_data_sharding(config, mesh)
    step, in_shardings, out_shardings, _, donate = (
        maxtext_utils.get_functional_train_with_signature(
            train.train_step, data_sharding, state_in, model, config, params_shardings
        )
    )

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
            yield

    donate = (donate,) if isinstance(donate, int) else tuple(donate)
    return AotStep(step, tuple(args), mesh, in_shardings, out_shardings, donate, context, config)
