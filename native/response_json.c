/*
 * The response writer of response_json.h.
 *
 * Floats. A float32 value v widened to a double is c * 2^q, c in
 * [2^52, 2^53), with q in [RJ_Q_MIN, RJ_Q_MAX]. A double reads back as v
 * exactly when it lies in v's rounding interval [u, w]: u = (c - 1/2) 2^q
 * (c - 1/4 when c == 2^52: the gap below a power of two is half the gap
 * above), w = (c + 1/2) 2^q, both ends included (c is even: its low 29
 * bits are the zeros the widening added, so round-half-even reads the ends
 * back as v). orjson writes the shortest decimal in that interval and, of
 * those, the closest to v (a tie goes to the even digit).
 *
 * The search follows R. Giulietti's "The Schubfach way to render doubles":
 * with k = floor(log10(w - u)) (tabulated per q by
 * gen_response_json_tables.py), the interval holds at least one multiple of
 * 10^k and at most one multiple of 10^(k+1). So if a multiple of 10^(k+1)
 * lies in it, that is the shortest; otherwise the answer is one of the two
 * multiples of 10^k around v. What differs from the paper: v / 10^k and
 * the bounds are computed EXACTLY, not from a rounded table of powers of
 * ten, so no error analysis is needed.
 *
 * The fast path (decimal_of; normal values from about 2e-9 to 1e15, all
 * logprobs in practice): with v = m * 2^e (m the 24-bit significand), the
 * generated table holds per exponent an integer G = 5^p * 2^(e + p + 28)
 * (p = -k) below 2^62, so T = (m << 31) * G is v / 10^k * 2^59 exactly in
 * 128 bits, and the interval's ends are T - 2G and T + 2G (T - G below a
 * power of two). The integer part s = T >> 59 and the fraction f answer
 * every question of the search by comparing f with multiples of 2^59 and
 * of G: one multiply, a few compares, no division.
 *
 * The general path (shortest_decimal; subnormals and the extremes) scales
 * the bounds by 5^p in up to 256 bits (v's 24 significant bits times 5^p
 * fit over the whole float32 range). A scaled bound Y is kept as floor(Y),
 * or floor(Y) | 1 when Y is not an integer ("round to odd"): compared with
 * an even integer N that answers Y <= N, N <= Y and Y == N exactly, and
 * every comparison there is with 4 * an integer (the bounds are taken 4
 * times, 4u = (4c - 2) 2^q, so that they are integers times 2^q).
 *
 * Both are checked against orjson for all 2^32 float32 bit patterns by
 * tests/exhaustive_float_json.py (make test-exhaustive).
 */
#include "response_json.h"

#include "shmask_cpu_internal.h"
#include "shmask_pool.h"
#include <string.h>

#include "response_json_tables.h"

typedef unsigned __int128 u128;

/* x * 2^q * 10^p, rounded to odd (above). x < 2^55 (4 times a bound's
 * multiple of 2^q), so the result is 4 times the bound scaled by 10^p. */
__attribute__((noinline)) static uint64_t scaled_round_odd(uint64_t x, int q, int p) {
    int shift = q + p; /* x * 5^p * 2^shift */
    if (p < 0) {
        /* x * 2^shift / 5^-p with shift >= 0 and x << shift below 2^127
         * (both asserted by the table generator). */
        u128 numerator = (u128)x << shift;
        uint64_t divisor = rj_pow5[-p][0];
        u128 quotient = numerator / divisor;
        return (uint64_t)quotient | (numerator != quotient * divisor);
    }
    if (shift >= 0) return x * rj_pow5[p][0] << shift; /* p <= 1, q <= 3: below 2^64 */
    unsigned drop = (unsigned)-shift; /* bits below the binary point */
    if (rj_pow5[p][1] == 0 && drop < 128) {
        u128 n = (u128)x * rj_pow5[p][0]; /* below 2^119 */
        u128 low = drop ? n & (((u128)1 << drop) - 1) : 0;
        return (uint64_t)(n >> drop) | (low != 0);
    }
    /* x * 5^p in four limbs (5^p < 2^142, asserted by the generator). */
    uint64_t limb[4];
    u128 carry = 0;
    for (int i = 0; i < 3; i++) {
        carry += (u128)x * rj_pow5[p][i];
        limb[i] = (uint64_t)carry;
        carry >>= 64;
    }
    limb[3] = (uint64_t)carry;
    unsigned word = drop / 64, bit = drop % 64; /* drop < 192: word <= 2 */
    uint64_t floor = limb[word] >> bit;
    if (bit) floor |= limb[word + 1] << (64 - bit);
    uint64_t inexact = bit ? limb[word] & ((UINT64_C(1) << bit) - 1) : 0;
    for (unsigned i = 0; i < word; i++) inexact |= limb[i];
    return floor | (inexact != 0);
}

/* 4 * v / 10^-p and the bounds 4u, 4w scaled alike, rounded to odd. */
static inline __attribute__((always_inline)) void scaled_bounds(uint64_t c, int irregular,
                                                                int q, int p, uint64_t *low,
                                                                uint64_t *mid, uint64_t *high) {
    int drop = -(q + p);
    if (p >= 0 && rj_pow5[p][1] == 0 && drop > 0 && drop < 64) {
        /* The usual range (1e-11 <= |v| < 1e16): one multiply, c * 5^p
         * below 2^117, and the bounds differ from 4v by 2 * 5^p (1 * 5^p
         * below a power of two). */
        uint64_t five = rj_pow5[p][0];
        u128 centre = (u128)c * five * 4;
        u128 below = centre - (irregular ? (u128)five : (u128)five * 2);
        u128 above = centre + (u128)five * 2;
        uint64_t mask = (UINT64_C(1) << drop) - 1;
        *low = (uint64_t)(below >> drop) | (((uint64_t)below & mask) != 0);
        *mid = (uint64_t)(centre >> drop) | (((uint64_t)centre & mask) != 0);
        *high = (uint64_t)(above >> drop) | (((uint64_t)above & mask) != 0);
        return;
    }
    *low = scaled_round_odd(4 * c - (irregular ? 1 : 2), q, p);
    *mid = scaled_round_odd(4 * c, q, p);
    *high = scaled_round_odd(4 * c + 2, q, p);
}

/* The bounds of any positive finite float32, scaled (shortest_decimal). */
static void general_bounds(uint32_t bits, int *exponent,
                                                     uint64_t *low, uint64_t *mid,
                                                     uint64_t *high) {
    uint32_t biased = (bits >> 23) & 0xff;
    uint64_t m = bits & 0x7fffff;
    int e;
    if (biased) {
        m |= 0x800000;
        e = (int)biased - 150;
    } else {
        e = -149;
    }
    /* As a double: c = m shifted so that its top bit is bit 52. */
    int top = 63 - __builtin_clzll(m);
    uint64_t c = m << (52 - top);
    int q = e - (52 - top);
    int irregular = c == (UINT64_C(1) << 52);
    int k = rj_k_table[q - RJ_Q_MIN][irregular];
    scaled_bounds(c, irregular, q, -k, low, mid, high);
    *exponent = k;
}

/* The shortest-then-closest decimal of a positive finite float32 value
 * outside the fast path of decimal_of (subnormals, below about 2e-9 and
 * above about 1e15): returns its digits, *exponent its power of ten
 * (trailing zeros may be left: the caller drops them). */
