"""Tuning constants of compaction's and capture's kernels, in one place.

Each sets how work is shared out (columns a program, warps, registers) or
how close capture's sampled estimates start (margins, pivots), and
resolve checks every estimate exactly: rows stay exact under any value.
Their last bits need not: a window row's Z is a float32 sum grouped by
its bracket (the mass above it, then the ids in it) and its top-p target
is met by a float32 subtraction of that mass, and the bracket follows the
sample's estimate, whose sums' order follows the bound's warps; a row
resolved from its whole row sums Z over candidates that start at the
floor its passes found (their sums' order follows FLOOR_* and the
passes' tile, which differs between a call that may have window rows and
one that cannot: FLOOR_LOADS_NO_WINDOW). So a constant can move such a
row's logprobs by an ulp, or a cutoff within float32 rounding of its
target to the next key (benchmarks/RESULTS.md,
"The stages, the decode loop with top-p-only rows, the replay at fp32").
Every path of one configuration gives the same bits. The
launchers read them at each call (``tuning.NAME``), so a test may shrink
one to reach a rare path on a small input. The measurements behind the
values (H200, Triton 3.6) are in benchmarks/kernels_notes.md.
"""

from __future__ import annotations

import triton.language as tl

# ---------------------------------------------------------------- shared
CHUNK = 8192  # columns per mark program: 32 KiB of fp32 read each, bitmask words of 32 bits
EXPAND_WORDS = 256  # bitmask words per expand program (8192 columns)
EXPAND_WARPS = 8

# ------------------------------------------------------------ compaction
MARK_WARPS = 4
SCAN_WARPS = 8
# the scan takes a tile of rows x chunk counts a step: up to 16384 counts
# (a batch of 512 rows at V = 151936 in one step)
SCAN_TILE = 16384

# ----------------------------------------------------------- capture: bound
# The bound samples SAMPLE_BLOCKS blocks of SAMPLE_COLS contiguous columns
# spread evenly over each row (the whole row when V is at most their total)
# and sets each row's candidate range from them; resolve verifies it
# exactly, and a row whose estimate was wrong is resolved from its whole row.
SAMPLE_BLOCKS = 8
SAMPLE_COLS = 1024
# the sample's largest value, untied, counts once in its mass estimates (as
# the only one of its size in the row), not 1/share times. The H200 probe
# of the top 1, 2 or 4 values: 1 best (more discount typical top values too)
SAMPLE_HEAVY = True
# top-k: the floor keeps >= K_SLACK * k / scale + 3 sqrt(k / scale) + 4
# sampled ids above it (scale: the sample's share of the row)
K_SLACK = 1.25
# A row with top-k at most K_FLOOR_ONLY takes top-k's floor alone (not a
# higher top-p floor): K_SLACK x k ids and their slack fit in RESOLVE_BLOCK
K_FLOOR_ONLY = 2048
# top-p: the floor is where the sampled mass share reaches top_p + P_MARGIN;
# a window row's range is [top_p - P_MARGIN, top_p + P_MARGIN]
P_MARGIN = 0.05
# a top-p-only row's floor also keeps P_KEEP ids by the sample's count (a
# sample that holds a heavy token over-weighs it; resolve holds RESOLVE_BLOCK).
# At 2048 a top_p 0.99 row of a few thousand ids was misled now and then
# (2 rows in 1,024 on fp32 s5, benchmarks/bound_misled.py), each costing the
# call its whole-row passes (~130-180 us of one program); on the H100's
# sweep, capture top_p 0.99 on bf16 s5 2048 / 2560 / 3072: 435.6 / 399.0 /
# 363.9 us, the peaked rows' (bf16 s8 top_p 0.9; more candidates) 144.0 /
# 146.3 / 149.4.
P_KEEP = 3072
# The bound's bisection settles the first BOUND_BITS of bits 30..0 of a key
# (the exponent and 8 mantissa bits: within 0.4% of the value, all an
# estimate with margins needs); BOUND_STEP is one unit of the last.
BOUND_BITS = tl.constexpr(16)
BOUND_STEP = tl.constexpr(1 << (31 - 16))
BOUND_WARPS = 8
BOUND_WINDOW_WARPS = 4  # a call that may have window rows (three searches a row)

# ------------------------------------------------- capture: candidate mark
CAND_MARK_WARPS = 16
CAND_MARK_WINDOW_WARPS = 8  # with window rows: WINDOW_PIVOTS sums an element

