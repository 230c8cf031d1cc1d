"""Block decoders for the 256-element super-block types: Q2_K..Q6_K and IQ4_XS.

Same contract as `dequant_simple`: `(n, type_size)` uint8 -> `(n, 256)` float32 in
llama.cpp's element order, with gguf-py's float32 operation order (the sub-block scale
`d * sc` is rounded first, then multiplied by the code, then the min is subtracted).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from kernels.dequant_simple import IQ4NL_VALUES, BlockFormat, f16_field, lookup, split_bits


def _scale_min_k4(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 12) u8 -> two (n, 8) u8: the 6-bit scales and mins of Q4_K/Q5_K (get_scale_min_k4).

    Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; scales/mins 4-7 take their
    low nibble from bytes 8-11 and their top two bits from the top bits of bytes 0-3 / 4-7.
    """
    lo, mid, hi = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=1)
    mins = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=1)
    return scales, mins


def _q2_k(b: torch.Tensor) -> torch.Tensor:  # 84 bytes: scales[16], qs[64], d f16, dmin f16
    n = b.shape[0]
    sc = b[:, 0:16]
    dl = (f16_field(b, 80) * (sc & 0x0F).float()).view(n, 16, 1)
    ml = (f16_field(b, 82) * (sc >> 4).float()).view(n, 16, 1)
    # Each 32-byte half holds 4 planes of 2-bit codes: element h*128 + s*32 + k.
    q = split_bits(b[:, 16:80].reshape(n, 2, 32), 2).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:  # 110 bytes: hmask[32], qs[64], scales[12], d f16
    n = b.shape[0]
    sc = b[:, 96:108]
    # 16 6-bit scales: low nibbles from bytes 0-7 (low then high nibble plane), top two bits
    # from bytes 8-11 (plane s of byte k is scale 4*s + k).
    low = split_bits(sc[:, 0:8], 4).reshape(n, 16)
    high = split_bits(sc[:, 8:12], 2).reshape(n, 16)
    scales = (low | (high << 4)).float() - 32
    dl = (f16_field(b, 108) * scales).view(n, 16, 1)
    ql = split_bits(b[:, 32:96].reshape(n, 2, 32), 2).reshape(n, 16, 16)
    hm = split_bits(b[:, 0:32], 1).reshape(n, 16, 16)  # bit s of hmask[k]: element s*32 + k
    # A clear hmask bit subtracts 4: q = ql - 4 * (1 - hm) = (ql | hm << 2) - 4.
    q = (ql | (hm << 2)).float() - 4
    return (dl * q).reshape(n, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:  # 144 bytes: d, dmin f16, scales[12], qs[128]
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    dl = (f16_field(b, 0) * sc.float()).view(n, 8, 1)
    ml = (f16_field(b, 2) * mn.float()).view(n, 8, 1)
    # 32-byte groups: low nibbles are sub-block 2g, high nibbles sub-block 2g + 1.
    q = split_bits(b[:, 16:144].reshape(n, 4, 32), 4).reshape(n, 8, 32).float()
    return (dl * q - ml).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:  # 176 bytes: d, dmin, scales[12], qh[32], qs[128]
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    dl = (f16_field(b, 0) * sc.float()).view(n, 8, 1)
    ml = (f16_field(b, 2) * mn.float()).view(n, 8, 1)
    ql = split_bits(b[:, 48:176].reshape(n, 4, 32), 4).reshape(n, 8, 32)
    qh = split_bits(b[:, 16:48], 1)  # (n, 8, 32): bit s of qh[k] is the 5th bit of s*32 + k
    q = (ql | (qh << 4)).float()
    return (dl * q - ml).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:  # 210 bytes: ql[128], qh[64], scales i8[16], d f16
    n = b.shape[0]
    sc = b[:, 192:208].view(torch.int8).float()
    dl = (f16_field(b, 208) * sc).view(n, 16, 1)
    # Per 128-element half h: low 4 bits from ql[h*64 + k] (nibble plane s: element
    # s*64 + k), high 2 bits from qh[h*32 + k] (2-bit plane s: element s*32 + k).
    low = split_bits(b[:, 0:128].reshape(n, 2, 64), 4).reshape(n, 256)
    high = split_bits(b[:, 128:192].reshape(n, 2, 32), 2).reshape(n, 256)
    q = (low | (high << 4)).float() - 32
    return (dl * q.view(n, 16, 16)).reshape(n, 256)


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:  # 136: d f16, scales_h u16, scales_l[4], qs[128]
    n = b.shape[0]
    # Scale j: low nibble = nibble j % 2 of scales_l[j // 2], top bits = bits 2j of scales_h.
    low = split_bits(b[:, 4:8], 4).transpose(-1, -2).reshape(n, 8)
    high = split_bits(b[:, 2:4], 2).transpose(-1, -2).reshape(n, 8)
    scales = (low | (high << 4)).float() - 32
    dl = (f16_field(b, 0) * scales).view(n, 8, 1)
    codes = split_bits(b[:, 8:136].reshape(n, 8, 16), 4).reshape(n, 8, 32)
    return (dl * lookup(IQ4NL_VALUES, codes)).reshape(n, 256)


FORMATS: dict[int, BlockFormat] = {
    T.Q2_K: BlockFormat(256, 84, _q2_k),
    T.Q3_K: BlockFormat(256, 110, _q3_k),
    T.Q4_K: BlockFormat(256, 144, _q4_k),
    T.Q5_K: BlockFormat(256, 176, _q5_k),
    T.Q6_K: BlockFormat(256, 210, _q6_k),
    T.IQ4_XS: BlockFormat(256, 136, _iq4_xs),
}
