"""The shared contract: Space checks (and their memo) and matrix_layout on odd views."""
import pytest
import torch

from kernels_core.contract import matrix_layout
from kernels_core.space import Space

SPACE = Space(
    params={"BLOCK": (64, 128, 256), "num_warps": (2, 4, 8)},
    default={"BLOCK": 128, "num_warps": 4},
    restrictions=("BLOCK >= 32 * num_warps", "arch >= 80 or BLOCK <= 128"),
    threads="32 * num_warps",
    smem_bytes="BLOCK * elt",
)


def test_rules_and_costs():
    assert SPACE.violated({"BLOCK": 64, "num_warps": 2}, 4) is None
    assert "32 * num_warps" in SPACE.violated({"BLOCK": 64, "num_warps": 4}, 4)
    assert SPACE.violated({"BLOCK": 256, "num_warps": 4}, 4, arch=90) is None
    assert "arch >= 80" in SPACE.violated({"BLOCK": 256, "num_warps": 4}, 4, arch=75)
    assert SPACE.cost({"BLOCK": 256, "num_warps": 8}, elt=2) == {"threads": 256, "smem_bytes": 512}
    assert len(list(SPACE.configs(4, arch=90))) == 6 and len(list(SPACE.configs(4, arch=75))) == 3


@pytest.mark.parametrize("bad", [True, 128.0, "128", [128], None])
def test_memo_never_admits_a_lookalike_of_a_valid_value(bad):
    """True == 1 and 128.0 == 128 hash alike: the remembered verdict for 128 must not leak to them."""
    assert SPACE.violated({"BLOCK": 128, "num_warps": 4}, 4) is None
    with pytest.raises(ValueError, match="BLOCK"):
        SPACE.check({"BLOCK": bad, "num_warps": 4}, 4)
    assert SPACE.violated({"BLOCK": 128, "num_warps": 4}, 4) is None


def test_resolve_fills_defaults_and_names_unknown_keys():
    assert SPACE.resolve({"BLOCK": 256}, 4) == {"BLOCK": 256, "num_warps": 4}
    with pytest.raises(ValueError, match="unknown tunable"):
        SPACE.resolve({"BLOK": 256}, 4)
    with pytest.raises(TypeError, match="config"):
        SPACE.resolve([("BLOCK", 256)], 4)


def test_older_archs_get_their_own_default():
    sp = Space(params={"BLOCK": (64, 128, 256), "num_warps": (2, 4, 8)}, default={"BLOCK": 256, "num_warps": 8},
               defaults_below={80: {"num_warps": 4}, 75: {"BLOCK": 64}})
    assert sp.default_for(90) == sp.default_for(80) == {"BLOCK": 256, "num_warps": 8}
    assert sp.default_for(75) == {"BLOCK": 256, "num_warps": 4}
    assert sp.default_for(70) == {"BLOCK": 64, "num_warps": 4}
    assert sp.resolve({"num_warps": 2}, 4, 70) == {"BLOCK": 64, "num_warps": 2}


def test_default_outside_the_space_is_refused_at_declaration():
    with pytest.raises(ValueError, match="outside"):
        Space(params={"BLOCK": (64,)}, default={"BLOCK": 128})
    with pytest.raises(ValueError, match="exactly"):
        Space(params={"BLOCK": (64,)}, default={})
    with pytest.raises(ValueError, match="outside"):
        Space(params={"BLOCK": (64,)}, default={"BLOCK": 64}, defaults_below={80: {"BLOCK": 32}})


@pytest.mark.parametrize("transposed", [False, True])
def test_matrix_layout_reads_views_without_copies(transposed):
    base = torch.randn(9, 13)
    view = base[1:8, 2:11]  # row stride 13, unit column stride
    t, cols_contig, ld = matrix_layout(view, transposed)
    assert t.data_ptr() == view.data_ptr()
    assert (cols_contig, ld) == ((False, 13) if transposed else (True, 13))


@pytest.mark.parametrize("transposed", [False, True])
def test_matrix_layout_copies_broadcast_and_strided_views(transposed):
    for view in (torch.randn(7).expand(5, 7), torch.randn(5, 14)[:, ::2]):
        t, cols_contig, ld = matrix_layout(view, transposed)
        assert t.is_contiguous() and torch.equal(t, view)
        assert (cols_contig, ld) == ((False, 7) if transposed else (True, 7))
