"""The sharding core's records and states in one process: groups padded to the world size and the
alignment, with every parameter element in exactly one rank's range (params straddle ranks), and
the state machine refusing illegal transitions with the group named."""
import pytest
import torch

from zerocore.sharding import GradState, ParamState, StateError, build_groups, padded_size
from zerocore.sharding.state import grad_state, param_state


def test_groups_pad_to_world_and_alignment_and_params_straddle_ranks():
    params = [((f"p{i}",), torch.empty(n)) for i, n in enumerate([5, 130, 1, 77, 1000, 3])]
    groups = build_groups(params, bucket_elems=200, world=3, dtype=torch.bfloat16)
    assert [len(g.slots) for g in groups] == [3, 1, 1, 1]  # 5+130+1 | 77 | 1000 (own group) | 3
    for g in groups:
        assert g.padded % (3 * 32) == 0 and g.padded >= g.numel and g.padded == padded_size(g.numel, 3)
        # every element of every parameter belongs to exactly one rank's range
        covered = {s.name: 0 for s in g.slots}
        for r in range(3):
            lo, hi = g.range_of(r)
            for slot, a, b in g.pieces(lo, hi):
                covered[slot.name] += b - a
        assert covered == {s.name: s.numel for s in g.slots}
    big = groups[2]
    assert len({r for r in range(3) for _ in big.pieces(*big.range_of(r))}) == 3  # one param over 3 ranks
    assert groups[0].range_of(0, parts=1) == (0, groups[0].padded)  # stage 0 owns it all



def test_state_transitions_are_asserted():
    s = grad_state(4)
    s.to(GradState.FILLING)
    s.to(GradState.REDUCING)
    with pytest.raises(StateError, match="group 4 grads: illegal transition REDUCING -> FILLING"):
        s.to(GradState.FILLING)
    p = param_state(1, ParamState.SHARDED)
    with pytest.raises(StateError, match="is SHARDED, expected GATHERED"):
        p.expect(ParamState.GATHERED)

