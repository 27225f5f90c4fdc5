"""Frontier models' parameter trees and their training and serving layouts, for weight sync.

The trees are made from the models' public configs (Hugging Face ``config.json``), with each
layer kind's weights stacked over its layers (as MaxText's scanned layers store them):

- Qwen3-235B-A22B: 94 layers of grouped-query attention (64 query heads, 4 key/value heads of
  128, query/key norms) and 128 routed experts of 1536 (8 per token); vocabulary 151,936.
- DeepSeek-V3 (671 B): 61 layers of multi-head latent attention (128 heads; query rank 1536,
  key/value rank 512, 128 + 64 query/key and 128 value dimensions per head); 3 dense layers
  (18,432 wide), 58 with 256 routed experts of 2048 and a shared one; vocabulary 129,280.

Layouts, on two meshes over the same devices:

- training (MaxText's FSDP x expert, ``fsdp`` x ``expert``): the experts' expert dimension over
  ``expert`` and their model dimension over ``fsdp``; every other matrix's model dimension over
  both (MaxText's rule for ``embed``);
- serving (vLLM's / SGLang's tensor x expert parallelism, ``ep`` x ``tp``): attention heads,
  MLP columns and the vocabulary over ``tp`` (projections back to the model dimension by
  rows), replicated over ``ep``; the experts' expert dimension over ``ep`` and their hidden
  dimension over ``tp``.

``layouts="tunix"`` gives the layouts of MaxText's RL trainer (tunix's ``RLCluster``) and its
vLLM TPU sampler instead (sources in :mod:`experiments.frontier_sync`): the training layout as
above but DeepSeek-V3's router over ``fsdp`` alone (MaxText's ``embed_router``); the serving
layout as above but with vLLM's expert parallelism off (MaxText RL's
``rollout_expert_parallelism: 1``): every expert on every chip of a tensor-parallel group, its
hidden dimension over ``tp``, replicated over the sampler's data-parallel replicas.

Example:
    >>> tree = parameters("qwen3_235b")
    >>> tree["layers/moe/wi_0"].shape, tree["layers/moe/wi_0"].serve
    ((94, 128, 4096, 1536), (None, 'ep', None, 'tp'))
"""

from __future__ import annotations

import dataclasses
import math

MODELS = {
    "qwen3_235b": dict(d=4096, layers=94, heads=64, kv_heads=4, head=128, experts=128,
                       expert_ffn=1536, vocab=151936),
    "deepseek_v3": dict(d=7168, layers=61, dense_layers=3, heads=128, q_rank=1536, kv_rank=512,
                        nope=128, rope=64, v_head=128, dense_ffn=18432, experts=256,
                        expert_ffn=2048, shared_ffn=2048, vocab=129280),
}  # fmt: skip
"""The models' public configs (the fields the trees need)."""

SHRUNK = {
    "qwen3_235b": dict(d=256, layers=4, heads=8, kv_heads=2, head=32, experts=8, expert_ffn=128,
                       vocab=4096),
    "deepseek_v3": dict(d=256, layers=4, dense_layers=1, heads=8, q_rank=64, kv_rank=32,
                        nope=32, rope=16, v_head=32, dense_ffn=512, experts=8, expert_ffn=128,
                        shared_ffn=128, vocab=4096),
}  # fmt: skip
"""The same structures shrunk to run on 8 CPU devices (``fsdp:4 x expert:2``): every leaf kind,
its stacking and its layouts kept."""

FSDP = ("fsdp", "expert")  # MaxText's embed rule: the model dimension over both training axes


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One stacked weight: its shape and its two layouts (axes per dimension)."""

    shape: tuple[int, ...]
    train: tuple
    serve: tuple

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def _stacked(n: int, shape: tuple, train: tuple, serve: tuple) -> Leaf:
    return Leaf((n, *shape), (None, *train), (None, *serve))


def _matrix(n: int, rows: int, cols: int, serve: str) -> Leaf:
    """A stacked ``rows x cols`` projection: ``serve="cols"`` (into heads or the MLP) or
    ``"rows"`` (back to the model dimension)."""
    model_dim = 0 if serve == "cols" else 1
    train = tuple(FSDP if k == model_dim else None for k in range(2))
    return _stacked(n, (rows, cols), train, (None, "tp") if serve == "cols" else ("tp", None))


def _norm(n: int, width: int) -> Leaf:
    return _stacked(n, (width,), (None,), (None,))


def _experts(n: int, experts: int, d: int, ffn: int) -> dict[str, Leaf]:
    into = _stacked(n, (experts, d, ffn), ("expert", "fsdp", None), ("ep", None, "tp"))
    back = _stacked(n, (experts, ffn, d), ("expert", None, "fsdp"), ("ep", "tp", None))
    return {"wi_0": into, "wi_1": into, "wo": back}


def _mlp(n: int, d: int, ffn: int) -> dict[str, Leaf]:
    return {"wi_0": _matrix(n, d, ffn, "cols"), "wi_1": _matrix(n, d, ffn, "cols"),
            "wo": _matrix(n, ffn, d, "rows")}  # fmt: skip


LAYOUTS = ("vllm", "tunix")
"""The layout pairs :func:`parameters` gives (see the module)."""


def parameters(model: str, shrunk: bool = False, layouts: str = "vllm") -> dict[str, Leaf]:
    """The parameter tree of ``model`` (a key of :data:`MODELS`), path -> :class:`Leaf`;
    ``shrunk``: of its :data:`SHRUNK` config; ``layouts``: one of :data:`LAYOUTS`."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")
    if layouts not in LAYOUTS:
        raise ValueError(f"layouts must be one of {LAYOUTS}, got {layouts!r}")
    tree = _parameters(model, shrunk)
    if layouts == "tunix":
        for k, leaf in tree.items():
            if k.endswith(("moe/wi_0", "moe/wi_1")):  # (layers, experts, d, ffn)
                tree[k] = dataclasses.replace(leaf, serve=(None, None, None, "tp"))
            elif k.endswith("moe/wo"):  # (layers, experts, ffn, d)
                tree[k] = dataclasses.replace(leaf, serve=(None, None, "tp", None))
            elif model == "deepseek_v3" and k.endswith("moe/gate"):  # ("embed_router", None)
                tree[k] = dataclasses.replace(leaf, train=(None, "fsdp", None))
    return tree


