"""The shared contract: Space checks (and their memo), its walk of the valid configs, and matrix_layout
on odd views."""
import itertools

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


def brute_force(space: Space, elt: int, arch: int) -> list[dict]:
    """Every config of the product of the values that no rule refuses, in product order."""
    names = list(space.params)
    combos = (dict(zip(names, values)) for values in itertools.product(*space.params.values()))
    return [c for c in combos if space.violated(c, elt, arch) is None]


def test_configs_walks_a_kernel_union_kernel_by_kernel_and_finds_what_the_product_does():
    """A space of two kernels, each with a tunable the other ignores (fixed there), and a rule on a
    name no tunable is, which the walk must still raise on rather than pass."""
    union = Space(params={"BLOCK": (16, 32, 64), "THREADS": (1, 2, 4), "WARPS": (1, 2), "KERNEL": (0, 1)},
                  default={"BLOCK": 16, "THREADS": 1, "WARPS": 1, "KERNEL": 0},
                  restrictions=("not (KERNEL == 0) or WARPS == 1", "not (KERNEL == 1) or THREADS == 1",
                                "BLOCK >= 16 * THREADS * WARPS", "arch >= 80 or KERNEL == 0"))
    for arch in (75, 90):
        assert list(union.configs(4, arch)) == brute_force(union, 4, arch)
    assert len(list(union.configs(4, 90))) == 3 + 2 + 1 + 3 + 2
    broken = Space(params={"BLOCK": (16, 32)}, default={"BLOCK": 16}, restrictions=("BLOCK <= LIMIT",))
    with pytest.raises(NameError, match="LIMIT"):
        list(broken.configs(4))


def test_configs_walks_once_per_elt_and_arch_and_hands_out_copies(monkeypatch):
    """A search opens a study per call and a benchmark looks configs up per case, all of one space:
    the walk runs once per (elt, arch), and a caller that changes a config it was given changes no
    later caller's."""
    space = Space(params=dict(SPACE.params), default=dict(SPACE.default), restrictions=SPACE.restrictions)
    walks = []
    walk = Space._walk
    monkeypatch.setattr(Space, "_walk", lambda self, elt, arch: walks.append((elt, arch)) or walk(self, elt, arch))
    first = list(space.configs(4, 90))
    first[0]["BLOCK"] = 1
    assert list(space.configs(4, 90)) == brute_force(space, 4, 90) and len(first) == 6
    list(space.configs(4, 75)), list(space.configs(2, 90)), list(space.configs(4, 75))
    assert walks == [(4, 90), (4, 75), (2, 90)]


@pytest.mark.slow  # the products of the spaces' values: seconds
@pytest.mark.parametrize("twin", ["triton", "cuda"])
def test_every_space_of_the_twins_walks_to_the_products_configs(twin):
    """Both twins' spaces, every op and dtype at sm_75, sm_80 and sm_90 (the CUDA fp32 matmul union,
    1,512,000 value combinations, at sm_90 only: its product takes seconds)."""
    import importlib

    from kernels_core import contract

    ops = importlib.import_module(f"kernels_{twin}")
    seen = set()
    for op in contract.OPS:
        for dtype, info in contract.DTYPES.items():
            space = ops.space(op, dtype)
            for arch in (90,) if space.size() > 100_000 else (75, 80, 90):
                if (id(space), arch) in seen or (space.size() > 100_000 and op != "matmul"):
                    continue
                seen.add((id(space), arch))
                assert list(space.configs(info.itemsize, arch)) == brute_force(space, info.itemsize, arch), \
                    (op, dtype, arch)


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


def test_a_tunable_split_off_another_takes_its_value_where_a_config_lacks_it():
    """A config written before BR0 existed ran W_0 at its BR: filled from BR, not the default."""
    sp = Space(params={"BR": (16, 32), "BR0": (16, 32), "BC": (16, 32)}, default={"BR": 32, "BR0": 32, "BC": 32},
               inherits={"BR0": "BR"})
    assert sp.with_defaults({"BR": 16}) == {"BR": 16, "BR0": 16, "BC": 32}
    assert sp.with_defaults({"BR": 16, "BR0": 32}) == {"BR": 16, "BR0": 32, "BC": 32}
    assert sp.resolve({"BR": 16}, 4) == {"BR": 16, "BR0": 16, "BC": 32}
    assert sp.resolve(None, 4) == sp.default
    with pytest.raises(ValueError, match="inherits: BR0 from BR needs both in the space, with one default"):
        Space(params={"BR": (16, 32), "BR0": (16, 32)}, default={"BR": 32, "BR0": 16}, inherits={"BR0": "BR"})
    with pytest.raises(ValueError, match="inherits"):
        Space(params={"BR": (16, 32)}, default={"BR": 32}, inherits={"BR0": "BR"})


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
