"""redist.hlo: collectives read from HLO text, in the three ways XLA writes device groups; kernels
with their matmul flops and bytes, through fusions and loops."""

from redist.hlo import (
    Collective,
    counted_collectives,
    hlo_collectives,
    hlo_kernels,
    kernel_counts,
    recomputed,
)

TEXT = """
  %ag = f32[8,64]{0,1} all-gather(%c), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2], device_ids=([2,2,2]T(1,0,2)) {'axis_1','axis_2'}, dimensions={1}
  %a2a = (f32[4,4]{1,0}, f32[4,4]{1,0}) all-to-all(%x, %y), replica_groups={{0,1},{2,3}}
  %rs = bf16[16]{0} reduce-scatter(%z), replica_groups=[2,4]<=[8], dimensions={0}
  %cp-start = f32[2]{0} collective-permute-start(%w), source_target_pairs={{0,1},{1,0}}
  %cp-done = f32[2]{0} collective-permute-done(%cp-start)
  ROOT %add = f32[2]{0} add(%cp-done, %cp-done)
"""


def test_kinds_bytes_and_group_sizes():
    assert hlo_collectives(TEXT) == (
        Collective("all-gather", 8 * 64 * 4, 4),
        Collective("all-to-all", 2 * 16 * 4, 2),
        Collective("reduce-scatter", 16 * 2, 4),
        Collective("collective-permute", 8, 0),
    )


def test_bytes_of_tuple_results_and_ops_that_are_not_collectives():
    hlo = """
  %all-to-all = (f32[16,32,8]{2,1,0}, f32[16,32,8]{2,1,0}) all-to-all(%a, %b), channel_id=1
  %ag = bf16[4,8]{1,0} all-gather(%x), dimensions={0}
  ROOT %p = f32[32]{0} collective-permute(%y), source_target_pairs={{0,1}}
  %add = f32[4] add(%q, %r)
"""
    got = [(c.kind, c.bytes) for c in hlo_collectives(hlo)]
    assert got == [
        ("all-to-all", 2 * 16 * 32 * 8 * 4),
        ("all-gather", 64),
        ("collective-permute", 128),
    ]