def _parameters(model: str, shrunk: bool) -> dict[str, Leaf]:
    c = (SHRUNK if shrunk else MODELS)[model]
    d, v = c["d"], c["vocab"]
    tree = {"embed": Leaf((v, d), (None, FSDP), ("tp", None)),
            "head": Leaf((d, v), (FSDP, None), (None, "tp")),
            "final_norm": Leaf((d,), (None,), (None,))}  # fmt: skip
    if model == "qwen3_235b":
        n, h, kv, hd = c["layers"], c["heads"], c["kv_heads"], c["head"]
        layer = {"attn/q": _matrix(n, d, h * hd, "cols"), "attn/k": _matrix(n, d, kv * hd, "cols"),
                 "attn/v": _matrix(n, d, kv * hd, "cols"), "attn/o": _matrix(n, h * hd, d, "rows"),
                 "attn/q_norm": _norm(n, hd), "attn/k_norm": _norm(n, hd),
                 "pre_norm": _norm(n, d), "post_norm": _norm(n, d),
                 "moe/gate": _stacked(n, (d, c["experts"]), (FSDP, None), (None, None)),
                 **{f"moe/{k}": w for k, w in _experts(n, c["experts"], d,
                                                         c["expert_ffn"]).items()}}  # fmt: skip
        return tree | {f"layers/{k}": w for k, w in layer.items()}
    h, q_rank, kv_rank = c["heads"], c["q_rank"], c["kv_rank"]
    qk = c["nope"] + c["rope"]
    for kind, n in (("dense", c["dense_layers"]), ("moe", c["layers"] - c["dense_layers"])):
        layer = {"attn/wq_a": _matrix(n, d, q_rank, "cols"), "attn/q_norm": _norm(n, q_rank),
                 "attn/wq_b": _stacked(n, (q_rank, h * qk), (FSDP, None), (None, "tp")),
                 "attn/wkv_a": _matrix(n, d, kv_rank + c["rope"], "cols"),
                 "attn/kv_norm": _norm(n, kv_rank),
                 "attn/wkv_b": _stacked(n, (kv_rank, h * (c["nope"] + c["v_head"])), (FSDP, None),
                                        (None, "tp")),
                 "attn/wo": _matrix(n, h * c["v_head"], d, "rows"),
                 "pre_norm": _norm(n, d), "post_norm": _norm(n, d)}  # fmt: skip
        if kind == "dense":
            layer |= {f"mlp/{k}": w for k, w in _mlp(n, d, c["dense_ffn"]).items()}
        else:
            layer |= {"moe/gate": _stacked(n, (d, c["experts"]), (FSDP, None), (None, None)),
                      **{f"moe/{k}": w for k, w in _experts(n, c["experts"], d,
                                                            c["expert_ffn"]).items()},
                      **{f"shared/{k}": w for k, w in _mlp(n, d, c["shared_ffn"]).items()}}  # fmt: skip
        tree |= {f"{kind}_layers/{k}": w for k, w in layer.items()}
    return tree


def kv_cache_bytes_per_chip(model: str, tp: int, sequences: int, tokens: int) -> int:
    """The sampler's KV cache on one chip, in bfloat16: ``sequences`` resident sequences of
    ``tokens`` tokens each on a data-parallel replica of ``tp`` tensor-parallel chips.

    Qwen3-235B (grouped-query attention): per token and layer a key and a value of each of the
    chip's key/value heads (its 4 heads split over ``tp``, one on each chip where ``tp`` is more:
    vLLM repeats them). DeepSeek-V3 (multi-head latent attention): per token and layer the
    latent, ``kv_rank + rope`` = 576 values, held whole by every chip of the replica.

    Example:
        >>> kv_cache_bytes_per_chip("qwen3_235b", tp=16, sequences=1, tokens=1)  # 94*128*2*2
        48128
    """
    c = MODELS[model]
    if model == "qwen3_235b":
        per_token = c["layers"] * max(1, c["kv_heads"] // tp) * c["head"] * 2  # key and value
    else:
        per_token = c["layers"] * (c["kv_rank"] + c["rope"])
    return per_token * 2 * sequences * tokens  # bfloat16


def parameter_count(model: str) -> int:
    """The number of parameters of ``model``'s tree (Qwen3-235B: 235 B; DeepSeek-V3: 671 B)."""
    return sum(leaf.size for leaf in parameters(model).values())