__attribute__((noinline)) static uint64_t shortest_decimal(uint32_t bits, int *exponent) {
    uint64_t low, mid, high;
    general_bounds(bits, exponent, &low, &mid, &high);
    uint64_t s = mid >> 2; /* floor(v / 10^k) */
    /* A multiple of 10^(k+1) in [u, w] is the answer: one of the two
     * around v, at most one. Otherwise s or s + 1, whichever is in (at
     * least one is), the closer to v if both (v against s + 1/2; a tie to
     * the even one). Every outcome is a coin toss for random values, so
     * all are computed and selected without branches. */
    uint64_t down10 = s - s % 10, up10 = down10 + 10;
    int down10_in = low <= 4 * down10, up10_in = 4 * up10 <= high; /* s >= 2^52: down10 > 0 */
    uint64_t middle = 4 * s + 2;
    int s_in = low <= 4 * s, t_in = 4 * (s + 1) <= high;
    int s_closer = (mid < middle) | ((mid == middle) & (s % 2 == 0));
    uint64_t chosen = s + (uint64_t)!(s_in & ((!t_in) | s_closer));
    chosen = up10_in ? up10 : chosen;
    return down10_in ? down10 : chosen;
}

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the digit words below are laid out for little-endian machines"
#endif

/* Digits are made eight at a time in a 64-bit word, one digit per byte,
 * the first digit in the lowest byte (so a little-endian store writes them
 * in order), and stored straight into the output: building them in a
 * buffer with narrow stores and copying that with wide loads would stall
 * on every value (a load cannot be forwarded from several smaller stores). */

/* The eight digits of x < 10^8 (leading zeros included), as byte values 0..9. */
static inline uint64_t digit_values8(uint32_t x) {
    /* Two lanes of 32 bits (x / 10^4, x % 10^4), then four of 16 bits
     * (/ 100, % 100), then eight of 8 bits (/ 10, % 10); each division by
     * a multiply and shift that is exact in its lane's range. */
    uint32_t high = x / 10000;
    uint64_t lanes = high | ((uint64_t)(x - high * 10000) << 32);
    uint64_t hundreds = ((lanes * 10486) >> 20) & UINT64_C(0x0000007F0000007F);
    lanes = hundreds | ((lanes - hundreds * 100) << 16);
    uint64_t tens = ((lanes * 103) >> 10) & UINT64_C(0x000F000F000F000F);
    return tens | ((lanes - tens * 10) << 8);
}

#define ASCII_ZEROS UINT64_C(0x3030303030303030)

/* Number of decimal digits of x > 0. */
static inline int decimal_digits(uint64_t x) {
    int guess = ((64 - __builtin_clzll(x)) * 1233) >> 12; /* floor(bits * log10(2)) */
    return guess + (x >= rj_pow10[guess]);
}

/* A float's decimal form, worked out before its layout so that a run of
 * values is converted in one loop (no dependence between iterations: the
 * conversions overlap) and laid out in another. */
typedef struct {
    uint64_t digits;  /* 17 digits, d * 10^(17 - n): in [10^16, 10^17) */
    int32_t exponent; /* of the first digit (E) */
    uint8_t negative;
    uint8_t kind;     /* FINITE, ZERO, NONE (NaN or infinite: null) */
} decimal17;

enum { FINITE, ZERO, NONE };

/* The fast path's fixed point: 2^RJ_POINT is 1 in units of 10^k. */
#define ONE (UINT64_C(1) << RJ_POINT)

static inline __attribute__((always_inline)) decimal17 decimal_of(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    uint32_t magnitude = bits & 0x7fffffff, fraction = bits & 0x7fffff;
    const rj_scale *scale = &rj_scales[magnitude >> 23][fraction == 0];
    decimal17 d = {0, 0, (uint8_t)(bits >> 31), FINITE};
    uint64_t digits;
    int k;
    if (__builtin_expect(scale->fast, 1)) {
        /* A normal value v = m * 2^e of the usual range: T = (m << 31) * G
         * is v / 10^k in fixed point, exactly (G from the generated table),
         * and the interval's ends lie 2G above and 2G below it (G below a
         * power of two: the gap below is half the gap above). With s the
         * integer part and f the fraction of v / 10^k, every question of
         * the search is a comparison of f with a multiple of 2G or G. */
        uint64_t m = fraction | 0x800000;
        u128 t = (u128)(m << 31) * scale->g;
        uint64_t s = (uint64_t)(t >> RJ_POINT), f = (uint64_t)t & (ONE - 1);
        uint64_t above = 2 * scale->g, below = fraction ? above : scale->g;
        uint64_t r = s % 10;
        /* A multiple of 10^(k+1) in the interval is the answer (at most one
         * is): s - r if v - (s - r) <= v - u, s - r + 10 if it <= w - v.
         * Otherwise s or s + 1, whichever is in (at least one is), the
         * closer to v if both (f against 1/2; a tie to the even one). Every
         * outcome is a coin toss for random values: selected without
         * branches. */
        int down10_in = r * ONE + f <= below, up10_in = (10 - r) * ONE <= f + above;
        int s_in = f <= below, t_in = ONE <= f + above;
        int s_closer = (f < ONE / 2) | ((f == ONE / 2) & !(s & 1));
        uint64_t chosen = s + (uint64_t)!(s_in & ((!t_in) | s_closer));
        /* Selected with masks: a compiler may turn a ?: into a branch. */
        uint64_t up10_mask = 0 - (uint64_t)up10_in, down10_mask = 0 - (uint64_t)down10_in;
        chosen = (chosen & ~up10_mask) | ((s - r + 10) & up10_mask);
        digits = (chosen & ~down10_mask) | ((s - r) & down10_mask);
        k = scale->k;
        /* 16 or 17 digits (asserted by the generator): made 17, with a mask:
         * which of the two is a coin toss where a binade straddles a power
         * of ten (logprobs in [8, 16)), and a branch there mispredicted
         * (1.5 ns a value on logprobs). */
        int short16 = digits < rj_pow10[16];
        uint64_t short16_mask = 0 - (uint64_t)short16;
        digits = (digits & ~short16_mask) | (digits * 10 & short16_mask);
        k -= short16;
    } else if ((magnitude >> 23) == 0xff) {
        d.kind = NONE;
        return d;
    } else if (!magnitude) {
        d.kind = ZERO;
        return d;
    } else {
        digits = shortest_decimal(magnitude, &k);
        /* 16 or 17 digits (v / 10^k >= c >= 2^52 > 10^15), 18 only for a
         * multiple of 10 (17 significant digits always suffice): made 17. */
        int short16 = digits < rj_pow10[16], long18 = digits >= rj_pow10[17];
        digits = short16 ? digits * 10 : long18 ? digits / 10 : digits;
        k += long18 - short16;
    }
    d.digits = digits;
    d.exponent = k + 16;
    return d;
}

static inline void store64(char *o, uint64_t word) { memcpy(o, &word, 8); }

/* Digits 1..16 of a 17-digit decimal (all but its first), as two words of
 * byte values 0..9 (`front`: digits 1-8, `back`: 9-16, each in memory
 * order), and the count of its significant digits (17 less its trailing
 * zeros; digit 0 is never zero). */
typedef struct {
    uint64_t front, back;
    int significant;
} digits16;

#if defined(__SSE2__) && !defined(SHM_JSON_SCALAR)
#include <emmintrin.h>