# A scanned layer as XLA:GPU writes it: the loop's body slices the stacked weight, runs a Triton
# gemm fusion (its dot nested in a fusion), writes its result into a stacked output in place.
LOOP = """
HloModule jit_layers, is_scheduled=true

%gemm_computation (p0: f32[64,256], p1: bf16[256,128]) -> f32[64,128] {
  %p0 = f32[64,256]{1,0} parameter(0)
  %p1 = bf16[256,128]{1,0} parameter(1)
  %c = f32[256,128]{1,0} convert(%p1)
  ROOT %dot.1 = f32[64,128]{1,0} dot(%p0, %c), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_slice (q0: bf16[5,256,128], q1: s32[]) -> bf16[256,128] {
  %q0 = bf16[5,256,128]{2,1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = bf16[1,256,128]{2,1,0} dynamic-slice(%q0, %q1, %zero, %zero), dynamic_slice_sizes={1,256,128}
  ROOT %b = bf16[256,128]{1,0} bitcast(%ds)
}

%fused_update (u0: f32[5,64,128], u1: f32[64,128], u2: s32[]) -> f32[5,64,128] {
  %u0 = f32[5,64,128]{2,1,0} parameter(0)
  %u1 = f32[64,128]{1,0} parameter(1)
  %t = f32[64,128]{1,0} tanh(%u1)
  %b1 = f32[1,64,128]{2,1,0} bitcast(%t)
  %u2 = s32[] parameter(2)
  %zero.1 = s32[] constant(0)
  ROOT %dus = f32[5,64,128]{2,1,0} dynamic-update-slice(%u0, %b1, %u2, %zero.1, %zero.1)
}

%body (arg: (s32[], f32[64,256], bf16[5,256,128], f32[5,64,128])) -> (s32[], f32[64,256], bf16[5,256,128], f32[5,64,128]) {
  %arg = (s32[], f32[64,256]{1,0}, bf16[5,256,128]{2,1,0}, f32[5,64,128]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[64,256]{1,0} get-tuple-element(%arg), index=1
  %ws = bf16[5,256,128]{2,1,0} get-tuple-element(%arg), index=2
  %ys = f32[5,64,128]{2,1,0} get-tuple-element(%arg), index=3
  %w = bf16[256,128]{1,0} fusion(%ws, %i), kind=kLoop, calls=%fused_slice
  %gemm = f32[64,128]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_computation, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %ys.1 = f32[5,64,128]{2,1,0} fusion(%ys, %gemm, %i), kind=kLoop, calls=%fused_update
  %one = s32[] constant(1)
  %i.1 = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[64,256]{1,0}, bf16[5,256,128]{2,1,0}, f32[5,64,128]{2,1,0}) tuple(%i.1, %x, %ws, %ys.1)
}

%cond (carry: (s32[], f32[64,256], bf16[5,256,128], f32[5,64,128])) -> pred[] {
  %carry = (s32[], f32[64,256]{1,0}, bf16[5,256,128]{2,1,0}, f32[5,64,128]{2,1,0}) parameter(0)
  %n = s32[] get-tuple-element(%carry), index=0
  %five = s32[] constant(5)
  ROOT %lt = pred[] compare(%n, %five), direction=LT
}

ENTRY %main (x: f32[64,256], ws: bf16[5,256,128], ys: f32[5,64,128]) -> f32[5,64,128] {
  %x = f32[64,256]{1,0} parameter(0)
  %ws = bf16[5,256,128]{2,1,0} parameter(1)
  %ys = f32[5,64,128]{2,1,0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], f32[64,256]{1,0}, bf16[5,256,128]{2,1,0}, f32[5,64,128]{2,1,0}) tuple(%zero, %x, %ws, %ys)
  %loop = (s32[], f32[64,256]{1,0}, bf16[5,256,128]{2,1,0}, f32[5,64,128]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %last = f32[5,64,128]{2,1,0} get-tuple-element(%loop), index=3
  %ar = f32[5,64,128]{2,1,0} all-reduce(%last), replica_groups={{0,1}}, to_apply=%cond
  ROOT %copy = f32[5,64,128]{2,1,0} copy(%ar)
}
"""


def test_a_dot_in_a_fusion_counts_its_flops_with_its_operands_dtype():
    kernels = {k.name: k for k in hlo_kernels(LOOP)}
    gemm = kernels["gemm"]
    assert gemm.op == "fusion" and gemm.dots == (("float32", 2.0 * 64 * 128 * 256),)
    assert gemm.read_bytes == 64 * 256 * 4 + 256 * 128 * 2 and gemm.written_bytes == 64 * 128 * 4


def test_a_loop_body_runs_its_trip_count_times():
    kernels = {k.name: k for k in hlo_kernels(LOOP)}
    assert {name: k.runs for name, k in kernels.items()} == {
        "w": 5, "gemm": 5, "ys.1": 5, "i.1": 5, "lt": 5, "copy": 1,
    }  # fmt: skip
    counts = kernel_counts(LOOP)
    assert counts.dot_flops == {"float32": 5 * 2.0 * 64 * 128 * 256}
    assert counts.launches == 5 * 5 + 1
    # the collective is priced elsewhere, once: as counted_collectives counts it
    assert [c.runs for c in counted_collectives(LOOP)] == [1]


def test_a_slice_reads_its_slice_and_an_update_in_place_writes_its_update():
    kernels = {k.name: k for k in hlo_kernels(LOOP)}
    assert (kernels["w"].read_bytes, kernels["w"].written_bytes) == (
        256 * 128 * 2 + 4,
        256 * 128 * 2,
    )
    update = kernels["ys.1"]  # not the stacked buffer it updates: the tile it writes
    assert (update.read_bytes, update.written_bytes) == (64 * 128 * 4 + 4, 64 * 128 * 4)
    assert kernels["copy"].read_bytes == kernels["copy"].written_bytes == 5 * 64 * 128 * 4


