"""KV formats against a float64 numpy reference written apart from engine/kv/formats.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kv.cache import KVCache, LayerKVSpec
from engine.kv.formats import FORMATS, KV_QUANT_CHOICES, kv_bytes_per_token
from engine.kv.hadamard import hadamard_matrix

# Bytes per 32 elements, from DESIGN.md (the contract, not read from the code).
CONTRACT_BYTES = {"f16": 64, "q8": 34, "q4": 18}


def ref_hadamard() -> np.ndarray:
    """H[i, j] = (-1)^popcount(i & j) / sqrt(32): the closed form, not the recursion."""
    i = np.arange(32)
    sign = np.vectorize(lambda v: bin(v).count("1") % 2)(i[:, None] & i[None, :])
    return np.where(sign == 1, -1.0, 1.0) / np.sqrt(32.0)


def ref_encode(x: np.ndarray, bits: int, rotate: bool) -> tuple[np.ndarray, np.ndarray]:
    """x (..., d) float64 -> (codes (..., nb, 32) int, scales (..., nb) float16)."""
    b = x.reshape(*x.shape[:-1], -1, 32)
    if rotate:
        b = b @ ref_hadamard()
    if bits == 8:
        scale = (np.abs(b).max(-1) / 127.0).astype(np.float16)
        lo, hi = -127, 127
    else:
        idx = np.abs(b).argmax(-1)[..., None]
        scale = (np.take_along_axis(b, idx, -1)[..., 0] / -8.0).astype(np.float16)
        lo, hi = -8, 7
    s = scale.astype(np.float64)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s != 0, b / s, 0.0)
    return np.clip(np.rint(q), lo, hi).astype(np.int64), scale


def ref_decode(planes: dict[str, torch.Tensor], bits: int, rotate: bool) -> np.ndarray:
    """The implementation's planes -> (..., d) float64, decoded by the layout's description."""
    raw = planes["codes"].numpy().astype(np.int64)
    if bits == 4:
        codes = np.empty((*raw.shape[:-1], raw.shape[-1] * 2), dtype=np.int64)
        codes[..., 0::2] = (raw & 0xF) - 8
        codes[..., 1::2] = (raw >> 4) - 8
    else:
        codes = raw
    b = codes.reshape(*codes.shape[:-1], -1, 32) * planes["scales"].numpy().astype(
        np.float64)[..., None]
    if rotate:
        b = b @ ref_hadamard().T
    return b.reshape(*b.shape[:-2], -1)


def sample(kind: str, shape: tuple[int, ...] = (256, 4, 128), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if kind == "outliers":  # a few channels 20x larger, fixed across tokens
        x[..., torch.randperm(shape[-1], generator=g)[:4]] *= 20
    return x


def rel_mse(x: torch.Tensor, y: torch.Tensor) -> float:
    x64, y64 = x.double(), y.double()
    return float(((x64 - y64) ** 2).sum() / (x64**2).sum())


QUANT = [("q8", 8, True), ("q8_plain", 8, False), ("q4", 4, True), ("q4_plain", 4, False)]


def test_hadamard_is_orthogonal_and_matches_closed_form() -> None:
    h = hadamard_matrix(32, torch.float64).numpy()
    np.testing.assert_allclose(h @ h.T, np.eye(32), atol=1e-14)
    np.testing.assert_allclose(h, ref_hadamard(), atol=1e-15)


@pytest.mark.parametrize(("name", "bits", "rotate"), QUANT)
@pytest.mark.parametrize("kind", ["gauss", "outliers"])
def test_encode_matches_reference(name: str, bits: int, rotate: bool, kind: str) -> None:
    x = sample(kind)
    planes = FORMATS[name].encode(x)
    ref_codes, ref_scales = ref_encode(x.double().numpy(), bits, rotate)
    scales = planes["scales"].numpy()
    if rotate:  # float32 vs float64 rotation may move a scale by one f16 ulp
        np.testing.assert_allclose(scales, ref_scales, rtol=2e-3)
    else:
        np.testing.assert_array_equal(scales, ref_scales)
    raw = planes["codes"].numpy().astype(np.int64)
    codes = np.stack([(raw & 0xF) - 8, (raw >> 4) - 8], -1).reshape(*raw.shape[:-1], -1) \
        if bits == 4 else raw
    diff = np.abs(codes.reshape(ref_codes.shape) - ref_codes)
    assert diff.max() <= 1 and (diff != 0).mean() < 1e-3  # only near-ties may differ


@pytest.mark.parametrize(("name", "bits", "rotate"), QUANT)
def test_decode_matches_reference(name: str, bits: int, rotate: bool) -> None:
    planes = FORMATS[name].encode(sample("outliers", seed=1))
    out = FORMATS[name].decode(planes)
    assert out.dtype == torch.float32 and out.shape == (256, 4, 128)
    np.testing.assert_allclose(out.double().numpy(), ref_decode(planes, bits, rotate),
                               rtol=1e-5, atol=2e-5)  # float32 rotation sums 32 terms


@pytest.mark.parametrize("name", ["q8_plain", "q4_plain"])
def test_unrotated_error_bound(name: str) -> None:
    x = sample("outliers", seed=2) * 3
    planes = FORMATS[name].encode(x)
    err = (x.double() - FORMATS[name].decode(planes).double()).reshape(256, 4, 4, 32).abs()
    half = planes["scales"].double().abs().unsqueeze(-1) / 2
    if name == "q8_plain":
        assert bool((err <= half * (1 + 1e-6)).all())
    else:  # the signed-max scale clips only the opposite sign above 7.5 * |scale|
        q = (x.double().reshape(256, 4, 4, 32) / -(half * 2 * planes["scales"].sign()
                                                    .double().unsqueeze(-1)))
        inside = q.abs() <= 7.5
        assert bool((err[inside] <= half.expand_as(err)[inside] * (1 + 1e-6)).all())
        assert bool((err <= 2 * half * (1 + 1e-6)).all())


@pytest.mark.parametrize(("name", "bits"), [("q8", 8), ("q4", 4)])
def test_rotated_error_bound_per_block(name: str, bits: int) -> None:
    # Rotation is orthogonal: a block's L2 error equals that in the rotated domain.
    x = sample("outliers", seed=3)
    planes = FORMATS[name].encode(x)
    err = (x.double() - FORMATS[name].decode(planes).double()).reshape(256, 4, 4, 32)
    s = planes["scales"].double().abs()
    per_elem = s / 2 if bits == 8 else s  # q4 may clip by up to one scale step
    assert bool((err.norm(dim=-1) <= per_elem * 32**0.5 * (1 + 1e-4)).all())


def test_rotation_default_measures_better() -> None:
    data = {"gauss": sample("gauss"), "outliers": sample("outliers")}
    for bits in ("q8", "q4"):
        rot, plain = ({k: rel_mse(x, FORMATS[name].decode(FORMATS[name].encode(x)))
                       for k, x in data.items()} for name in (bits, bits + "_plain"))
        assert rot["outliers"] < 0.5 * plain["outliers"], (bits, rot, plain)
        assert rot["gauss"] < 1.03 * plain["gauss"], (bits, rot, plain)


def test_q4_signed_scale_beats_amax_over_7() -> None:
    x = sample("gauss")
    b = x.double().numpy().reshape(256, 4, 4, 32)
    s = (np.abs(b).max(-1, keepdims=True) / 7).astype(np.float16).astype(np.float64)
    alt = np.clip(np.rint(b / s), -7, 7) * s
    alt_mse = float(((alt - b) ** 2).sum() / (b**2).sum())
    assert rel_mse(x, FORMATS["q4_plain"].decode(FORMATS["q4_plain"].encode(x))) < 0.9 * alt_mse


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_zero_huge_and_bf16_inputs(name: str) -> None:
    fmt = FORMATS[name]
    zero = torch.zeros(2, 1, 64)
    assert bool((fmt.decode(fmt.encode(zero)) == 0).all())
    huge = torch.full((2, 1, 64), 1e9)
    assert bool(torch.isfinite(fmt.decode(fmt.encode(huge))).all()) or name == "f16"
    xb = sample("gauss", (3, 2, 64)).to(torch.bfloat16)
    assert rel_mse(xb.float(), fmt.decode(fmt.encode(xb))) < 0.02


@pytest.mark.parametrize("kv_quant", sorted(KV_QUANT_CHOICES))
@pytest.mark.parametrize(("layers", "heads", "dim"), [(1, 1, 32), (3, 8, 128), (2, 4, 256)])
def test_plane_bytes_equal_contract(kv_quant: str, layers: int, heads: int, dim: int) -> None:
    k_name, v_name = KV_QUANT_CHOICES[kv_quant]
    expected = layers * heads * dim // 32 * (CONTRACT_BYTES[k_name] + CONTRACT_BYTES[v_name])
    assert kv_bytes_per_token(layers, heads, dim, kv_quant) == expected
    specs = [LayerKVSpec("full", heads, dim, dim) for _ in range(layers)]
    cache = KVCache(specs, {"full": 5}, page_size=16, kv_quant=kv_quant)
    assert cache.nbytes() == 5 * 16 * expected


@pytest.mark.parametrize("kv_quant", sorted(KV_QUANT_CHOICES))
def test_cache_round_trip(kv_quant: str) -> None:
    cache = KVCache([LayerKVSpec("full", 2, 64, 64)], {"full": 4}, page_size=4,
                    kv_quant=kv_quant)
    k, v = sample("gauss", (5, 2, 64), seed=4), sample("outliers", (5, 2, 64), seed=5)
    slots = torch.tensor([3, 0, 9, 15, 7])
    cache.write(0, slots, k, v)
    k2, v2 = cache.read(0, slots)
    assert rel_mse(k, k2) < 0.02 and rel_mse(v, v2) < 0.02
    k0, _ = cache.read(0, torch.tensor([1, 2]))
    assert bool((k0 == 0).all())