/* The digits of two values below 10^8 (`first8`, `second8`) as two words
 * of byte values (first's, then second's), in one vector, with SSE2 (every
 * x86-64 has it): the scalar digit_values8's halving, lane by lane. Each
 * 8-digit value is split in two of 4 digits (64-bit lanes -> 32), each of
 * those in two of 2 (-> 16), each of those in two digits (-> 8): a
 * quotient by a multiply (and a shift) exact over its lane's range (x <
 * 10^8: (x * 3518437209) >> 45 = x / 10^4; y < 10^4: (y * 10486) >> 20 =
 * y / 100; z < 100: (z * 6554) >> 16 = z / 10, each checked over its whole
 * range), the remainder by a multiply and a subtraction, and the quotient
 * (the earlier digits) kept in the lane's low half, which comes first in
 * memory. */
static inline __m128i digit_values8x2(uint64_t first8, uint64_t second8) {
    __m128i x = _mm_set_epi64x((long long)second8, (long long)first8);
    __m128i high = _mm_srli_epi64(_mm_mul_epu32(x, _mm_set1_epi64x(3518437209)), 45);
    __m128i low = _mm_sub_epi64(x, _mm_mul_epu32(high, _mm_set1_epi64x(10000)));
    x = _mm_or_si128(high, _mm_slli_epi64(low, 32)); /* four 32-bit lanes below 10^4 */
    high = _mm_srli_epi16(_mm_mulhi_epu16(x, _mm_set1_epi32(10486)), 4);
    low = _mm_sub_epi16(x, _mm_mullo_epi16(high, _mm_set1_epi32(100)));
    x = _mm_or_si128(high, _mm_slli_epi32(low, 16)); /* eight 16-bit lanes below 100 */
    high = _mm_mulhi_epu16(x, _mm_set1_epi16(6554));
    low = _mm_sub_epi16(x, _mm_mullo_epi16(high, _mm_set1_epi16(10)));
    return _mm_or_si128(high, _mm_slli_epi16(low, 8));
}

static inline void digit_words8x2(uint32_t x, uint32_t y, uint64_t *wx, uint64_t *wy) {
    __m128i digits = digit_values8x2(x, y);
    *wx = (uint64_t)_mm_cvtsi128_si64(digits);
    *wy = (uint64_t)_mm_cvtsi128_si64(_mm_unpackhi_epi64(digits, digits));
}

/* Digits 1..16 of the 17-digit d17 whose first digit is `lead`. The
 * digits behind the point are on the critical path of every value (each
 * value's chain of dependent operations is long, and how many values the
 * core keeps in flight bounds the speed), so the two halves come straight
 * from d17, not from d17 less its lead (two divisions in a row). */
static inline digits16 split_digits16(uint64_t d17, uint64_t lead) {
    uint64_t high9 = d17 / 100000000, low8 = d17 - high9 * 100000000;
    uint64_t high8 = high9 - lead * 100000000;
    __m128i digits = digit_values8x2(high8, low8);
    unsigned zero = (unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(digits, _mm_setzero_si128()));
    unsigned nonzero = (~zero & 0xffff) << 1 | 1; /* bit i: digit i is not 0 */
    digits16 d;
    d.front = (uint64_t)_mm_cvtsi128_si64(digits);
    d.back = (uint64_t)_mm_cvtsi128_si64(_mm_unpackhi_epi64(digits, digits));
    d.significant = 32 - __builtin_clz(nonzero);
    return d;
}
#else
static inline void digit_words8x2(uint32_t x, uint32_t y, uint64_t *wx, uint64_t *wy) {
    *wx = digit_values8(x);
    *wy = digit_values8(y);
}

static inline digits16 split_digits16(uint64_t d17, uint64_t lead) {
    uint64_t high9 = d17 / 100000000;
    digits16 d;
    d.front = digit_values8((uint32_t)(high9 - lead * 100000000));
    d.back = digit_values8((uint32_t)(d17 - high9 * 100000000));
    int in_back = 17 - __builtin_clzll(d.back | 1) / 8, in_front = 9 - __builtin_clzll(d.front | 1) / 8;
    d.significant = d.back ? in_back : d.front ? in_front : 1;
    return d;
}
#endif

/* orjson's layout of a float: with E the exponent of the first significant
 * digit, plain for -5 <= E <= 15 ("0.00012", "12.5", "1500.0"), else
 * "d.ddde+E" / "de-E". The 17 digits are the first (`lead`, a character)
 * and two words of 8; each layout is a few overlapping 8-byte stores of
 * them, shifted in registers: nothing is stored in one width and read back
 * in another (such a load waits for the stores to drain, which once cost a
 * fifth of the time). */
/* A float's text from its parts: kind and sign; for FINITE, the first
 * digit (1..9), the other 16 as digit values (digits16) and the exponent E
 * of the first. Both conversions (decimal_of one value, convert8_avx512
 * eight) end here, so they share every layout. */
static inline __attribute__((always_inline)) char *write_parts(char *o, int kind, int negative,
                                                               uint64_t lead, digits16 rest,
                                                               int scientific) {
    if (__builtin_expect(kind != FINITE, 0)) {
        if (kind == NONE) {
            memcpy(o, "null", 4);
            return o + 4;
        }
        if (negative) *o++ = '-';
        memcpy(o, "0.0", 3);
        return o + 3;
    }
    if (negative) *o++ = '-';
    uint64_t front = rest.front | ASCII_ZEROS, back = rest.back | ASCII_ZEROS;
    int significant = rest.significant;
    lead |= '0';
    if (__builtin_expect(scientific == 0, 1)) { /* 1 <= |v| < 10: most logprobs */
        o[0] = (char)lead;
        o[1] = '.';
        store64(o + 2, front);
        store64(o + 10, back);
        return o + (significant > 1 ? significant + 1 : 3); /* "5.0": the zero is there */
    }
    if (scientific > 0 && scientific <= 15) {
        unsigned point = (unsigned)scientific + 1; /* digits before the point: 2..16 */
        uint64_t head = lead | front << 8;         /* digits 0-7 */
        if (point >= (unsigned)significant) {      /* an integer: the zeros are there */
            o[0] = (char)lead;
            store64(o + 1, front);
            store64(o + 9, back);
            memcpy(o + point, ".0", 2);
            return o + point + 2;
        }
        if (point < 8) { /* digits 0..point-1, '.', then digits point..16 */
            unsigned bits = 8 * point, after = bits - 8; /* after: 8..48 */
            store64(o, (head & ((UINT64_C(1) << bits) - 1)) | (UINT64_C(0x2e) << bits));
            store64(o + point + 1, front >> after | back << (64 - after));
            store64(o + point + 9, back >> after);
            return o + significant + 1;
        }
        /* point 8..15: digits 8..point-1 lie in `middle` (digits 8-15). */
        uint64_t middle = front >> 56 | back << 8;
        unsigned bits = 8 * (point - 8); /* 0..56 */
        store64(o, head);
        store64(o + 8, (bits ? middle & ((UINT64_C(1) << bits) - 1) : 0) | (UINT64_C(0x2e) << bits));
        if (point == 8) { /* digit 8 is the last of `front` */
            store64(o + 9, middle);
            o[17] = (char)(back >> 56);
        } else {
            store64(o + point + 1, back >> (8 * (point - 9))); /* digits point..16 */
        }
        return o + significant + 1;
    }
    if (scientific < 0 && scientific >= -5) {
        unsigned zeros = (unsigned)(-scientific - 1); /* 0..4 after "0." */
        memcpy(o, "0.000000", 8);
        o[2 + zeros] = (char)lead;
        store64(o + 3 + zeros, front);
        store64(o + 11 + zeros, back);
        return o + 2 + zeros + significant;
    }
    o[0] = (char)lead;
    if (significant > 1) {
        o[1] = '.';
        store64(o + 2, front);
        store64(o + 10, back);
        o += significant + 1;
    } else {
        o += 1;
    }
    o[0] = 'e';
    o[1] = scientific < 0 ? '-' : '+';
    unsigned magnitude = (unsigned)(scientific < 0 ? -scientific : scientific); /* <= 45 */
    if (magnitude >= 10) {
        memcpy(o + 2, rj_digit_pairs + 2 * magnitude, 2);
        return o + 4;
    }
    o[2] = (char)('0' + magnitude);
    return o + 3;
}

