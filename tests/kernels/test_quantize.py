"""Stochastic quantisation onto an integer table, lookup, bit packing and hashed uniforms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gravac.kernels.quantize import (
    CellTables,
    RoundingWork,
    flip_signs,
    hash_sign_words,
    hash_signs,
    hash_uniform,
    lookup,
    pack_bits,
    packed_numel,
    round_levels,
    sign_hashes,
    stochastic_quantize,
    unpack_bits,
    unpack_lookup_sum,
)

#: THC's published table T_{4,30,1/32} (largest gap 3 levels).
TABLE = torch.tensor([0, 3, 5, 7, 9, 11, 13, 14, 16, 17, 19, 21, 23, 25, 27, 30])
DRAWS = 20_000
# One draw of a value inside [a, c] has standard deviation sqrt((c-x)(x-a)) <= (c-a)/2 <= 1.5;
# the mean of DRAWS draws has sd <= 1.5 / sqrt(20000) = 0.0106. Five of them:
MEAN_TOL = 5 * 1.5 / math.sqrt(DRAWS)
# Sample variance of DRAWS draws of a variance-v (bounded) variable: relative sd about
# sqrt(2 / DRAWS) = 1%; 6% is a loose bound that still catches a wrong rounding rule.
VAR_RTOL = 0.06

VALUES = [0.0, 0.4, 2.5, 3.0, 4.2, 13.5, 14.0, 15.9, 28.7, 29.99, 30.0]


def _draw(values: list[float], draws: int, seed: int) -> torch.Tensor:
    x = torch.tensor(values).repeat(draws, 1)
    u = torch.rand(x.shape, generator=torch.Generator().manual_seed(seed))
    return lookup(stochastic_quantize(x, TABLE, u), TABLE).double()


def test_unbiased_inside_the_range() -> None:
    q = _draw(VALUES, DRAWS, seed=0)
    torch.testing.assert_close(
        q.mean(0), torch.tensor(VALUES, dtype=torch.float64), rtol=0, atol=MEAN_TOL
    )


def test_rounds_to_adjacent_levels_with_sq_variance() -> None:
    """Only the two levels around x occur, and the variance is (c - x)(x - a)."""
    q = _draw(VALUES, DRAWS, seed=1)
    for j, x in enumerate(VALUES):
        i = int(torch.searchsorted(TABLE, torch.tensor(x), right=True)) - 1
        a = int(TABLE[min(i, len(TABLE) - 2)])
        c = int(TABLE[min(i + 1, len(TABLE) - 1)])
        assert set(q[:, j].unique().tolist()) <= {float(a), float(c)}
        expected = (c - x) * (x - a)
        if expected == 0.0:
            assert float(q[:, j].var()) == 0.0, f"level {x} must be exact"
        else:
            assert float(q[:, j].var()) == pytest.approx(expected, rel=VAR_RTOL)


def test_unbiased_with_hashed_uniforms_over_seeds() -> None:
    """The hash is keyed by the seed: over seeds it is as good as fresh uniforms."""
    seeds = DRAWS // 4  # one kernel call per seed; the tolerance widens by sqrt(4) = 2
    x = torch.tensor(VALUES)
    q = torch.stack(
        [
            lookup(stochastic_quantize(x, TABLE, hash_uniform(x, seed)), TABLE)
            for seed in range(seeds)
        ]
    ).double()
    torch.testing.assert_close(
        q.mean(0), torch.tensor(VALUES, dtype=torch.float64), rtol=0, atol=2 * MEAN_TOL
    )


def test_out_of_range_and_nan_are_clamped_not_crashing() -> None:
    x = torch.tensor([-5.0, 31.0, math.inf, -math.inf, math.nan])
    idx = stochastic_quantize(x, TABLE, torch.rand(5))
    assert idx.tolist() == [0, 15, 15, 0, 0]
    assert idx.dtype == torch.int64


def test_float64_values_and_table_dtypes() -> None:
    x = torch.tensor([1.5, 15.0], dtype=torch.float64)
    u = torch.tensor([0.0, 0.49])  # 1.5 rounds up with p = 1/2 (to 3), 15 too (to 16)
    for table in (TABLE, TABLE.to(torch.uint8), TABLE.double()):
        assert stochastic_quantize(x, table, u).tolist() == [1, 8]


def test_bad_shapes_raise() -> None:
    with pytest.raises(ValueError, match="uniform"):
        stochastic_quantize(torch.zeros(3), TABLE, torch.zeros(4))
    with pytest.raises(ValueError, match="table"):
        stochastic_quantize(torch.zeros(3), torch.tensor([1]), torch.zeros(3))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("numel", [0, 1, 3, 7, 8, 9, 1001])
def test_pack_round_trip(bits: int, numel: int) -> None:
    gen = torch.Generator().manual_seed(bits * 1000 + numel)
    idx = torch.randint(0, 2**bits, (numel,), generator=gen).to(torch.uint8)
    packed = pack_bits(idx, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == packed_numel(numel, bits) == math.ceil(numel * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, numel), idx)


def test_pack_layout_is_little_endian_within_a_byte() -> None:
    assert pack_bits(torch.tensor([1, 2, 3, 0]), 2).tolist() == [0b00_11_10_01]
    assert pack_bits(torch.tensor([0xA, 0x5, 0xF]), 4).tolist() == [0x5A, 0x0F]
    assert pack_bits(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1]), 1).tolist() == [0x81, 0x01]


def test_pack_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match=r"bits must be one of \[1, 2, 4, 8\], got 3"):
        pack_bits(torch.zeros(4, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="bytes"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 4, 7)  # 7 nibbles need 4 bytes
    with pytest.raises(ValueError, match="uint8"):
        unpack_bits(torch.zeros(4, dtype=torch.int32), 4, 7)


def test_hash_uniform_is_deterministic_and_uniform() -> None:
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(2))
    u = hash_uniform(x, 1234)
    assert u.dtype == torch.float32 and u.shape == x.shape
    assert torch.equal(u, hash_uniform(x.clone(), 1234))
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    # 20 equal bins of 10,000 expected counts: chi-square with 19 dof, mean 19, sd about 6.2.
    counts = torch.histc(u, bins=20, min=0.0, max=1.0)
    chi2 = float(((counts - 10_000) ** 2 / 10_000).sum())
    assert chi2 < 60.0
    # Neighbouring uniforms are uncorrelated (sd of this estimate ~ 1 / (12 sqrt(n)) = 2e-4).
    assert abs(float(((u[1:] - 0.5) * (u[:-1] - 0.5)).mean())) < 1e-3


def test_hash_uniform_depends_on_seed_bits_and_position() -> None:
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(3))
    u = hash_uniform(x, 7)
    # Another seed, or a one-ulp change of every input, gives unrelated draws.
    for other in (hash_uniform(x, 8), hash_uniform(torch.nextafter(x, x + 1), 7)):
        assert float((u - other).abs().mean()) == pytest.approx(1 / 3, abs=0.02)
    # Equal values at different positions get different uniforms.
    same = hash_uniform(torch.full((1000,), 0.25), 7)
    assert same.unique().numel() > 990
    # float64 and half inputs work (float64 bit patterns are folded to 32 bits).
    assert hash_uniform(x.double(), 7).shape == x.shape
    assert hash_uniform(x.half(), 7).shape == x.shape
    with pytest.raises(ValueError, match="floating-point"):
        hash_uniform(torch.ones(3, dtype=torch.int32), 7)


def test_hash_signs_are_balanced_plus_minus_one_and_seeded() -> None:
    s = hash_signs(100_000, seed=5)
    assert set(s.unique().tolist()) == {-1.0, 1.0}
    assert abs(float(s.mean())) < 0.02  # mean of 1e5 fair signs: sd 0.0032
    assert torch.equal(s, hash_signs(100_000, seed=5))
    assert not torch.equal(s, hash_signs(100_000, seed=6))
    assert hash_signs(7, seed=5, dtype=torch.float64).dtype == torch.float64


def test_sign_hashes_are_pinned() -> None:
    """The diagonal's hashes (NumPy, shared by the reference and the CPU kernels) keep the
    values that ``cuda/thc.cu`` reproduces: pinned, with a 64-bit seed whose halves both count."""
    seed = 2**63 + 2**40 + 12345
    assert hash_sign_words(100, seed).tolist() == [3921282748, 455788253, 2545626603, 1171995052]
    assert int(hash_sign_words(1 << 22, 987654321).sum()) == 280971955904873
    assert sign_hashes(100, seed).dtype == np.dtype("<u4")
    assert sign_hashes(100, seed).tolist() == hash_sign_words(100, seed).tolist()


def test_unpack_lookup_sum_adds_the_looked_up_levels() -> None:
    gen = torch.Generator().manual_seed(0)
    idx = [torch.randint(0, 16, (33,), generator=gen) for _ in range(3)]
    packed = [pack_bits(i, 4) for i in idx]
    got = unpack_lookup_sum(packed, 4, 33, TABLE)
    assert torch.equal(got, sum(TABLE[i] for i in idx))
    with pytest.raises(ValueError, match="at least one"):
        unpack_lookup_sum([], 4, 33, TABLE)
    with pytest.raises(ValueError, match="pack into 17 uint8 bytes"):
        unpack_lookup_sum([packed[0][:-1]], 4, 33, TABLE)


#: Tables of each :attr:`CellTables.spacing`: THC's b = 4 table (general), two levels (b = 1,
#: with g = 1 and a wider g), the unit table 0..3 (b = 2, g = 3); the ``_u16`` ones send levels
#: above 255, in uint16 (:attr:`CellTables.level`).
SPACINGS = {
    "general": TABLE,
    "general_u16": torch.tensor([0, 2, 200, 300, 510]),
    "two": torch.tensor([0, 1]),
    "two_wide": torch.tensor([0, 7]),
    "two_u16": torch.tensor([0, 300]),
    "unit": torch.tensor([0, 1, 2, 3]),
    "unit_u16": torch.arange(301),
}


@pytest.mark.parametrize("name", sorted(SPACINGS))
@pytest.mark.parametrize("indices", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_round_levels_equals_the_reference_bit_for_bit(
    name: str, chunk: int, indices: bool
) -> None:
    """The in-place CPU kernel over chunks == lookup(stochastic_quantize(u, T, hash_uniform)),
    for every table spacing (the two-level and unit tables skip the gathers)."""
    table = SPACINGS[name]
    g = float(table[-1])
    gen = torch.Generator().manual_seed(chunk)
    n = 1_001 if chunk == 1 else 10_001  # a chunk of one element: a call per element
    u = torch.rand(n, generator=gen) * g
    u[:6] = torch.tensor([0.0, g, g * (1 - 2**-23), g / 2, 1.0, 0.5])
    ref = stochastic_quantize(u, table, hash_uniform(u, 2**40 + 3))
    expected = ref if indices else lookup(ref, table)
    cells = CellTables.build(table, indices=indices)
    assert cells.spacing == name.split("_")[0]
    assert cells.level.dtype == (
        np.uint16 if int(expected.max()) > np.iinfo(np.uint8).max else np.uint8
    )
    work = RoundingWork(chunk)
    out = np.empty(u.numel(), dtype=cells.level.dtype)
    for start in range(0, u.numel(), chunk):
        end = min(start + chunk, u.numel())
        seg = u[start:end].numpy()
        round_levels(seg, cells, 2**40 + 3, offset=start, out=out[start:end], work=work)
    assert torch.equal(torch.from_numpy(out).long(), expected)


@pytest.mark.parametrize("offset", [0, 64, 4096])
def test_flip_signs_is_the_product_with_the_hashed_diagonal(offset: int) -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(offset))
    x[:4] = torch.tensor([0.0, -0.0, math.inf, math.nan])
    signs = hash_signs(offset + 1000, seed=11)
    words = hash_sign_words(offset + 1000, seed=11).numpy().astype("<u4")
    out = np.empty(1000, dtype=np.float32)
    flip_signs(x.numpy(), words, offset=offset, out=out, work=RoundingWork(1000))
    expected = x * signs[offset:]
    # Bit patterns: the sign of zeros and NaN included.
    assert torch.equal(torch.from_numpy(out).view(torch.int32), expected.view(torch.int32))
    with pytest.raises(ValueError, match="multiple of 32"):
        flip_signs(x.numpy(), words, offset=3, out=out, work=RoundingWork(1000))


def test_round_levels_is_unbiased() -> None:
    cells = CellTables.build(TABLE)
    u = torch.tensor(VALUES).repeat(DRAWS)
    q = np.empty(u.numel(), dtype=cells.level.dtype)
    round_levels(u.numpy(), cells, 9, offset=0, out=q, work=RoundingWork(u.numel()))
    torch.testing.assert_close(
        torch.from_numpy(q).double().view(DRAWS, -1).mean(0),
        torch.tensor(VALUES, dtype=torch.float64),
        rtol=0,
        atol=MEAN_TOL,
    )
    with pytest.raises(ValueError, match="starting at 0"):
        CellTables.build(TABLE + 1)
