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
 * multiples of 10^k around v. What differs from the paper: the scaled
 * bounds u, v, w / 10^k are computed EXACTLY (v's 24 significant bits times
 * 5^p fit 256 bits over the whole float32 range), not from a rounded table
 * of powers of ten, so no error analysis is needed; it costs one 64x64-bit
 * multiply per bound for the usual range of logprobs (|v| >= 1e-11).
 *
 * A scaled bound Y is kept as floor(Y), or floor(Y) | 1 when Y is not an
 * integer ("round to odd"): compared with an even integer N that answers
 * Y <= N, N <= Y and Y == N exactly, and every comparison below is with
 * 4 * an integer (the bounds are taken 4 times, 4u = (4c - 2) 2^q, so that
 * they are integers times 2^q).
 */
#include "response_json.h"

#include <pthread.h>
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

/* x * 2^-drop rounded to odd, 0 < drop < 64, the result below 2^64. */
static inline uint64_t shift_round_odd(u128 x, unsigned drop) {
    uint64_t low = (uint64_t)x, high = (uint64_t)(x >> 64);
    return (low >> drop | high << (64 - drop)) | ((low << (64 - drop)) != 0);
}

/* The general path of shortest_decimal: any positive finite float32. */
__attribute__((noinline)) static void general_bounds(uint32_t bits, int *exponent,
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

/* The shortest-then-closest decimal of a positive finite float32 value:
 * returns its digits, *exponent its power of ten (trailing zeros may be
 * left: the caller drops them). */
static inline __attribute__((always_inline)) uint64_t shortest_decimal(uint32_t bits,
                                                                       int *exponent) {
    uint32_t fraction = bits & 0x7fffff;
    const rj_scale *scale = &rj_scales[bits >> 23][fraction == 0];
    uint64_t low, mid, high;
    if (scale->fast) {
        /* A normal value of the usual range (about 1e-8 to 1e7): c = m *
         * 2^29, one multiply by 4 * 5^p, the bounds 2 * 5^p away (1 * 5^p
         * below a power of two), one shift (all from the generated table). */
        uint64_t c = (uint64_t)(fraction | 0x800000) << 29;
        u128 centre = (u128)c * scale->five4;
        uint64_t half = scale->five4 >> 1;
        unsigned drop = scale->drop;
        low = shift_round_odd(centre - (fraction ? half : half >> 1), drop);
        mid = shift_round_odd(centre, drop);
        high = shift_round_odd(centre + half, drop);
        *exponent = scale->k;
    } else {
        general_bounds(bits, exponent, &low, &mid, &high);
    }

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

static inline __attribute__((always_inline)) decimal17 decimal_of(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    decimal17 d = {0, 0, (uint8_t)(bits >> 31), FINITE};
    if (((bits >> 23) & 0xff) == 0xff) {
        d.kind = NONE;
    } else if (!(bits & 0x7fffffff)) {
        d.kind = ZERO;
    } else {
        int k;
        uint64_t digits = shortest_decimal(bits & 0x7fffffff, &k);
        /* 16 or 17 digits (v / 10^k >= c >= 2^52 > 10^15), 18 only for a
         * multiple of 10 (17 significant digits always suffice): made 17. */
        int short16 = digits < rj_pow10[16], long18 = digits >= rj_pow10[17];
        digits = short16 ? digits * 10 : long18 ? digits / 10 : digits;
        k += long18 - short16;
        d.digits = digits;
        d.exponent = k + 16;
    }
    return d;
}

/* orjson's layout of a float: with E the exponent of the first significant
 * digit, plain for -5 <= E <= 15 ("0.00012", "12.5", "1500.0"), else
 * "d.ddde+E" / "de-E". The 17 digits are made in registers, in words
 * `high` (digits 0-7), `low` (8-15) and `last` (16); each layout is a few
 * stores of them. */
static inline __attribute__((always_inline)) char *write_decimal(char *o, decimal17 d) {
    if (d.kind == NONE) {
        memcpy(o, "null", 4);
        return o + 4;
    }
    if (d.negative) *o++ = '-';
    if (d.kind == ZERO) {
        memcpy(o, "0.0", 3);
        return o + 3;
    }
    int scientific = d.exponent;
    uint32_t first8 = (uint32_t)(d.digits / 1000000000);
    uint32_t rest9 = (uint32_t)(d.digits - (uint64_t)first8 * 1000000000);
    uint32_t next8 = rest9 / 10;
    uint64_t high = digit_values8(first8), low = digit_values8(next8);
    char last = (char)('0' + rest9 - next8 * 10);
    /* Significant digits: 17 less the trailing zeros (digit 0 is nonzero). */
    int significant;
    if (last != '0')
        significant = 17;
    else if (low)
        significant = 16 - __builtin_clzll(low) / 8;
    else
        significant = 8 - __builtin_clzll(high) / 8;
    high |= ASCII_ZEROS;
    low |= ASCII_ZEROS;
    u128 all16 = (u128)high | ((u128)low << 64); /* digits 0-15 as 16 bytes */
    if (scientific >= 0 && scientific <= 15) {
        int point = scientific + 1; /* digits before the point: 1..16 */
        memcpy(o, &all16, 16);
        if (point >= significant) { /* an integer: the zeros are already there */
            memcpy(o + point, ".0", 2);
            return o + point + 2;
        }
        /* Digits point..16 go one byte right, after the point; digit 16
         * then lands at 17 whatever the point. */
        u128 after = all16 >> (8 * point);
        memcpy(o + point + 1, &after, 16);
        o[point] = '.';
        o[17] = last;
        return o + significant + 1;
    }
    if (scientific < 0 && scientific >= -5) {
        int zeros = -scientific - 1; /* 0..4 after "0." */
        memcpy(o, "0.000000", 8);
        memcpy(o + 2 + zeros, &all16, 16);
        o[18 + zeros] = last;
        return o + 2 + zeros + significant;
    }
    o[0] = (char)high;
    if (significant > 1) {
        u128 after = all16 >> 8;
        o[1] = '.';
        memcpy(o + 2, &after, 16);
        o[17] = last;
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

static char *write_float(char *o, float value) {
    return write_decimal(o, decimal_of(value));
}

#define BATCH 64

/* `count` floats, each preceded by a comma except the very first when
 * `comma_first` is 0. */
static char *write_floats(char *o, const float *values, uint64_t count, int comma_first) {
    decimal17 batch[BATCH];
    for (uint64_t done = 0; done < count; done += BATCH) {
        uint64_t n = count - done < BATCH ? count - done : BATCH;
        for (uint64_t i = 0; i < n; i++) batch[i] = decimal_of(values[done + i]);
        for (uint64_t i = 0; i < n; i++) {
            if (done + i || comma_first) *o++ = ',';
            o = write_decimal(o, batch[i]);
        }
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
        for (uint64_t i = 0; i < length; i++) {
            ids_out = write_int(ids_out, job->ids[entry + i]);
            *ids_out++ = ',';
        }
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

static void *write_part_thread(void *part) {
    write_part(part);
    return NULL;
}

/* Entries (plus one per row) a thread is worth starting for: below this a
 * thread's start costs more than it saves. */
#define WORK_PER_THREAD 4096

int shm_json_rows(int support, const int32_t *lengths, const uint8_t *flags, uint64_t rows,
                  const int32_t *ids, uint64_t ids_count, const float *logprobs,
                  uint64_t logprobs_count, int threads, char *out, uint64_t out_capacity,
                  uint64_t *written) {
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
    uint64_t parts = threads < 1 ? 1 : threads > SHM_JSON_MAX_THREADS ? SHM_JSON_MAX_THREADS
                                                                         : (uint64_t)threads;
    if (parts > work / WORK_PER_THREAD) parts = work / WORK_PER_THREAD ? work / WORK_PER_THREAD : 1;

    /* Each field's region starts with its "[" and holds every part's span
     * plus its slack; parts take consecutive rows of about equal work and
     * write each field into their own span, sized by their own bounds. */
    rows_part part[SHM_JSON_MAX_THREADS];
    uint64_t slack = SHM_JSON_MAX_THREADS * SHM_JSON_ROOM;
    char *region[3] = {out, out + bound[0] + slack + 2, out + bound[0] + bound[1] + 2 * slack + 4};
    char *cursor[3] = {region[0] + 1, region[1] + 1, region[2] + 1};
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
                              {cursor[0], cursor[1], cursor[2]}, {0, 0, 0}};
        for (int f = 0; f < 3; f++) cursor[f] += own[f] + SHM_JSON_ROOM;
    }

    /* The first part on this thread; a thread that cannot start leaves its
     * part to this one too. */
    pthread_t thread[SHM_JSON_MAX_THREADS];
    int started[SHM_JSON_MAX_THREADS] = {0};
    for (uint64_t i = 1; i < parts; i++)
        started[i] = pthread_create(&thread[i], NULL, write_part_thread, &part[i]) == 0;
    write_part(&part[0]);
    for (uint64_t i = 1; i < parts; i++) {
        if (started[i])
            pthread_join(thread[i], NULL);
        else
            write_part(&part[i]);
    }

    /* Close the gaps: each field's parts, then the fields, moved down to
     * follow each other (memmove: a destination never passes its source). */
    char *o = out;
    for (int f = 0; f < 3; f++) {
        char *start = o;
        *o++ = '[';
        for (uint64_t i = 0; i < parts; i++) {
            memmove(o, part[i].out[f], part[i].written[f]);
            o += part[i].written[f];
        }
        *o++ = ']';
        written[f] = (uint64_t)(o - start);
    }
    return 0;
}