static inline __attribute__((always_inline)) char *write_decimal(char *o, decimal17 d) {
    if (__builtin_expect(d.kind != FINITE, 0)) {
        digits16 none = {0, 0, 0};
        return write_parts(o, d.kind, d.negative, 0, none, 0);
    }
    uint64_t lead = d.digits / UINT64_C(10000000000000000); /* 1..9 */
    return write_parts(o, FINITE, d.negative, lead, split_digits16(d.digits, lead), d.exponent);
}

static char *write_float(char *o, float value) {
    return write_decimal(o, decimal_of(value));
}

/* ------------------------------------------- eight floats at once (AVX-512)
 *
 * One thread's response time is mostly decimal_of: each value is a chain of
 * about sixty dependent operations (a 128-bit multiply, a remainder by 10,
 * selects, two divisions for the digits), and the core overlaps only a few
 * chains. convert8_avx512 runs the same arithmetic on eight values in the
 * lanes of 512-bit vectors, so eight chains cost about what one did; the
 * layout (write_parts) stays per value. It takes decimal_of's fast path
 * only: lanes whose value needs another (NaN, infinities, zeros,
 * subnormals, the extremes) are written from decimal_of by write_floats8. Both
 * paths are checked against each other over all 2^32 float32 patterns
 * (tests/exhaustive_float_json.py --against one-by-one), and the scalar one
 * against orjson.
 *
 * With v = m * 2^e, G from rj_scales split as G = G1 * 2^31 + G0 (31 bits
 * each, so every product is 32 x 32 bits, _mm512_mul_epu32), m * G =
 * A * 2^31 + B with A = m * G1 and B = m * G0, both below 2^55; decimal_of's
 * T = m * G * 2^31, so its integer part s = T >> 59 = 8A + (B >> 28) and
 * its fraction f = (B mod 2^28) << 31, exactly. */

typedef struct {
    /* Lanes in `laid_out`: the value's whole text from its leading comma
     * (",-4.123", at most 24 bytes) as three little-endian words, and its
     * length. */
    uint64_t text[3][8];
    uint64_t length[8];
    uint8_t laid_out;
    /* Lanes in `fast` (decimal_of's fast path) and not laid out: their
     * parts, for write_parts. The lanes outside `fast` (NaN, infinities,
     * zeros, subnormals, the extremes) are written from decimal_of. */
    uint8_t fast;
    uint64_t lead[8];   /* first digit, 1..9 */
    uint64_t front[8];  /* digits 1-8, as digits16 */
    uint64_t back[8];   /* digits 9-16 */
    int64_t significant[8];
    int64_t exponent[8];
    uint8_t negative[8];
} decimal8;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(SHM_JSON_SCALAR)
#define RJ_AVX512 1
#include <immintrin.h>

#define RJ_AVX512_TARGET __attribute__((target("avx512f,avx512dq,avx512bw,avx512cd,avx512vl")))

/* digit_values8 in each 64-bit lane (x < 10^8): the byte values of its
 * eight digits, the first in the lowest byte; the SSE2 digit_values8x2's
 * steps on eight lanes. */
RJ_AVX512_TARGET static inline __m512i digit_values8_avx512(__m512i x) {
    __m512i high = _mm512_srli_epi64(_mm512_mul_epu32(x, _mm512_set1_epi64(3518437209)), 45);
    __m512i low = _mm512_sub_epi64(x, _mm512_mul_epu32(high, _mm512_set1_epi64(10000)));
    x = _mm512_or_si512(high, _mm512_slli_epi64(low, 32)); /* 32-bit lanes below 10^4 */
    high = _mm512_srli_epi16(_mm512_mulhi_epu16(x, _mm512_set1_epi32(10486)), 4);
    low = _mm512_sub_epi16(x, _mm512_mullo_epi16(high, _mm512_set1_epi32(100)));
    x = _mm512_or_si512(high, _mm512_slli_epi32(low, 16)); /* 16-bit lanes below 100 */
    high = _mm512_mulhi_epu16(x, _mm512_set1_epi16(6554));
    low = _mm512_sub_epi16(x, _mm512_mullo_epi16(high, _mm512_set1_epi16(10)));
    return _mm512_or_si512(high, _mm512_slli_epi16(low, 8));
}

/* x mod 10 per lane, x below 2^58: x = h * 2^32 + l, and 2^32 = 6 (mod 10),
 * so x = 6h + (l mod 10) (mod 10), each step a 32 x 32-bit multiply by
 * ceil(2^35 / 10), exact below 2^32. */
RJ_AVX512_TARGET static inline __m512i mod10_avx512(__m512i x) {
    const __m512i magic = _mm512_set1_epi64(0xCCCCCCCD), ten = _mm512_set1_epi64(10);
    __m512i l = _mm512_and_si512(x, _mm512_set1_epi64(0xffffffff));
    __m512i lq = _mm512_srli_epi64(_mm512_mul_epu32(l, magic), 35);
    __m512i y = _mm512_add_epi64(_mm512_sub_epi64(l, _mm512_mul_epu32(lq, ten)),
                                 _mm512_mul_epu32(_mm512_srli_epi64(x, 32), _mm512_set1_epi64(6)));
    __m512i yq = _mm512_srli_epi64(_mm512_mul_epu32(y, magic), 35); /* y below 2^29 */
    return _mm512_sub_epi64(y, _mm512_mul_epu32(yq, ten));
}