# ---------------------------------------------------- capture: window rows
# A top-p row (top-k off) is a window row when the sample puts its support
# past WINDOW_MIN ids: more than resolve holds in registers (RESOLVE_BLOCK),
# where a row's candidates get slow and a sample that missed its cutoff
# costs the whole-row fallback. A window row's cutoff never falls back.
WINDOW_MIN = 4096
# Its candidate mark sums the mass above WINDOW_PIVOTS keys placed around the
# sampled estimate of its top-p cutoff, in hundredths of the width s of its
# sampled range: PIVOTS - 2 evenly over the estimate +- h, one WINDOW_BELOW
# under it and one WINDOW_ABOVE over it. The cutoff lies between two of them
# (the bracket), and every id in the bracket is a candidate of resolve: the
# inner span keeps brackets small, the outer two keep a sample that missed
# bounded. h is the row's own: the standard error of the sample's estimate
# of the top-p share (s spans about 2 x P_MARGIN of the mass), within
# [WINDOW_INNER_MIN, WINDOW_INNER_MAX] (capture_bound._inner_span). The
# H100, B 256, the sweep's 15 distributions at one h for all rows (15 / 20 /
# 30 / 40), capture us: flat rows (fp32 s1 top_p 0.9, sample share error
# ~0.005) 323.6 / 327.2 / 349.5 / 356.4, fp32 s2 top_p 0.99 356.8 / 380.0 /
# 396.9 / 436.0; rows of few heavy ids (bf16 s3 top_p 0.9, ~0.05: a narrow
# h misses, 185 / 149 / 90 / 58 wide brackets) 363.0 / 351.3 / 332.5 /
# 325.2 (benchmarks/RESULTS.md, "Sample's window rows drawn by inverse
# transform").
WINDOW_PIVOTS = 8
WINDOW_INNER_MIN = 15
WINDOW_INNER_MAX = 40
# h is INNER_SCALE percent of that standard error (an A/B knob: on the
# H100, rows of s2 logits at top_p 0.6 had wide brackets in 136 of 256 rows
# at 100, where one standard error would miss about a third; their capture
# took 318.0 us at h 40 for every row against ~346 with h their own; at
# 150 / 200 percent the worst cases of capture top_p 0.6 / 0.99 went
# 347.7 / 374.1 -> 331.7 / 403.5 -> 323.2 / 434.8 us: 100 is kept)
WINDOW_INNER_SCALE = 100
# A top-p-only row that its count floor (P_KEEP) does not settle, whose
# sample places the top-p share with a standard error of at least
# WINDOW_UNSURE thousandths of mass (rows whose mass sits in a few sampled
# ids; flat rows ~4-9, the sweep's bf16 s3 rows ~40; times sqrt(1 - the
# sampled share of the row), none for a row sampled whole), is a window row
# whatever the ids above its floor: its mass floor, at top_p + P_MARGIN,
# lies within a standard error or two of the cutoff, and a row it misleads
# takes the whole-row passes (~180 us of one program on the H100: a bf16 s3
# top_p 0.9 row of 5,322 candidates, one in 1,024, set the sweep's worst
# case, benchmarks/RESULTS.md "The per-row inner span and the draw's part
# sums measured"); a window row never falls back. On the H100 (one call,
# off / on): that case 381.8 -> 335.0 us, the s5 calls at top_p 0.9 (one
# or two new window rows) 1.07-1.13x, under 200 us; at 60 they gain 5-8%
# and the misled row is still a window row, with no margin left.
WINDOW_UNSURE = 25
WINDOW_BELOW = 150
WINDOW_ABOVE = 100
# A bracket outside the inner pivots (wide) is narrowed by the exact masses
# above WINDOW_REFINE keys inside it before its ids are marked.
WINDOW_REFINE = 8
BRACKET_WARPS = 4
# The refine is a fixed grid (wide rows are rare): programs a multiprocessor
# on the GPU, and a few in Triton's interpreter (a program at a time).
REFINE_PROGRAMS_PER_SM = 8
REFINE_PROGRAMS_INTERPRETED = 2
# The order the refine's programs take the wide rows' chunks in: 0 row by
# row, 1 chunk by chunk from the first, 2 from the last (the candidate
# mark's last chunks may still be in L2; _window_refine_kernel). On the
# H100, one call, 0 / 2 / 1: 2 against 0 0.985-1.000x, the calls with many
# wide rows 1.4-1.5% (bf16 s2 top_p 0.6 345.6 -> 340.5 us); 1 alike, and
# why chunk by chunk wins was not profiled (decision 60).
REFINE_ORDER = 2
WINDOW_MARK_WARPS = 8  # the window mark's and the refine's
# The window mark takes a row's chunks last to first (1) or first to last
# (0): the candidate mark before it read every row's last chunks last (its
# programs start rows fastest, chunk by chunk), and a chunk the window mark
# reads while it is still in L2 (50 MB, about six of the 19 chunks of 256
# rows) costs no read of memory; the window write after it starts at the
# first chunks, the window mark's last. On the H100, one call, 0 / 1 / 0:
# the top-p and min-p paths' worst cases 0.978-0.994x, flat rows 1.5-2.2%
# faster, peaked rows the same (decision 60).
WINDOW_MARK_REVERSED = 1
# The interleaved mark (capture_interleave.py, decision 61): 1 puts the
# candidate mark, the window bracket and the window mark of the rows whose
# bracket is not wide in one grid, blocks of INTERLEAVE_GROUP rows, a
# group's second read INTERLEAVE_LAG groups after its first (while the
# rows are still in L2); 0 launches them as three kernels. Measured on an
# H100 at 1.220-1.246x the three kernels' time on the top-p paths' worst
# cases (decision 61): off, to be removed.
MARK_INTERLEAVE = 0
INTERLEAVE_GROUP = 8
INTERLEAVE_LAG = 1
# its registers a thread (maxnreg; 0: the compiler's choice, 94 for fp32
# probs on sm_90, two programs a multiprocessor where the candidate mark
# alone has four)
INTERLEAVE_REGISTERS = 0