def test_a_cublas_gemm_counts_its_flops_and_its_precision_not_its_workspace():
    hlo = """
ENTRY %main (a: bf16[32,64], b: bf16[16,64], c: f32[8,4,2], d: f32[8,2,3]) -> bf16[32,16] {
  %a = bf16[32,64]{1,0} parameter(0)
  %b = bf16[16,64]{1,0} parameter(1)
  %g = (bf16[32,16]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"precision_config":{"operand_precision":["DEFAULT","DEFAULT"]}}}
  %c = f32[8,4,2]{2,1,0} parameter(2)
  %d = f32[8,2,3]{2,1,0} parameter(3)
  %e = f32[8,4,3]{2,1,0} dot(%c, %d), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}, operand_precision={highest,highest}
  ROOT %r = bf16[32,16]{1,0} get-tuple-element(%g), index=0
}
"""
    g, e = hlo_kernels(hlo)
    assert g.dots == (("bfloat16", 2.0 * 32 * 16 * 64),) and g.written_bytes == 32 * 16 * 2
    assert g.read_bytes == (32 + 16) * 64 * 2
    assert e.dots == (("float32:highest", 2.0 * 8 * 4 * 3 * 2),)


def test_a_computation_called_from_two_places_counts_for_each():
    hlo = """
%f (p: f32[4,4]) -> f32[4,4] {
  %p = f32[4,4]{1,0} parameter(0)
  ROOT %d = f32[4,4]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[4,4]) -> f32[4,4] {
  %x = f32[4,4]{1,0} parameter(0)
  %k1 = f32[4,4]{1,0} fusion(%x), kind=kCustom, calls=%f
  ROOT %k2 = f32[4,4]{1,0} fusion(%k1), kind=kCustom, calls=%f
}
"""
    assert kernel_counts(hlo).dot_flops == {"float32": 2 * 2.0 * 4 * 4 * 4}


def test_a_ragged_all_to_all_is_an_all_to_all_of_its_smaller_buffer():
    """As libtpu writes it (operands by name only): the input and the worst-case output buffer
    are known from their definitions, and the smaller is what a device sends when its rows are
    spread evenly; without them, the result's bytes."""
    hlo = """
  %copy-done = bf16[16,2,128]{2,1,0} copy-done(%copy-start)
  %buf = bf16[64,2,128]{2,1,0} broadcast(%pad), dimensions={1,2}
  %r = bf16[64,2,128]{2,1,0} ragged-all-to-all(%copy-done, %buf, %o, %s, %o, /*index=5*/%s), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}
  %q = bf16[64,2,128]{2,1,0} ragged-all-to-all(%unknown, %buf, %o, %s, %o, %s), replica_groups=[1,8]<=[8]
"""
    assert hlo_collectives(hlo) == (
        Collective("all-to-all", 16 * 2 * 128 * 2, 8),
        Collective("all-to-all", 64 * 2 * 128 * 2, 8),
    )


def test_recomputed_counts_the_copies_the_compilers_rematerialization_names():
    """libtpu names each copy it computes again ``<name>.remat``, ``.remat2``, ``.remat.1``,
    ``.remat_compressed`` (and suffixes after); a name or an op_name that merely contains
    "remat" (JAX's ``rematted_computation``, a user's ``remat_fn``) is not one."""
    hlo = """
  %fusion.2.remat = bf16[8]{0} fusion(%p), kind=kLoop, calls=%f
  %gte.remat.1 = f32[] get-tuple-element(%t), index=0
  %all-gather.3.remat2 = bf16[8]{0} all-gather(%q), replica_groups={{0,1}}, dimensions={0}
  %fusion.4.remat_uncompressed.q_ref = bf16[8]{0} fusion(%p), kind=kLoop, calls=%f
  %remat_fn = f32[] add(%a, %b), metadata={op_name="jit(f)/checkpoint/rematted_computation/add"}
  %rematted.1 = f32[] add(%a, %b)
  ROOT %fusion.9.remat_compressed = bf16[8]{0} fusion(%p), kind=kLoop, calls=%f
"""
    assert recomputed(hlo) == 5
    assert recomputed(TEXT) == 0
