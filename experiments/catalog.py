"""Every folder of ``results/``: the commands that make it, what they need and how long they take.

``python -m experiments.results`` regenerates the folders that run on a CPU host from here and
writes each folder's ``command.txt``; ``tests/experiments/test_catalog.py`` checks that every
folder is listed and that its commands reproduce the ``config.json`` it stores.

>>> FOLDERS["random_heldout"].commands()[0].split()[3:5]
['--config=configs/random_benchmark/default.py', '--config.seed=1']
"""

from __future__ import annotations

import dataclasses
import enum


class Needs(enum.StrEnum):
    """What regenerating a folder takes beyond this project's ``test`` extra on a CPU host."""

    HOST = "this host (8 CPU devices; the TPU compiler and XLA:GPU of the test extra)"
    TPU_HOURS = "the TPU compiler (libtpu, on this host) for an hour or more"
    LIBRARIES = "Python >= 3.12 with the libraries extra (MaxText, keras-hub, gemma)"


@dataclasses.dataclass(frozen=True)
class Run:
    """One command: ``python -m experiments.<runner> [--config=configs/<config>.py] --flag=value...
    --workdir=results/<folder>[/<sub>]``."""

    runner: str
    config: str = ""
    flags: tuple[tuple[str, str], ...] = ()
    sub: str = ""

    def command(self, folder: str, root: str = "results") -> str:
        args = [f"python -m experiments.{self.runner}"]
        if self.config:
            args.append(f"--config=configs/{self.config}.py")
        args += [f"--{k}={v}" for k, v in self.flags]
        workdir = "/".join(p for p in (root, folder, self.sub) if p)
        return " ".join([*args, f"--workdir={workdir}"])

    def overrides(self) -> dict[str, str]:
        """The ``--config.<field>`` flags, by field."""
        return {k.removeprefix("config."): v for k, v in self.flags if k.startswith("config.")}


@dataclasses.dataclass(frozen=True)
class Folder:
    """A folder of ``results/``, the runs that make it (in order), what they need, and the
    minutes they took on this project's 2-core host."""

    name: str
    runs: tuple[Run, ...]
    needs: Needs
    minutes: float
    note: str = ""

    def commands(self, root: str = "results") -> list[str]:
        return [r.command(self.name, root) for r in self.runs]

    def command_text(self) -> str:
        """The folder's ``command.txt``."""
        lines = [f"# {self.name}: needs {self.needs.value}; about {self.minutes:g} min on 2 cores"]
        lines += [f"# {self.note}"] if self.note else []
        return "\n".join([*lines, *self.commands()]) + "\n"


def _rb(config: str = "random_benchmark/default", **flags: object) -> tuple[Run]:
    return (
        Run("random_benchmark", config, tuple((f"config.{k}", str(v)) for k, v in flags.items())),
    )


