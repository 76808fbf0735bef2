"""cffi build script for shmask's native core (API mode; see setup.py)."""

from pathlib import Path

from cffi import FFI

NATIVE_DIR = Path(__file__).resolve().parent

# Each exported header of the core, in an order where every type is declared
# before it is used (shmask_queue.h and shmask_direct.h use shmask_ring.h's
# shm_ring). shmask_core.h's own #includes are dropped with every other
# preprocessor line, so it contributes only what it declares itself.
HEADERS = ("shmask_core.h", "shmask_ring.h", "shmask_reader.h", "shmask_queue.h",
           "shmask_decode.h", "shmask_guard.h", "shmask_direct.h",
           "shmask_exit.h", "shmask_cpu.h", "response_json.h", "binary_rows.h", "shmask_launch.h",
           "shmask_copy.h")

# The core's .c files, one per concern (shmask_core.h lists them), then the
# SIGTERM cleanup and the response writer.
SOURCES = ("shmask_core.c", "shmask_ring.c", "shmask_reader.c", "shmask_queue.c",
           "shmask_decode.c", "shmask_guard.c", "shmask_direct.c",
           "shmask_exit.c", "shmask_pool.c", "shmask_cpu.c", "response_json.c", "binary_rows.c",
           "shmask_launch.c", "shmask_copy.c")


def _declarations(header: str) -> str:
    """A header as cffi's cdef wants it: without preprocessor lines (cffi
    cannot parse them), constants turned into `...` so the compiler fills in
    their values."""
    lines = []
    for line in (NATIVE_DIR / header).read_text().splitlines():
        if line.startswith("#define SHM_"):
            name = line.split()[1]
            lines.append(f"#define {name} ...")
        elif not line.startswith("#"):
            lines.append(line)
    return "\n".join(lines)


# The layout's enums and constants (shmask_layout.h itself uses C11 atomics
# that cffi cannot parse); `...` lets the compiler supply each value.
LAYOUT_CDEF = """
#define SHM_HEADER_BYTES ...
#define SHM_RECORD_ALIGN ...
#define SHM_RECORD_HEADER_BYTES ...
#define SHM_MIN_CAPACITY ...
#define SHM_LAYOUT_VERSION ...
enum shm_state { SHM_STATE_FREE, SHM_STATE_STAGING, SHM_STATE_WRITTEN, SHM_STATE_RELEASED,
                 SHM_STATE_PADDING, SHM_STATE_EXPIRED, SHM_STATE_DISCARDED, SHM_STATE_CORRUPT,
                 ... };
enum shm_mode { SHM_MODE_SELECTED, SHM_MODE_SUPPORT, ... };
enum shm_counter { SHM_COUNTER_PUBLISHED, SHM_COUNTER_RELEASED, SHM_COUNTER_EXPIRED,
                   SHM_COUNTER_PADDING, SHM_COUNTER_DISCARDED, ... };
"""

ffibuilder = FFI()
ffibuilder.cdef(LAYOUT_CDEF + "".join(_declarations(header) for header in HEADERS))
ffibuilder.set_source(
    "shmask._native",
    # The one place that includes every header (the C files include what they use).
    "".join(f'#include "{header}"\n' for header in ("shmask_layout.h", *HEADERS)),
    sources=[str(Path("native") / name) for name in SOURCES],
    include_dirs=["native"],
    extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
