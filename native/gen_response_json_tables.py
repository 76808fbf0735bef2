"""Writes native/response_json_tables.h: the exact constants the response
writer's float formatting needs (native/response_json.c), computed here with
Python's unbounded integers so that none of them is an approximation.

    python native/gen_response_json_tables.py          # rewrite the header
    python native/gen_response_json_tables.py --check  # exit 1 if it is stale

A float32 value widened to a double is c * 2**q with c in [2**52, 2**53)
and q in [Q_MIN, Q_MAX] (subnormal float32 values are normal doubles). For
each q the table gives k = floor(log10(gap)), where gap is the width of the
double's rounding interval: 2**q, or 3/4 * 2**q when c == 2**52 (the gap
below a power of two is half the gap above). 10**k <= gap < 10**(k + 1)
means the interval holds at least one multiple of 10**k and at most one
multiple of 10**(k + 1), which is what the shortest-digit search relies on.
The formatting scales by 10**-k, so it needs 5**p for p = -k >= 0 (as three
64-bit limbs) and 5**-p for p < 0 (one limb); every bound the C code relies
on is asserted here.
"""

from __future__ import annotations

import sys
from pathlib import Path

HEADER = Path(__file__).resolve().parent / "response_json_tables.h"

FLOAT32_E_MIN = -149  # a float32 is m * 2**e, m < 2**24, e in [-149, 104]
FLOAT32_E_MAX = 104
Q_MIN = FLOAT32_E_MIN - 52  # m == 1: c = 2**52, q = e - 52
Q_MAX = FLOAT32_E_MAX - 29  # m >= 2**23: c = m * 2**29, q = e - 29
X_BITS = 55  # the scaled bounds 4c - 2 .. 4c + 2 are below 2**55


def floor_log10(numerator: int, denominator: int) -> int:
    """floor(log10(numerator / denominator)) exactly, for positive integers."""

    def at_least(k: int) -> bool:  # 10**k <= numerator / denominator
        return 10**k * denominator <= numerator if k >= 0 else denominator <= numerator * 10**-k

    k = len(str(numerator)) - len(str(denominator))  # within one of the answer
    while not at_least(k):
        k -= 1
    while at_least(k + 1):
        k += 1
    return k


def power_of_two(q: int, scale_num: int = 1, scale_den: int = 1) -> tuple[int, int]:
    """scale * 2**q as a fraction (numerator, denominator)."""
    return (scale_num << q, scale_den) if q >= 0 else (scale_num, scale_den << -q)


def k_for(q: int, irregular: bool) -> int:
    return floor_log10(*power_of_two(q, 3, 4) if irregular else power_of_two(q))


def tables() -> tuple[list[tuple[int, int]], int, int]:
    ks = [(k_for(q, False), k_for(q, True)) for q in range(Q_MIN, Q_MAX + 1)]
    p_max = max(-k for pair in ks for k in pair)
    p_min = min(-k for pair in ks for k in pair)
    for q, pair in zip(range(Q_MIN, Q_MAX + 1), ks, strict=True):
        for k in pair:
            p = -k
            shift = q + p
            if p >= 0:
                # 4c+2 times 5**p fits four limbs; the floor fits one.
                assert X_BITS + (5**p).bit_length() <= 256
                assert shift > -192
                assert shift < 0 or X_BITS + (5**p).bit_length() + shift <= 64
            else:
                # (4c+2) << shift fits 128 bits and 5**-p one limb.
                assert 0 <= shift and X_BITS + shift <= 127, (q, k, shift)
                assert (5**-p).bit_length() <= 64
    assert (5**p_max).bit_length() <= 192
    return ks, p_min, p_max


FIXED_BITS = 28  # G = 5^p * 2^(e + p + FIXED_BITS): v * 10^p * 2^28 = m * G
POINT = FIXED_BITS + 31  # (m << 31) * G = v * 10^p * 2^POINT