/* values[0..7] into *out: decimal_of, then write_decimal's split, per lane. */
RJ_AVX512_TARGET static void convert8_avx512(const float *values, decimal8 *out) {
    const __m512i one = _mm512_set1_epi64((long long)ONE);
    __m512i bits = _mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i *)values));
    __m512i fraction = _mm512_and_si512(bits, _mm512_set1_epi64(0x7fffff));
    __m512i biased = _mm512_and_si512(_mm512_srli_epi64(bits, 23), _mm512_set1_epi64(0xff));
    __mmask8 regular = _mm512_test_epi64_mask(fraction, fraction);
    /* rj_scales[biased][fraction == 0]: 16-byte entries, g then {k, fast}. */
    __m512i index = _mm512_mask_add_epi64(_mm512_add_epi64(biased, biased), (__mmask8)~regular,
                                          _mm512_add_epi64(biased, biased), _mm512_set1_epi64(1));
    index = _mm512_add_epi64(index, index); /* in 8-byte words */
    const long long *table = (const long long *)(const void *)rj_scales;
    __m512i g = _mm512_i64gather_epi64(index, table, 8);
    __m512i kf = _mm512_i64gather_epi64(_mm512_add_epi64(index, _mm512_set1_epi64(1)), table, 8);
    __mmask8 fast = _mm512_test_epi64_mask(kf, _mm512_set1_epi64(0xff0000));
    __m512i k = _mm512_srai_epi64(_mm512_slli_epi64(kf, 48), 48);

    __m512i m = _mm512_or_si512(fraction, _mm512_set1_epi64(0x800000));
    __m512i a = _mm512_mul_epu32(m, _mm512_srli_epi64(g, 31));
    __m512i b = _mm512_mul_epu32(m, _mm512_and_si512(g, _mm512_set1_epi64(0x7fffffff)));
    __m512i s = _mm512_add_epi64(_mm512_slli_epi64(a, 3), _mm512_srli_epi64(b, 28));
    __m512i f = _mm512_slli_epi64(_mm512_and_si512(b, _mm512_set1_epi64(0xfffffff)), 31);
    __m512i above = _mm512_add_epi64(g, g);
    __m512i below = _mm512_mask_mov_epi64(g, regular, above);
    __m512i r = mod10_avx512(s);
    __m512i f_above = _mm512_add_epi64(f, above); /* below 2^59 + 2^63: no wrap */
    __mmask8 down10_in = _mm512_cmple_epu64_mask(_mm512_add_epi64(_mm512_slli_epi64(r, 59), f), below);
    __mmask8 up10_in = _mm512_cmple_epu64_mask(
        _mm512_slli_epi64(_mm512_sub_epi64(_mm512_set1_epi64(10), r), 59), f_above);
    __mmask8 s_in = _mm512_cmple_epu64_mask(f, below);
    __mmask8 t_in = _mm512_cmple_epu64_mask(one, f_above);
    __m512i half = _mm512_set1_epi64((long long)(ONE / 2));
    __mmask8 s_even = _mm512_testn_epi64_mask(s, _mm512_set1_epi64(1));
    __mmask8 s_closer = _mm512_cmplt_epu64_mask(f, half) | (_mm512_cmpeq_epi64_mask(f, half) & s_even);
    __mmask8 keep_s = s_in & ((__mmask8)~t_in | s_closer);
    __m512i s_down10 = _mm512_sub_epi64(s, r);
    __m512i digits = _mm512_mask_add_epi64(s, (__mmask8)~keep_s, s, _mm512_set1_epi64(1));
    digits = _mm512_mask_add_epi64(digits, up10_in, s_down10, _mm512_set1_epi64(10));
    digits = _mm512_mask_mov_epi64(digits, down10_in, s_down10);
    /* 16 digits made 17 (decimal_of's short16). */
    __mmask8 short16 = _mm512_cmplt_epu64_mask(digits, _mm512_set1_epi64((long long)rj_pow10[16]));
    digits = _mm512_mask_add_epi64(digits, short16, _mm512_slli_epi64(digits, 3),
                                   _mm512_slli_epi64(digits, 1));
    k = _mm512_mask_sub_epi64(k, short16, k, _mm512_set1_epi64(1));

    /* digits / 10^8 through a double (below 2^57: off by at most one, then
     * corrected by the remainder), then the first digit of that quotient
     * (below 10^9) by a multiply by ceil(2^57 / 10^8), exact below 2^30. */
    const __m512i e8 = _mm512_set1_epi64(100000000);
    __m512i q = _mm512_cvttpd_epu64(_mm512_mul_pd(_mm512_cvtepu64_pd(digits), _mm512_set1_pd(1e-8)));
    __m512i rest = _mm512_sub_epi64(digits, _mm512_mul_epu32(q, e8));
    __mmask8 under = _mm512_cmplt_epi64_mask(rest, _mm512_setzero_si512());
    q = _mm512_mask_sub_epi64(q, under, q, _mm512_set1_epi64(1));
    rest = _mm512_mask_add_epi64(rest, under, rest, e8);
    __mmask8 over = _mm512_cmpge_epi64_mask(rest, e8);
    q = _mm512_mask_add_epi64(q, over, q, _mm512_set1_epi64(1));
    rest = _mm512_mask_sub_epi64(rest, over, rest, e8);
    __m512i lead = _mm512_srli_epi64(_mm512_mul_epu32(q, _mm512_set1_epi64(1441151881)), 57);
    __m512i front = digit_values8_avx512(_mm512_sub_epi64(q, _mm512_mul_epu32(lead, e8)));
    __m512i back = digit_values8_avx512(rest);
    /* Significant digits: 17 less the trailing zero digits, which are the
     * words' high zero bytes. */
    __m512i in_back = _mm512_sub_epi64(_mm512_set1_epi64(17),
                                       _mm512_srli_epi64(_mm512_lzcnt_epi64(back), 3));
    __m512i in_front = _mm512_sub_epi64(_mm512_set1_epi64(9),
                                        _mm512_srli_epi64(_mm512_lzcnt_epi64(front), 3));
    __m512i significant = _mm512_mask_mov_epi64(_mm512_set1_epi64(1),
                                                _mm512_test_epi64_mask(front, front), in_front);
    significant = _mm512_mask_mov_epi64(significant, _mm512_test_epi64_mask(back, back), in_back);

    /* The plain layouts of -4 <= E <= 6 (0.00012 to 9999999.9, every
     * logprob in practice) as text words, per lane: the 17 digits as a
     * 136-bit string (X, first digit in the lowest byte), then for E >= 0
     * a '.' inserted after digit E ("4.123", "12.5", "1500.0": a digit
     * string whose tail is zeros keeps one of them after the point), for
     * E < 0 the digits moved up behind "0.000" (1 - E bytes); then the
     * whole moved up behind ',' or ",-". Bytes past the length are
     * overwritten by what follows (SHM_JSON_ROOM). */
    const __m512i zeros = _mm512_set1_epi64((long long)ASCII_ZEROS);
    __m512i x0 = _mm512_or_si512(_mm512_or_si512(lead, _mm512_set1_epi64('0')),
                                 _mm512_slli_epi64(_mm512_or_si512(front, zeros), 8));
    __m512i x1 = _mm512_or_si512(_mm512_srli_epi64(_mm512_or_si512(front, zeros), 56),
                                 _mm512_slli_epi64(_mm512_or_si512(back, zeros), 8));
    __m512i x2 = _mm512_srli_epi64(_mm512_or_si512(back, zeros), 56);
    __m512i e = _mm512_add_epi64(k, _mm512_set1_epi64(16));
    __mmask8 whole = _mm512_cmpge_epi64_mask(e, _mm512_setzero_si512()); /* E >= 0 */
    /* E >= 0: '.' after byte E (a shift of 8 (E + 1) bits, at most 56). */
    __m512i point = _mm512_slli_epi64(_mm512_add_epi64(e, _mm512_set1_epi64(1)), 3);
    __m512i below_point = _mm512_sub_epi64(_mm512_sllv_epi64(_mm512_set1_epi64(1), point),
                                           _mm512_set1_epi64(1));
    __m512i y0 = _mm512_or_si512(
        _mm512_or_si512(_mm512_and_si512(x0, below_point),
                        _mm512_sllv_epi64(_mm512_set1_epi64('.'), point)),
        _mm512_slli_epi64(_mm512_andnot_si512(below_point, x0), 8));
    __m512i y1 = _mm512_or_si512(_mm512_slli_epi64(x1, 8), _mm512_srli_epi64(x0, 56));
    __m512i y2 = _mm512_or_si512(_mm512_slli_epi64(x2, 8), _mm512_srli_epi64(x1, 56));
    __m512i digits_after = _mm512_max_epi64(significant, _mm512_add_epi64(e, _mm512_set1_epi64(2)));
    __m512i body = _mm512_add_epi64(digits_after, _mm512_set1_epi64(1));
    /* E < 0: the digits 1 - E bytes up, behind "0." and -E - 1 zeros. */
    __m512i up = _mm512_slli_epi64(_mm512_sub_epi64(_mm512_set1_epi64(1), e), 3); /* 16..40 */
    __m512i down = _mm512_sub_epi64(_mm512_set1_epi64(64), up);
    y0 = _mm512_mask_mov_epi64(
        _mm512_or_si512(_mm512_sllv_epi64(x0, up), _mm512_set1_epi64(0x3030303030302e30)),
        whole, y0);
    y1 = _mm512_mask_mov_epi64(
        _mm512_or_si512(_mm512_sllv_epi64(x1, up), _mm512_srlv_epi64(x0, down)), whole, y1);
    y2 = _mm512_mask_mov_epi64(
        _mm512_or_si512(_mm512_sllv_epi64(x2, up), _mm512_srlv_epi64(x1, down)), whole, y2);
    body = _mm512_mask_mov_epi64(_mm512_add_epi64(_mm512_srli_epi64(up, 3), significant), whole,
                                 body);
    /* Behind ',' (8 bits) or ",-" (16). */
    __m512i sign = _mm512_and_si512(_mm512_srli_epi64(bits, 31), _mm512_set1_epi64(1));
    __m512i lift = _mm512_slli_epi64(_mm512_add_epi64(sign, _mm512_set1_epi64(1)), 3);
    __m512i fall = _mm512_sub_epi64(_mm512_set1_epi64(64), lift);
    __m512i prefix = _mm512_or_si512(_mm512_set1_epi64(','),
                                     _mm512_slli_epi64(_mm512_mullo_epi64(sign, _mm512_set1_epi64('-')), 8));
    _mm512_storeu_si512(out->text[0], _mm512_or_si512(_mm512_sllv_epi64(y0, lift), prefix));
    _mm512_storeu_si512(out->text[1],
                        _mm512_or_si512(_mm512_sllv_epi64(y1, lift), _mm512_srlv_epi64(y0, fall)));
    _mm512_storeu_si512(out->text[2],
                        _mm512_or_si512(_mm512_sllv_epi64(y2, lift), _mm512_srlv_epi64(y1, fall)));
    _mm512_storeu_si512(out->length, _mm512_add_epi64(body, _mm512_add_epi64(sign, _mm512_set1_epi64(1))));
    out->laid_out = fast & _mm512_cmpge_epi64_mask(e, _mm512_set1_epi64(-4)) &
                    _mm512_cmple_epi64_mask(e, _mm512_set1_epi64(6));

    _mm512_storeu_si512(out->lead, lead);
    _mm512_storeu_si512(out->front, front);
    _mm512_storeu_si512(out->back, back);
    _mm512_storeu_si512(out->significant, significant);
    _mm512_storeu_si512(out->exponent, _mm512_add_epi64(k, _mm512_set1_epi64(16)));
    _mm_storel_epi64((__m128i *)out->negative,
                     _mm512_cvtepi64_epi8(_mm512_srli_epi64(bits, 31)));
    out->fast = fast;
}

