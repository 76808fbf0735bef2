"""Byte layouts shared with the C core, as plain ints: the one place Python
and the Triton kernels take them from (kernels wrap them in tl.constexpr,
which compiles to the same code as a literal). Each value is defined in a
native header; tests/test_constants.py checks every one against the built
module (lib.SHM_*, ffi.offsetof, ffi.sizeof), and tests/test_seams.py
refuses integer offsets into these layouts anywhere else.

Row flags byte (native/shmask_core.h, SHM_ROW_*), one per row::

    bit 7..3  0
    bit 2     form: 1 a bitmask row (SHM_ROW_BITMASK), 0 an ids row
    bit 1..0  status: OK, OVERFLOW, INVALID

GPU-direct table (native/shmask_direct.h; indices in the word size named
by the suffix, from the start of the table, the descriptor or an entry)::

    u64 word 0                 diverted counter   (DIRECT_DIVERTED_WORD)
    u64 word 1                 done               (DIRECT_DONE_WORD)
    byte 64                    shm_direct_step_desc (DIRECT_DESC_WORD in u64)
        u64 0..7   status, forms, lengths, id_offsets, offsets, ids,
                   values, selected (device addresses of the Rows tensors)
        u64 8      target;  u64 9  slots;  u64 10: u32 vocab
    byte 256 + 64 * slot       shm_direct_entry of queue slot `slot`
        u64 0..3   lengths, flags, ids, logprobs (buffer addresses)
        u32 8..15  rows, rows_capacity, words, words_capacity, nnz,
                   nnz_capacity, vocab, diverted
"""

from __future__ import annotations

# ---------------------------------------------------------- row flags byte
ROW_OK = 0
ROW_OVERFLOW = 1  # support larger than the producer's cap: no ids sent
ROW_INVALID = 2  # the sampler found the row invalid: no ids sent
ROW_STATUS_MASK = 3  # the status bits
ROW_FORM_SHIFT = 2  # the form bit: flags = status | form << ROW_FORM_SHIFT
ROW_BITMASK = 1 << ROW_FORM_SHIFT

# ------------------------------------------------ RefBatch entry kinds
REF_KIND_EMPTY = 0  # a request that produced no rows since its last take
REF_KIND_RING = 1
REF_KIND_INLINE = 2
REF_KIND_LOST = 3  # a chunk a forwarding hop could not read

# --------------------------------------------------- GPU-direct table
DIRECT_DIVERTED_WORD = 0  # u64 words of the table
DIRECT_DONE_WORD = 1
DIRECT_DESC_BYTES_AT = 64  # SHM_DIRECT_DESC_OFFSET
DIRECT_DESC_WORD = DIRECT_DESC_BYTES_AT // 8
DIRECT_HEADER_BYTES = 256  # entries start here
DIRECT_ENTRY_BYTES = 64

# shm_direct_step_desc, u64 words from its start
DESC_STATUS = 0
DESC_FORMS = 1
DESC_LENGTHS = 2
DESC_ID_OFFSETS = 3
DESC_OFFSETS = 4
DESC_IDS = 5
DESC_VALUES = 6
DESC_SELECTED = 7
DESC_TARGET = 8
DESC_SLOTS = 9
DESC_VOCAB = 10  # the u64 word whose low u32 (little-endian) is vocab
DIRECT_TARGET_WORD = DIRECT_DESC_WORD + DESC_TARGET  # from the table's start

# shm_direct_entry: buffer addresses (u64 words), then counts (u32 words)
ENTRY_LENGTHS = 0
ENTRY_FLAGS = 1
ENTRY_IDS = 2
ENTRY_LOGPROBS = 3
ENTRY_ROWS = 8
ENTRY_ROWS_CAPACITY = 9
ENTRY_WORDS = 10
ENTRY_WORDS_CAPACITY = 11
ENTRY_NNZ = 12
ENTRY_NNZ_CAPACITY = 13
ENTRY_VOCAB = 14
ENTRY_DIVERTED = 15
