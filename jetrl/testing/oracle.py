"""An independent scalar oracle for the FP8 spec: pure Python floats and numpy float32, no torch.

It shares no code with `jetrl.quant` (the thing under test): scales are computed as numpy float32
quotients (float64 division rounded once to float32 is the correctly rounded fp32 quotient, since
53 >= 2*24 + 2), and e4m3 rounding is a table search over all finite float8_e4m3fn values with ties
to the even code. Slow by design; use it on small hostile inputs.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

E4M3_MAX = 448.0


def _e4m3_table() -> tuple[list[float], list[int]]:
    """All non-negative finite e4m3fn values in increasing order, with their 7-bit codes."""
    vals, codes = [], []
    for code in range(0x7F):  # 0x7F is NaN
        e, m = code >> 3, code & 7
        v = (m / 8.0) * 2.0**-6 if e == 0 else (1.0 + m / 8.0) * 2.0 ** (e - 7)
        vals.append(v)
        codes.append(code)
    return vals, codes


_VALS, _CODES = _e4m3_table()


def e4m3_code(v: float) -> int:
    """Byte of the e4m3fn value nearest to v (|v| <= 448), ties to the even code."""
    if math.isnan(v) or abs(v) > E4M3_MAX:
        raise ValueError(f"e4m3_code: {v!r} is outside [-448, 448]; clamp first")
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    i = bisect.bisect_left(_VALS, a)
    if i < len(_VALS) and _VALS[i] == a:
        code = _CODES[i]
    else:
        lo, hi = _VALS[i - 1], _VALS[i]
        dl, dh = a - lo, hi - a
        if dl < dh:
            code = _CODES[i - 1]
        elif dh < dl:
            code = _CODES[i]
        else:
            code = _CODES[i - 1] if _CODES[i - 1] % 2 == 0 else _CODES[i]
    return sign | code


def scale_of(values: list[float], eps: float = 1e-10) -> np.float32:
    """fp32 dequant scale of a group: max(amax, fp32(eps)) / 448, correctly rounded."""
    amax = np.float32(max((abs(float(v)) for v in values), default=0.0))
    floor = np.float32(eps)
    return np.float32(float(max(amax, floor)) / E4M3_MAX)


def quantize_group(values: list[float], eps: float = 1e-10) -> tuple[list[int], np.float32]:
    """Bytes and scale of one group (values already exactly representable in fp32)."""
    s = scale_of(values, eps)
    out = []
    for v in values:
        qv = float(np.float32(float(np.float32(v)) / float(s)))  # correctly rounded fp32 quotient
        qv = min(max(qv, -E4M3_MAX), E4M3_MAX)
        out.append(e4m3_code(qv))
    return out, s


def quantize_1x128_oracle(x: np.ndarray, eps: float = 1e-10) -> tuple[np.ndarray, np.ndarray]:
    """Oracle for jetrl.quant.quantize_1x128 on a 2-D float32 array: (uint8 bytes [M, K], fp32 scales)."""
    m, k = x.shape
    g = -(-k // 128)
    q = np.zeros((m, k), dtype=np.uint8)
    s = np.zeros((m, g), dtype=np.float32)
    for r in range(m):
        for j in range(g):
            vals = [float(v) for v in x[r, j * 128 : (j + 1) * 128]]
            codes, sc = quantize_group(vals, eps)
            q[r, j * 128 : j * 128 + len(codes)] = codes
            s[r, j] = sc
    return q, s


def quantize_128x128_oracle(w: np.ndarray, eps: float = 1e-10) -> tuple[np.ndarray, np.ndarray]:
    """Oracle for jetrl.quant.quantize_128x128 on a 2-D float32 array."""
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    q = np.zeros((n, k), dtype=np.uint8)
    s = np.zeros((nb, kb), dtype=np.float32)
    for bi in range(nb):
        for bj in range(kb):
            block = w[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128]
            codes, sc = quantize_group([float(v) for v in block.reshape(-1)], eps)
            q[bi * 128 : bi * 128 + block.shape[0], bj * 128 : bj * 128 + block.shape[1]] = np.array(
                codes, dtype=np.uint8
            ).reshape(block.shape)
            s[bi, bj] = sc
    return q, s