/* Ids the same way: eight at a time, each below 10^7 (every vocabulary in
 * use) as one word "1234567," with its length; larger or negative ones
 * through write_int. */
typedef struct {
    uint64_t text[8];
    uint64_t length[8];
    uint8_t laid_out;
} ints8;

RJ_AVX512_TARGET static void convert_ints8_avx512(const int32_t *values, ints8 *out) {
    __m512i x = _mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i *)values));
    out->laid_out = _mm512_cmplt_epu64_mask(x, _mm512_set1_epi64(10000000));
    __m512i digits = digit_values8_avx512(x);
    /* The leading zero digits are the word's low zero bytes (write_word_comma);
     * 0 keeps its one digit. */
    __m512i marked = _mm512_or_si512(digits, _mm512_set1_epi64((long long)(UINT64_C(1) << 56)));
    __m512i lowest = _mm512_and_si512(marked, _mm512_sub_epi64(_mm512_setzero_si512(), marked));
    __m512i zeros = _mm512_and_si512(
        _mm512_sub_epi64(_mm512_set1_epi64(63), _mm512_lzcnt_epi64(lowest)), _mm512_set1_epi64(56));
    __m512i text = _mm512_srlv_epi64(_mm512_or_si512(digits, _mm512_set1_epi64((long long)ASCII_ZEROS)),
                                     zeros);
    text = _mm512_or_si512(text, _mm512_sllv_epi64(_mm512_set1_epi64(','),
                                                   _mm512_sub_epi64(_mm512_set1_epi64(64), zeros)));
    _mm512_storeu_si512(out->text, text);
    _mm512_storeu_si512(out->length, _mm512_sub_epi64(_mm512_set1_epi64(9), _mm512_srli_epi64(zeros, 3)));
}

/* `blocks` blocks of eight values through convert8_avx512, then laid out
 * one by one, each preceded by a comma; returns the end of the text. */
RJ_AVX512_TARGET static char *write_floats8(char *o, const float *values, uint64_t blocks) {
    decimal8 d;
    for (uint64_t b = 0; b < blocks; b++) {
        convert8_avx512(values + 8 * b, &d);
        for (int i = 0; i < 8; i++) {
            if (__builtin_expect((d.laid_out >> i) & 1, 1)) {
                store64(o, d.text[0][i]);
                store64(o + 8, d.text[1][i]);
                store64(o + 16, d.text[2][i]);
                o += d.length[i];
                continue;
            }
            *o++ = ',';
            if (!((d.fast >> i) & 1)) {
                o = write_decimal(o, decimal_of(values[8 * b + i]));
                continue;
            }
            digits16 rest = {d.front[i], d.back[i], (int)d.significant[i]};
            o = write_parts(o, FINITE, d.negative[i], d.lead[i], rest, (int)d.exponent[i]);
        }
    }
    return o;
}
#endif

/* `count` floats, each preceded by a comma except the very first when
 * `comma_first` is 0: eight at a time where the CPU has AVX-512. */
static char *write_floats(char *o, const float *values, uint64_t count, int comma_first) {
    if (!count) return o;
    if (comma_first) *o++ = ',';
    o = write_decimal(o, decimal_of(values[0]));
    uint64_t i = 1;
#ifdef RJ_AVX512
    if (count - 1 >= 8 && shm_avx512()) {
        uint64_t blocks = (count - 1) / 8;
        o = write_floats8(o, values + 1, blocks);
        i += 8 * blocks;
    }
#endif
    for (; i < count; i++) {
        *o++ = ',';
        o = write_decimal(o, decimal_of(values[i]));
    }
    return o;
}