def scales(ks: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Per float32 biased exponent b and irregular (fraction 0): (G, k, fast)
    for the fast path of a normal value v = m * 2^e (m < 2^24, e = b - 150)
    with p = -k: T = (m << 31) * G is v * 10^p * 2^POINT exactly, and the
    rounding interval's ends are T - 2G and T + 2G (T - G below a power of
    two): the double's half gap is 2^(e - 30), a quarter below a power of
    two. fast 0 (the general path): b 0 and 255, and where G would not be an
    exact integer below 2^62 (below about 2e-9 and above about 1e15)."""
    out = []
    for b in range(256):
        for irregular in (0, 1):
            if not 1 <= b <= 254:
                out.append((0, 0, 0))
                continue
            e = b - 150
            k = ks[e - 29 - Q_MIN][irregular]  # q = e - 29: c = m * 2^29
            p = -k
            shift = e + p + FIXED_BITS
            if p < 0 or shift < 0 or 5**p << shift >= 2**62:
                out.append((0, k, 0))
                continue
            g = 5**p << shift
            # s = T >> POINT, the digits before the point, has 16 or 17
            # digits, as do s + 1 and the multiples of ten around it; the
            # fraction below 2^POINT and the half interval 2G keep
            # 10 * 2^POINT + 2G below 2^64 (the C code's comparisons).
            low_m = 2**23 if irregular else 2**23 + 1  # fraction 0 is the irregular case
            high_m = 2**23 if irregular else 2**24 - 1
            assert 10**15 <= ((low_m << 31) * g - 2 * g) >> POINT
            assert (((high_m << 31) * g + 2 * g) >> POINT) + 10 < 10**17
            assert (high_m << 31) * g + 2 * g < 2**128
            assert 10 * 2**POINT + 2 * g < 2**64
            out.append((g, k, 1))
    return out


def render() -> str:
    ks, p_min, p_max = tables()
    lines = [
        "/* Generated by native/gen_response_json_tables.py: do not edit. Exact",
        " * constants for native/response_json.c's float formatting. */",
        "#ifndef SHMASK_RESPONSE_JSON_TABLES_H",
        "#define SHMASK_RESPONSE_JSON_TABLES_H",
        "",
        "#include <stdint.h>",
        "",
        f"#define RJ_Q_MIN ({Q_MIN})",
        f"#define RJ_Q_MAX {Q_MAX}",
        f"#define RJ_POW5_MAX {p_max}",
        f"#define RJ_POW5_NEG_MAX {-p_min}",
        "",
        "/* k = floor(log10(gap)) for q - RJ_Q_MIN: {regular gap 2^q, gap 3/4 * 2^q} */",
        "static const int8_t rj_k_table[][2] = {",
    ]
    for start in range(0, len(ks), 8):
        lines.append("    " + " ".join(f"{{{a}, {b}}}," for a, b in ks[start:start + 8]))
    lines += ["};", "", "/* 5^p for p in [0, RJ_POW5_MAX] as three 64-bit limbs, least first */",
              "static const uint64_t rj_pow5[][3] = {"]
    for p in range(p_max + 1):
        value = 5**p
        limbs = [(value >> (64 * i)) & (2**64 - 1) for i in range(3)]
        lines.append("    {" + ", ".join(f"0x{limb:016x}u" for limb in limbs) + "},")
    lines += ["};", "", "/* The fast path's scale per float32 biased exponent and irregular (see",
              " * scales() in the generator): {G = 5^p * 2^(e + p + RJ_FIXED_BITS), k, fast} */",
              f"#define RJ_FIXED_BITS {FIXED_BITS}", f"#define RJ_POINT {POINT}",
              "typedef struct {", "    uint64_t g;", "    int16_t k;",
              "    uint8_t fast;", "} rj_scale;", "static const rj_scale rj_scales[256][2] = {"]
    table = scales(ks)
    for b in range(256):
        regular, irregular = table[2 * b], table[2 * b + 1]
        lines.append("    {" + ", ".join(f"{{UINT64_C({g}), {k}, {ok}}}"
                                         for g, k, ok in (regular, irregular)) + "},")
    lines += ["};", "", "/* 10^i for i in [0, 19] */", "static const uint64_t rj_pow10[20] = {"]
    for start in range(0, 20, 4):
        lines.append("    " + " ".join(f"UINT64_C({10**i})," for i in range(start, start + 4)))
    lines += ["};", "", "/* \"00\" .. \"99\": two decimal digits per lookup */",
              "static const char rj_digit_pairs[201] ="]
    pairs = "".join(f"{i:02d}" for i in range(100))
    for start in range(0, 200, 40):
        lines.append(f'    "{pairs[start:start + 40]}"')
    lines[-1] += ";"
    lines += ["", "#endif", ""]
    return "\n".join(lines)


def main() -> int:
    text = render()
    if "--check" in sys.argv:
        if HEADER.read_text() != text:
            print(f"{HEADER} is stale: run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    HEADER.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