_FOLDERS = [
    Folder("random_benchmark", _rb(cost_model="calibrated"), Needs.HOST, 1.5,
           "made when the default cost model was 'calibrated'; on CPU devices 'auto' is the same"),
    Folder("random_heldout", _rb(seed=1, min_mb=2.0, max_mb=16.0, figures=False), Needs.HOST, 1),
    Folder("random_uneven", _rb("random_benchmark/uneven"), Needs.HOST, 1.5),
    Folder("topology_paper", _rb("random_benchmark/topology"), Needs.HOST, 0.5),
    Folder("topology_random", _rb(num_problems=20, figures=False, topology="v5p:2x2x2"),
           Needs.HOST, 1),
    Folder("topology_uneven", _rb("random_benchmark/uneven", num_problems=20,
                                  topology="v5p:2x2x2"), Needs.HOST, 2),
    Folder("topology_gpu_paper", _rb("random_benchmark/topology", topology="gpu:h100_sxm"),
           Needs.HOST, 0.5),
    Folder("topology_gpu_random", _rb(num_problems=20, figures=False, topology="gpu:h100_sxm"),
           Needs.HOST, 0.5),
    Folder("weight_sync", (Run("weight_sync", "weight_sync/default"),), Needs.HOST, 0.5),
    Folder("weight_sync_frontier", (
        Run("weight_sync", "weight_sync/frontier_small", sub="qwen3_235b"),
        Run("weight_sync", "weight_sync/frontier_small", (("config.model", "deepseek_v3"),),
            sub="deepseek_v3")), Needs.HOST, 0.5,
        "Qwen3-235B's and DeepSeek-V3's trees shrunk to 8 CPU devices, timed"),
    Folder("weight_sync_tunix", (
        Run("weight_sync", "weight_sync/tunix", sub="qwen3"),
        Run("weight_sync", "weight_sync/tunix", (("config.experts", "8"),), sub="qwen3_moe"),
        Run("weight_sync", "weight_sync/tunix", (("config.disjoint", "True"),
            ("config.train_mesh", "fsdp:4,tp:1"), ("config.serve_mesh", "fsdp:1,tp:4")),
            sub="qwen3_disjoint")), Needs.HOST, 8,
        "tunix's own Qwen3 (google-tunix 0.1.7), its trainer's mesh to its sampler's"),
    Folder("weight_sync_disaggregated", (
        Run("weight_sync_disaggregated", "weight_sync/disaggregated", sub="qwen3_235b"),
        Run("weight_sync_disaggregated", "weight_sync/disaggregated",
            (("config.model", "deepseek_v3"),), sub="deepseek_v3")), Needs.HOST, 0.5,
        "trainer and server in two processes of 4 CPU devices each"),
    Folder("frontier_sync", (Run("frontier_sync", "weight_sync/frontier"),), Needs.HOST, 1.5,
           "compiled for v5p-1024 by the TPU compiler on this host; nothing runs"),
    Folder("frontier_sync_h100", (
        Run("frontier_sync", "weight_sync/frontier",
            (("config.cases", "qwen3_235b@h100x8,deepseek_v3@h100x8"),)),), Needs.HOST, 0.5,
        "compiled for 8 H100s by XLA:GPU on this host, one program per bucket; nothing runs"),
    Folder("frontier_sync_tunix", (
        Run("frontier_sync", "weight_sync/frontier", (("config.layouts", "tunix"),)),),
        Needs.HOST, 5, "tunix's layouts (MaxText RL's trainer, its vLLM sampler) compiled for "
        "v5p-1024 by the TPU compiler on this host; nothing runs"),
    Folder("frontier_sync_tunix_h100", (
        Run("frontier_sync", "weight_sync/frontier", (("config.layouts", "tunix"),
            ("config.cases", "qwen3_235b@h100x8,deepseek_v3@h100x8"))),), Needs.HOST, 0.5,
        "tunix's layouts compiled for 8 H100s by XLA:GPU on this host; nothing runs"),
    Folder("synthesis_scaling", (Run("synthesis_scaling", "synthesis_scaling/default"),),
           Needs.HOST, 0.5),
    Folder("planner_search_scaling", (
        Run("search_scaling", flags=(("workloads", "transformer:64x128x16x64"), ("depths", "2"),
            ("meshes", '"a:2,b:2,c:2;a:4,b:4,c:4;data:16,fsdp:4,tensor:4;data:32,fsdp:16,tensor:8"'),
            ("methods", "dp")), sub="mesh_size"),
        Run("search_scaling", flags=(("workloads", "transformer:4x64x8x16"), ("depths", "24"),
            ("meshes", "a:2,b:2,c:2"), ("methods", "dp")), sub="depth_24"),
        Run("search_scaling", flags=(("workloads", "lm_scan:256x512x1024x16x32768"),
            ("depths", "2"), ("meshes", '"data:16,fsdp:4,tensor:4;data:32,fsdp:16,tensor:8"'),
            ("methods", "dp"), ("calibration", "tpu_v5p")), sub="lm_pod"),
    ), Needs.HOST, 1),
    Folder("lowering", (Run("lowering_benchmark", "lowering_benchmark/default"),), Needs.HOST, 3),
    Folder("planner_spatial", (Run("planner_benchmark", "planner_benchmark/spatial"),),
           Needs.HOST, 1.5),
    Folder("planner_uneven", (Run("planner_benchmark", "planner_benchmark/uneven"),),
           Needs.HOST, 11),
    Folder("pipeline_search", (Run("pipeline_search", "pipeline_search/default"),), Needs.HOST, 1.5),
    Folder("pipeline_search_multislice", (Run("pipeline_search", "pipeline_search/multislice"),),
           Needs.HOST, 3.5),
    Folder("transformations", (Run("transformations", "transformations/default"),), Needs.HOST, 2.5),
    Folder("gpu_check", (Run("gpu_check", "gpu_check/default"),), Needs.HOST, 3,
           "compiles for H100s with JAX's CUDA plugin and compares with figures recorded on one "
           "H100 80GB HBM3; --config.recorded=False measures on a GPU"),
    Folder("memory_check", (Run("memory_check", "memory_check/default",
                                (("config.tpu", "True"),)),), Needs.HOST, 4.5),
    Folder("memory_check_gpu", (Run("memory_check", "memory_check/default",
                                    (("config.cpu", "False"), ("config.gpu", "True"))),),
           Needs.HOST, 5),
    Folder("pod_plans", (Run("pod_plans", "pod_plans/default"),), Needs.TPU_HOURS, 115,
           "its rows record 6,187 s of compiling and 588 s of searching"),
    Folder("time_check", (Run("time_check", "time_check/default"),), Needs.TPU_HOURS, 100,
           "its rows record 5,911 s of compiling"),
    Folder("recipes", (
        Run("recipes", "recipes/default"),
        Run("recipes", "recipes/default", (("config.recipes", "llama3_1_8b_v6e_256"),
                                           ("config.strategies", '""'),
                                           ("config.depths", "1,2,8,32"))),
        Run("recipes", "recipes/maxtext_code"),
        Run("recipes", "recipes/maxtext_code", (("config.recipes", "deepseek3_671b_v5p_1024"),
                                                ("config.layer_estimate", "False"))),
        Run("recipes", "recipes/maxtext_code", (("config.recipes", "llama3_1_405b_v5p_1024"),)),
        Run("recipes", "recipes/maxtext_code", (("config.recipes", "qwen3_235b_v5p_512"),)),
        Run("recipes", "recipes/maxtext_code", (("config.recipes", "llama3_1_405b_v6e_256"),)),
        Run("recipes", "recipes/maxtext_code", (("config.recipes", "qwen3_235b_tpu7x_256"),)),
        Run("recipes", "recipes/maxtext_code", (("config.recipes", "llama3_1_405b_v6e_256"),
                                                ("config.strategies", '""'),
                                                ("config.replay_search", "True"))),
        Run("recipes", "recipes/maxtext_code", (("config.recipes", "deepseek3_671b_v5p_1024"),
                                                ("config.strategies", "searched"),
                                                ("config.remeasure", "searched"))),
        Run("recipes", "recipes/maxtext_code", (("config.recipes", "deepseek3_671b_v5p_1024"),
                                                ("config.strategies", '""'),
                                                ("config.reestimate", "recipe,searched"))),
        Run("recipes", "recipes/maxtext_code", (("config.recipes", "deepseek3_671b_v5p_1024"),
                                                ("config.strategies", "searched,searched_variants"),
                                                ("config.remeasure", "searched,searched_variants"))),
        Run("recipes", "recipes/maxtext_code", (("config.recipes", "deepseek3_671b_v5p_1024"),
                                                ("config.strategies", "recipe"),
                                                ("config.remeasure", "recipe"))),
        Run("recipes", "recipes/maxtext_code", (("config.recipes", "deepseek3_671b_v5p_1024"),
                                                ("config.strategies", "searched_variants"),
                                                ("config.remeasure", "searched_variants"))),
        Run("recipes", "recipes/maxtext_code", (("config.recipes", "qwen3_235b_v5p_512"),
                                                ("config.strategies", "on_its_own"))),
        Run("recipes", "recipes/maxtext_code", (("config.recipes", "llama2_70b_v5p_512"),
                                                ("config.strategies", "on_its_own"))),
        Run("recipes", "recipes/maxtext_code", (("config.recipes", "llama3_1_405b_v6e_256"),
                                                ("config.strategies", "on_its_own"))),
    ), Needs.TPU_HOURS, 160, "the committed rows came from several runs of subsets of these "
       "recipes and strategies (config.json lists them); they record 4,155 s of compiling and "
       "231 s of searching; the commands from the third on (MaxText's own step, "
       "code_*.{jsonl,md,json}, one process per recipe's libtpu flags; DeepSeek-V3's took 55 "
       "min, Llama 3.1 405B's plan 57 min, Qwen3-235B's 29 min and its variants 7 more, 405B's "
       "plan on v6e 80 min, Qwen3-235B's on Ironwood 56 min, each beside other compiles) need "
       "Python >= 3.12 with the libraries extra too; the one with replay_search, run for each "
       "recipe in turn, replays the searched rows' searches on the current planner without "
       "compiling (a few minutes each; a row's plan its memory model now predicts otherwise "
       "takes today's prediction, the measured one kept beside it); the one with remeasure=searched, run for each recipe in "
       "turn (Qwen3-235B's with its variant strategies too), measures the searched rows again on "
       "the current planner (its memory model changed), a plan compiled to the program its row "
       "compiled keeping that row's kernels' estimate (DeepSeek-V3's took 100 min beside other "
       "compiles); the one with reestimate, run for each recipe in turn, makes the rows' "
       "estimates again (their layers compiled with the compiler's rematerialization off; "
       "DeepSeek-V3's rows took 40 min each, beside each other); the one after it measures "
       "DeepSeek-V3's plans again, each program judged by what it allocates in HBM (96 min, "
       "beside the tests and other runs), the one after it MaxText's own compile of that recipe "
       "so (35 min beside the tests; run for Llama 3.1 405B on v6e too, 13 min), the next "
       "DeepSeek-V3's variant row again, the own settings' plan taken from the searched row, "
       "its search replayed (72 min beside the tests and other runs; 47 min once its memory model "
       "held the last layer's deferred weight gradients, no ring plan then predicted within the "
       "limit, so the plan of least predicted memory compiled), the next Qwen3-235B's plan on "
       "its own (constraints='drop', compare=None; 7 min), the next Llama 2 70B's on its own "
       "(16 min beside other work), the last Llama 3.1 405B's on two v6e-256 slices on its own "
       "(72 min beside the tests and other runs; its compile check 33 min)"),
    Folder("real_code", (
        Run("real_code", "real_code/default"),
        # on its own, the compiler ranking the best candidates (planner.plan(rank_by="compiled"))
        Run("real_code", "real_code/default", (
            ("config.cases", "maxtext:float32:maxtext,maxtext:float32:2axis,"
                             "maxtext:bfloat16:maxtext,maxtext:bfloat16:2axis,"
                             "keras:float32:2axis,gemma:float32:2axis"),
            ("config.given_layout", "none"), ("config.rank_by", "compiled")), "ranked"),
    ), Needs.LIBRARIES, 10, "JAX 0.12.0.1, MaxText 0.2.5, keras-hub 0.32.0, gemma 4.0.1; "
       "ranked/: 4 min"),
    Folder("ranking", (Run("ranking", "ranking/default"),), Needs.LIBRARIES, 5,
           "JAX 0.12.0.1, MaxText 0.2.5"),
]  # fmt: skip

FOLDERS: dict[str, Folder] = {f.name: f for f in _FOLDERS}