static char *write_int(char *o, int32_t value) {
    uint32_t magnitude = (uint32_t)value;
    if (value < 0) {
        *o++ = '-';
        magnitude = 0u - magnitude;
    }
    if (magnitude < 10) { /* also 0, which decimal_digits does not take */
        *o = (char)('0' + magnitude);
        return o + 1;
    }
    int n = decimal_digits(magnitude);
    if (n <= 8) { /* the eight-digit word without its leading zeros */
        uint64_t word = (digit_values8(magnitude) | ASCII_ZEROS) >> (8 * (8 - n));
        memcpy(o, &word, 8);
        return o + n;
    }
    uint32_t top = magnitude / 100000000; /* 9 or 10 digits: 1 or 2 first */
    uint64_t word = digit_values8(magnitude - top * 100000000) | ASCII_ZEROS;
    if (top >= 10) {
        memcpy(o, rj_digit_pairs + 2 * top, 2);
        memcpy(o + 2, &word, 8);
        return o + 10;
    }
    *o = (char)('0' + top);
    memcpy(o + 1, &word, 8);
    return o + 9;
}

/* An int below 10^8 and a comma, from the word of its eight digits
 * (leading zeros included): the leading zero digits are the word's low
 * zero bytes, dropped with one shift (0 keeps one). */
static inline char *write_word_comma(char *o, uint64_t digits) {
    unsigned zeros = (unsigned)__builtin_ctzll(digits | (UINT64_C(1) << 56)) & 56;
    store64(o, (digits | ASCII_ZEROS) >> zeros);
    o[8 - zeros / 8] = ',';
    return o + 9 - zeros / 8;
}

#ifdef RJ_AVX512
/* Blocks of eight ids through convert_ints8_avx512, each followed by a comma;
 * the ids off the fast path are OR-ed into *signs (write_ints_comma). */
RJ_AVX512_TARGET static char *write_ints8(char *o, const int32_t *values, uint64_t blocks,
                                          uint32_t *signs) {
    ints8 d;
    for (uint64_t b = 0; b < blocks; b++) {
        convert_ints8_avx512(values + 8 * b, &d);
        for (int i = 0; i < 8; i++) {
            if (__builtin_expect((d.laid_out >> i) & 1, 1)) {
                store64(o, d.text[i]);
                o += d.length[i];
                continue;
            }
            *signs |= (uint32_t)values[8 * b + i];
            o = write_int(o, values[8 * b + i]);
            *o++ = ',';
        }
    }
    return o;
}
#endif

/* `count` ints, each followed by a comma. Ids are below 10^8: their
 * digits are made two at a time (one vector for both on x86-64). A
 * negative id is written, and its sign bit OR-ed into *signs: only ids
 * off the fast path are OR-ed (every negative one is), so the check costs
 * the usual row nothing. */
static char *write_ints_comma(char *o, const int32_t *values, uint64_t count, uint32_t *signs) {
    uint64_t i = 0;
#ifdef RJ_AVX512
    if (count >= 8 && shm_avx512()) {
        o = write_ints8(o, values, count / 8, signs);
        i = count / 8 * 8;
    }
#endif
    for (; i + 1 < count; i += 2) {
        uint32_t x = (uint32_t)values[i], y = (uint32_t)values[i + 1];
        if (__builtin_expect((x | y) < (1u << 26) || (x < 100000000 && y < 100000000), 1)) {
            uint64_t wx, wy;
            digit_words8x2(x, y, &wx, &wy);
            o = write_word_comma(o, wx);
            o = write_word_comma(o, wy);
        } else { /* negative or 9 digits and more */
            *signs |= x | y;
            o = write_int(o, values[i]);
            *o++ = ',';
            o = write_int(o, values[i + 1]);
            *o++ = ',';
        }
    }
    if (i < count) {
        *signs |= (uint32_t)values[i];
        o = write_int(o, values[i]);
        *o++ = ',';
    }
    return o;
}

/* Per-row and per-entry bounds of each field; a row's own bytes include its
 * leading comma. */
#define ROW_BYTES 5 /* ",[]" or ",null" */
#define ID_BYTES (SHM_JSON_INT_BYTES + 1)
#define FLOAT_BYTES (SHM_JSON_FLOAT_BYTES + 1)
#define COUNT_LIMIT (UINT64_C(1) << 56) /* rows or entries: every bound below 2^62 */

int shm_json_float(float value, char *out) {
    return (int)(write_float(out, value) - out);
}

int64_t shm_json_floats(const float *values, uint64_t count, char *out, uint64_t out_capacity) {
    if (count > (UINT64_C(1) << 58) || out_capacity < 2 + count * FLOAT_BYTES + SHM_JSON_ROOM)
        return SHM_JSON_E_CAPACITY;
    char *o = out;
    *o++ = '[';
    o = write_floats(o, values, count, 0);
    *o++ = ']';
    return (int64_t)(o - out);
}

/* ------------------------------------------------------------- the rows */


/* The bytes of each field's rows (not its brackets); 0 past COUNT_LIMIT. */
static int field_bounds(int support, uint64_t rows, uint64_t entries, uint64_t bound[3]) {
    if (rows > COUNT_LIMIT || entries > COUNT_LIMIT) return 0;
    bound[0] = rows * ROW_BYTES + entries * ID_BYTES;
    bound[1] = support ? rows * ROW_BYTES + entries * FLOAT_BYTES : rows * FLOAT_BYTES;
    bound[2] = rows * ID_BYTES;
    return 1;
}

/* Slack after each part of each field (see SHM_JSON_ROOM). */
#define PARTS_SLACK (3 * SHM_JSON_MAX_THREADS * SHM_JSON_ROOM)

uint64_t shm_json_rows_bound(int support, uint64_t rows, uint64_t entries) {
    uint64_t bound[3];
    if (!field_bounds(support, rows, entries, bound)) return 0;
    return bound[0] + bound[1] + bound[2] + 6 + PARTS_SLACK; /* + three pairs of brackets */
}

typedef struct {
    int support;
    const int32_t *lengths;
    const uint8_t *flags;
    const int32_t *ids;
    const float *logprobs;
} rows_job;

typedef struct {
    const rows_job *job;
    uint64_t first_row, end_row, first_entry, end_entry;
    char *out[3];      /* where this part writes each field */
    uint64_t written[3];
    uint32_t signs; /* ids off the fast path OR-ed: bit 31 set by a negative id */
} rows_part;

static inline int row_ok(const rows_job *job, uint64_t row) {
    return !job->flags || !(job->flags[row] & 3);
}

static void write_part(rows_part *part) {
    const rows_job *job = part->job;
    char *ids_out = part->out[0], *logprobs_out = part->out[1], *lengths_out = part->out[2];
    uint64_t entry = part->first_entry;
    for (uint64_t row = part->first_row; row < part->end_row; row++) {
        if (row) {
            *ids_out++ = ',';
            *logprobs_out++ = ',';
            *lengths_out++ = ',';
        }
        if (!row_ok(job, row)) {
            memcpy(ids_out, "null", 4);
            ids_out += 4;
            memcpy(logprobs_out, "null", 4);
            logprobs_out += 4;
            memcpy(lengths_out, "null", 4);
            lengths_out += 4;
            continue;
        }
        /* Read once and kept within this part's entries: the spans were
         * sized from the lengths as checked, and stay respected even if
         * someone rewrote the lengths meanwhile. */
        int32_t declared = job->lengths[row];
        uint64_t length = declared < 0 ? 0 : (uint64_t)declared;
        if (length > part->end_entry - entry) length = part->end_entry - entry;
        lengths_out = write_int(lengths_out, (int32_t)length);
        *ids_out++ = '[';
        ids_out = write_ints_comma(ids_out, job->ids + entry, length, &part->signs);
        if (length) ids_out--; /* the last comma becomes the "]" */
        *ids_out++ = ']';
        if (job->support) {
            *logprobs_out++ = '[';
            logprobs_out = write_floats(logprobs_out, job->logprobs + entry, length, 0);
            *logprobs_out++ = ']';
        } else {
            logprobs_out = write_float(logprobs_out, job->logprobs[row]);
        }
        entry += length;
    }
    part->written[0] = (uint64_t)(ids_out - part->out[0]);
    part->written[1] = (uint64_t)(logprobs_out - part->out[1]);
    part->written[2] = (uint64_t)(lengths_out - part->out[2]);
}

