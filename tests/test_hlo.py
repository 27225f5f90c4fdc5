"""redist.hlo: collectives read from HLO text, in the three ways XLA writes device groups."""

from redist.hlo import Collective, hlo_collectives

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