# --------------------------------------------------------- capture: resolve
RESOLVE_BLOCK = 4096  # candidates held in registers by a resolve program
RESOLVE_WARPS = 8
DRAW_BLOCK = 1024  # candidates a step of the sampler's draw
ROW_BLOCK = 4096  # columns a step of a resolve program that reads its whole row
# resolve's search over a window row's bracket: 4 ways (three probes a pass
# over the candidates, a quarter of the interval kept) or 2 (a bisection)
WINDOW_SEARCH_WAYS = 4
# A row whose sampled floor missed a cutoff: passes over its whole row, each
# counting and summing the ids above FLOOR_WAYS - 1 probes, narrow the
# cutoff until the ids above the floor fit in FLOOR_FIT (or four passes)
FLOOR_WAYS = 8
FLOOR_BLOCK = 512  # columns a block of those passes (lane sums of each probe)
# blocks a step of those passes, their loads in flight together (the H100,
# resolve on bf16 s5 top_p 0.99 with two such rows: 176 us at 16, 187 at 8,
# 212 at 4; 236 with the tile and four blocks a step before)
FLOOR_LOADS = 16
# The same in a call that cannot have window rows (top-k on every row, as
# scalar settings: capture_workspace.may_be_window): the passes' tile is
# compiled into resolve, and at 16 x 512 the kernel's other rows resolve
# slower (the H100, resolve with no row taking the passes: capture top_k
# 1000 30.4 us at 16 x 512, 18.1 at 16 x 256, 16.8 at 4 x 256; top_k 1000
# + top_p 0.9 51.8 / 31.5 / 29.0; sample top_k 1000 41.7 / 25.4 / 24.3).
# A call that may have window rows keeps 16 x 512: its misled rows' passes
# are slower under any other tile tried (176.6 us; 183.9-385.5), and 4 x
# 256 also slows its window rows' resolve (46.0 -> 69.2 on fp32 s1 top_p
# 0.99). A top-k call's rows rarely take the passes (its floor keeps a
# quarter more sampled ids than k asks). A row that does may differ in
# its last bit between these settings as scalars and as [B] tensors (the
# two compile different tiles; see the module's docstring).
FLOOR_LOADS_NO_WINDOW = 4
FLOOR_BLOCK_NO_WINDOW = 256
# ids above the floor that end those passes: a row past RESOLVE_BLOCK
# reads the rest of its candidates from memory in each search pass; a
# pass over the whole row costs more (~100 us in one program on the H200
# when this was set; 40 on the H100 since FLOOR_LOADS). The sweep's misled
# rows fit after one pass: 4096 and 65536 took the same time on them.
FLOOR_FIT = 16384

# ----------------------------------------------------------- capture: write
# A write program walks its row's candidates a block at a time, so a row of
# tens of thousands of candidates (past max_tokens) sets the kernel's time:
# large blocks over many warps (no spills at these values).
WRITE_BLOCK = 4096
WRITE_WARPS = 16
WRITE_ROWS_BLOCK = 1024  # most rows a step of the sum of the rows before
WINDOW_WRITE_WARPS = 8
# 1: the window write reads a step one column a lane, no layout changed
# through shared memory before its stores (_window_write_lanes; decision
# 62: 0.964-0.971x on the top-p paths' worst cases on an H100); 0: the
# [words, 32] tile, four columns a thread (the same bits)
WINDOW_WRITE_LANES = 1
WINDOW_WRITE_SUB = 4096  # columns a step of the window write (a chunk in whole steps)
# the window write's registers a thread (maxnreg): three programs a
# multiprocessor, where the compiler's choice fits two (the tile step
# spills 24 / 8 bytes a thread there with Triton 3.6, fp32 / bf16; the
# lanes step none)
WINDOW_WRITE_REGISTERS = 80
