"""cffi build script for shmask's native core (API mode; see setup.py)."""

from pathlib import Path

from cffi import FFI

NATIVE_DIR = Path(__file__).resolve().parent

# The cdef mirrors native/shmask_core.h; the compiler checks the two agree
# because set_source() compiles against the real header.
CDEF = """
#define SHM_OK ...
#define SHM_FULL ...
#define SHM_E_TOO_BIG ...
#define SHM_E_BAD_HEADER ...
#define SHM_E_BAD_POSITION ...
#define SHM_E_BAD_RECORD ...
#define SHM_E_STALE ...
#define SHM_E_DOUBLE_RELEASE ...
#define SHM_E_NOT_WRITTEN ...
#define SHM_E_BAD_LENGTHS ...
#define SHM_E_BAD_STATE ...
#define SHM_E_OVERFLOW ...
#define SHM_E_BAD_SLOT ...
#define SHM_E_BAD_LENGTH ...
#define SHM_E_SOURCE_OVERRUN ...
#define SHM_E_MODE ...
#define SHM_HEADER_BYTES ...
#define SHM_RECORD_ALIGN ...
#define SHM_RECORD_HEADER_BYTES ...
#define SHM_MIN_CAPACITY ...
#define SHM_LAYOUT_VERSION ...

enum shm_state { SHM_STATE_FREE, SHM_STATE_STAGING, SHM_STATE_WRITTEN, SHM_STATE_RELEASED,
                 SHM_STATE_PADDING, SHM_STATE_EXPIRED, SHM_STATE_DISCARDED, ... };
enum shm_mode { SHM_MODE_SELECTED, SHM_MODE_SUPPORT, ... };
enum shm_counter { SHM_COUNTER_PUBLISHED, SHM_COUNTER_RELEASED, SHM_COUNTER_EXPIRED,
                   SHM_COUNTER_PADDING, SHM_COUNTER_DISCARDED, ... };

typedef struct { uint64_t lengths_offset; uint64_t ids_offset; uint64_t logprobs_offset;
                 uint64_t record_bytes; } shm_layout;
typedef struct { uint64_t record_offset; uint64_t lengths_offset; uint64_t ids_offset;
                 uint64_t logprobs_offset; } shm_view;
typedef struct { uint64_t head; uint64_t tail; uint64_t advanced_bytes; uint64_t expired;
                 uint64_t blocked_position; uint32_t blocked_state; uint32_t pad; }
        shm_reclaim_result;
typedef struct { uint64_t capacity; uint64_t epoch; uint64_t producer_pid;
                 uint64_t producer_start; uint64_t created_ns; uint64_t head; uint64_t tail;
                 uint64_t published; uint64_t released; uint64_t expired; } shm_info;
typedef struct { int32_t *lengths; int32_t *ids; float *logprobs; uint64_t rows;
                 uint64_t rows_capacity; uint64_t nnz; uint64_t nnz_capacity; uint32_t mode;
                 uint32_t in_ring; uint64_t position; } shm_queue;

int shm_record_layout(uint32_t mode, uint64_t rows_capacity, uint64_t nnz_capacity,
                      shm_layout *out);
int shm_init(void *base, uint64_t mapped_bytes, uint64_t capacity, uint64_t epoch,
             uint64_t pid, uint64_t start, uint64_t created_ns);
int shm_reserve(void *base, uint32_t mode, uint64_t rows_capacity, uint64_t nnz_capacity,
                uint64_t *position_out);
int shm_publish(void *base, uint64_t position, uint64_t rows, uint64_t nnz, uint64_t now_ns);
int shm_discard(void *base, uint64_t position);
int shm_reclaim(void *base, uint64_t now_ns, uint64_t lease_ns, shm_reclaim_result *out);
void *shm_record_address(void *base, uint64_t position);
uint64_t shm_load_head(const void *base);
uint64_t shm_load_tail(const void *base);
uint64_t shm_load_counter(const void *base, uint32_t which);
int shm_read_info(const void *base, uint64_t segment_bytes, shm_info *out);
int shm_open_record(const void *base, uint64_t mapped_bytes, uint64_t capacity,
                    uint64_t position, uint64_t record_bytes, uint64_t rows, uint64_t nnz,
                    uint32_t mode, shm_view *out);
int shm_check_record(const void *base, uint64_t capacity, uint64_t position);
int shm_release(void *base, uint64_t mapped_bytes, uint64_t capacity, uint64_t position);
int shm_validate_lengths(const int32_t *lengths, uint64_t rows, uint64_t nnz,
                         uint64_t max_row_length);
int64_t shm_append_step(shm_queue *queues, uint64_t n_queues, const int32_t *slots,
                        uint64_t batch, const int32_t *lengths, const int32_t *ids,
                        const float *logprobs, uint64_t row_stride, uint64_t ids_len,
                        uint64_t logprobs_len, uint32_t mode, uint64_t max_row_length,
                        uint64_t start_row, uint64_t *source_cursor, int64_t *bad_row);
void shm_copy_queue(const shm_queue *from, shm_queue *to);
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "shmask._native",
    '#include "shmask_core.h"\n#include "shmask_layout.h"',
    sources=[str(Path("native") / "shmask_core.c")],
    include_dirs=["native"],
    extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