/* The pool's task: part `index` of the parts array. */
static void write_part_task(void *parts, uint64_t index) { write_part((rows_part *)parts + index); }

/* Entries (plus one per row) a thread is worth starting for: below this a
 * thread's start costs more than it saves. */
#define WORK_PER_THREAD 4096

int shm_json_rows(int support, const int32_t *lengths, const uint8_t *flags, uint64_t rows,
                  const int32_t *ids, uint64_t ids_count, const float *logprobs,
                  uint64_t logprobs_count, int threads, char *out, uint64_t out_capacity,
                  uint64_t *spans, int *parts_out) {
    support = support != 0;
    if (rows > COUNT_LIMIT) return SHM_JSON_E_CAPACITY;
    /* Every count first: nothing is read from ids or logprobs past them. */
    uint64_t entries = 0;
    for (uint64_t row = 0; row < rows; row++) {
        int32_t length = lengths[row];
        if (length < 0) return SHM_JSON_E_ROWS;
        if (length && flags && (flags[row] & 3)) return SHM_JSON_E_ROWS;
        entries += (uint64_t)length; /* below 2^56 * 2^31: no wrap */
    }
    if (entries != ids_count || logprobs_count != (support ? entries : rows)) return SHM_JSON_E_ROWS;
    uint64_t bound[3];
    if (!field_bounds(support, rows, entries, bound)) return SHM_JSON_E_CAPACITY;
    if (out_capacity < shm_json_rows_bound(support, rows, entries)) return SHM_JSON_E_CAPACITY;

    rows_job job = {support, lengths, flags, ids, logprobs};
    uint64_t work = entries + rows;
    uint64_t parts = shm_pool_tasks(threads, work, WORK_PER_THREAD);
    if (parts > SHM_JSON_MAX_THREADS) parts = SHM_JSON_MAX_THREADS; /* the spans' room */
    if (parts > rows) parts = rows ? rows : 1; /* a part takes whole rows: no empty parts */

    /* Each field's region starts with its "[" and holds every part's span
     * plus its slack; parts take consecutive rows of about equal work and
     * write each field into their own span, sized by their own bounds. */
    rows_part part[SHM_JSON_MAX_THREADS];
    uint64_t slack = SHM_JSON_MAX_THREADS * SHM_JSON_ROOM;
    char *region[3] = {out, out + bound[0] + slack + 2, out + bound[0] + bound[1] + 2 * slack + 4};
    char *cursor[3] = {region[0] + 1, region[1] + 1, region[2] + 1};
    for (int f = 0; f < 3; f++) region[f][0] = '[';
    uint64_t row = 0, entry = 0, done = 0;
    for (uint64_t i = 0; i < parts; i++) {
        uint64_t target = work * (i + 1) / parts, first_row = row, first_entry = entry;
        while (row < rows && (done < target || i + 1 == parts)) {
            /* As checked above; clamped all the same (see write_part). */
            int32_t declared = lengths[row];
            uint64_t length = declared < 0 ? 0 : (uint64_t)declared;
            if (length > entries - entry) length = entries - entry;
            entry += length;
            done += length + 1;
            row++;
        }
        uint64_t own[3];
        field_bounds(support, row - first_row, entry - first_entry, own);
        part[i] = (rows_part){&job, first_row, row, first_entry, entry,
                              {cursor[0], cursor[1], cursor[2]}, {0, 0, 0}, 0};
        for (int f = 0; f < 3; f++) cursor[f] += own[f] + SHM_JSON_ROOM;
    }

    shm_pool_run(write_part_task, part, parts);
    /* Ids are non-negative int32 wherever rows enter (the writer, the
     * reader's checks); arrays handed here directly are held to it too. */
    for (uint64_t i = 0; i < parts; i++)
        if (part[i].signs >> 31) return SHM_JSON_E_ROWS;

    /* Each part's span of each field, the field's "[" before the first and
     * its "]" after the last (in the slack after that part). */
    for (int f = 0; f < 3; f++) {
        for (uint64_t i = 0; i < parts; i++) {
            uint64_t *span = spans + 2 * (f * SHM_JSON_MAX_THREADS + i);
            span[0] = (uint64_t)(part[i].out[f] - out);
            span[1] = part[i].written[f];
        }
        spans[2 * (f * SHM_JSON_MAX_THREADS)] -= 1;
        spans[2 * (f * SHM_JSON_MAX_THREADS) + 1] += 1;
        part[parts - 1].out[f][part[parts - 1].written[f]] = ']';
        spans[2 * (f * SHM_JSON_MAX_THREADS + parts - 1) + 1] += 1;
    }
    *parts_out = (int)parts;
    return 0;
}

/* ------------------------------------------------------------ the gather */

/* Bytes of output a gather thread is worth starting for. */
#define GATHER_PER_THREAD (128u << 10)

typedef struct {
    char *out;
    const char *const *sources;
    const uint64_t *lengths;
    uint64_t count, total, parts;
} gather_job;

/* Part `index`: output bytes [total * index / parts, total * (index + 1) /
 * parts), their pages mapped in one call when few tasks run (shmask_pool.h),
 * then copied from whichever pieces they hold. */
static void gather_part(void *context, uint64_t index) {
    const gather_job *job = context;
    uint64_t begin = (uint64_t)((u128)job->total * index / job->parts);
    uint64_t end = (uint64_t)((u128)job->total * (index + 1) / job->parts);
    shm_pool_prefault(job->out + begin, job->out + end); /* only while few threads write */
    uint64_t at = 0;
    for (uint64_t i = 0; i < job->count && at < end; i++) {
        uint64_t from = at, to = at + job->lengths[i];
        at = to;
        if (to <= begin) continue;
        uint64_t lo = from > begin ? from : begin, hi = to < end ? to : end;
        memcpy(job->out + lo, job->sources[i] + (lo - from), hi - lo);
    }
}

int shm_json_gather(char *out, uint64_t out_length, const char *const *sources,
                    const uint64_t *lengths, uint64_t count, int threads) {
    uint64_t total = 0;
    for (uint64_t i = 0; i < count; i++) {
        if (lengths[i] > out_length - total) return SHM_JSON_E_CAPACITY;
        total += lengths[i];
    }
    if (total != out_length) return SHM_JSON_E_CAPACITY;
    gather_job job = {out, sources, lengths, count, total,
                      shm_pool_tasks(threads, total, GATHER_PER_THREAD)};
    shm_pool_run(gather_part, &job, job.parts);
    return 0;
}
