"""Values the Python side writes down that the C core also defines: they
must agree, and shmask/_native.pyi must declare every name the core
exports."""

from __future__ import annotations

import ast
from pathlib import Path

import shmask
from shmask import _native, chunk, layout, refs, writer
from shmask._native import ffi, lib
from shmask._native_errors import _MESSAGES
from shmask.cli import HEADER_BYTES_FALLBACK

ROOT = Path(__file__).resolve().parent.parent


def test_modes():
    assert refs.MODE_SELECTED == lib.SHM_MODE_SELECTED
    assert refs.MODE_SUPPORT == lib.SHM_MODE_SUPPORT
    assert refs.MODES == {"selected": lib.SHM_MODE_SELECTED, "support": lib.SHM_MODE_SUPPORT}


def test_handle_slot_mask():
    assert writer._SLOT_MASK == (1 << lib.SHM_HANDLE_SLOT_BITS) - 1


def test_header_bytes_the_cli_assumes():
    assert HEADER_BYTES_FALLBACK == lib.SHM_HEADER_BYTES


def test_states_and_layout_constants():
    """The layout header's values, as docs/wire-format.md and the tests use them."""
    assert (lib.SHM_STATE_FREE, lib.SHM_STATE_STAGING, lib.SHM_STATE_WRITTEN, lib.SHM_STATE_RELEASED,
            lib.SHM_STATE_PADDING, lib.SHM_STATE_EXPIRED, lib.SHM_STATE_DISCARDED,
            lib.SHM_STATE_CORRUPT) == (0, 1, 2, 3, 4, 5, 6, 255)
    assert lib.SHM_RECORD_HEADER_BYTES == 128
    assert lib.SHM_RECORD_ALIGN == 128 and lib.SHM_HEADER_BYTES == 4096
    assert lib.SHM_MIN_CAPACITY <= lib.SHM_HEADER_BYTES  # segment.attach's size floor
    assert lib.SHM_LAYOUT_VERSION == 3


def test_record_layout_matches_python_payload_size():
    """refs.payload_bytes (inline chunks), the core's inline payload size and
    its record layout size the same four arrays."""
    layout = ffi.new("shm_layout *")
    for mode in (refs.MODE_SELECTED, refs.MODE_SUPPORT):
        for rows, words, nnz in ((1, 1, 1), (3, 17, 17), (64, 1000, 1000), (5, 4748, 90000),
                                 (7, 0, 0)):
            assert lib.shm_record_layout(mode, rows, words, nnz, layout) == lib.SHM_OK
            payload = int(refs.payload_bytes(mode, rows, words, nnz))
            assert payload == lib.shm_payload_bytes(mode, rows, words, nnz)
            align = lib.SHM_RECORD_ALIGN
            assert layout.lengths_offset == lib.SHM_RECORD_HEADER_BYTES
            assert layout.flags_offset == layout.lengths_offset + -(-4 * rows // 64) * 64
            assert layout.record_bytes % align == 0
            assert payload <= layout.record_bytes - lib.SHM_RECORD_HEADER_BYTES < payload + 3 * 64 + align
            logprobs = nnz if mode == refs.MODE_SUPPORT else rows
            assert layout.ids_offset + 4 * words <= layout.logprobs_offset
            assert layout.logprobs_offset + 4 * logprobs <= layout.record_bytes


def test_every_error_code_has_a_message():
    codes = {name: getattr(lib, name) for name in dir(lib) if name.startswith("SHM_E_")}
    assert codes, "no SHM_E_* in the core"
    missing = sorted(name for name, value in codes.items() if value not in _MESSAGES)
    assert not missing, f"_native_errors has no message for {missing}"


def _stub_names() -> tuple[set[str], set[str]]:
    tree = ast.parse((ROOT / "shmask" / "_native.pyi").read_text())
    lib_class = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "_Lib")
    constants = {n.target.id for n in lib_class.body
                 if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    functions = {n.name for n in lib_class.body if isinstance(n, ast.FunctionDef)}
    return constants, functions


def test_stub_declares_the_whole_core():
    constants, functions = _stub_names()
    exported = set(dir(lib))
    declared = constants | functions
    assert exported == declared, (f"in the core, not in _native.pyi: {sorted(exported - declared)}; "
                                  f"in _native.pyi, not in the core: {sorted(declared - exported)}")
    for name in functions:
        assert callable(getattr(lib, name)), name
    for name in constants:
        assert isinstance(getattr(lib, name), int), name


def test_stub_function_arity():
    tree = ast.parse((ROOT / "shmask" / "_native.pyi").read_text())
    lib_class = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "_Lib")
    for node in lib_class.body:
        if isinstance(node, ast.FunctionDef):
            stub_args = len(node.args.posonlyargs) + len(node.args.args) - 1  # minus self
            c_args = len(ffi.typeof(getattr(lib, node.name)).args)
            assert stub_args == c_args, f"{node.name}: {stub_args} in the stub, {c_args} in C"


def test_native_module_is_what_the_package_uses():
    assert shmask.__version__ and _native.ffi is ffi


def test_ref_entry_struct_is_the_wire_entry():
    """take_batch lets the core write RefBatch entries in place: its struct
    must be ENTRY_DTYPE byte for byte."""
    assert ffi.sizeof("shm_ref_entry") == refs.ENTRY_DTYPE.itemsize
    fields = dict(ffi.typeof("shm_ref_entry").fields)
    assert list(fields) == list(refs.ENTRY_DTYPE.names)
    for name, (dtype, offset) in refs.ENTRY_DTYPE.fields.items():
        assert fields[name].offset == offset, name
        assert ffi.sizeof(fields[name].type) == dtype.itemsize, name


def test_row_flags_byte():
    """shmask/layout.py's row flags are native/shmask_core.h's, and the
    kernels' row codes (kernels/rows.py) write the same bits."""
    from shmask.kernels.rows import Form, Status

    assert (layout.ROW_OK, layout.ROW_OVERFLOW, layout.ROW_INVALID) == (
        lib.SHM_ROW_OK, lib.SHM_ROW_OVERFLOW, lib.SHM_ROW_INVALID)
    assert layout.ROW_STATUS_MASK == lib.SHM_ROW_STATUS_MASK
    assert layout.ROW_FORM_SHIFT == lib.SHM_ROW_FORM_SHIFT
    assert layout.ROW_BITMASK == lib.SHM_ROW_BITMASK == 1 << lib.SHM_ROW_FORM_SHIFT
    assert (Status.OK, Status.OVERFLOW, Status.INVALID) == (
        lib.SHM_ROW_OK, lib.SHM_ROW_OVERFLOW, lib.SHM_ROW_INVALID)
    assert Form.BITMASK << layout.ROW_FORM_SHIFT == lib.SHM_ROW_BITMASK
    # SKIPPED never reaches a flags byte: the status bits cannot say it.
    assert Status.SKIPPED & ~lib.SHM_ROW_STATUS_MASK == 0 and Status.SKIPPED not in (
        lib.SHM_ROW_OK, lib.SHM_ROW_OVERFLOW, lib.SHM_ROW_INVALID)
    assert (chunk.ROW_OK, chunk.ROW_OVERFLOW, chunk.ROW_INVALID, chunk.ROW_BITMASK,
            chunk.ROW_STATUS_BITS) == (lib.SHM_ROW_OK, lib.SHM_ROW_OVERFLOW, lib.SHM_ROW_INVALID,
                                       lib.SHM_ROW_BITMASK, lib.SHM_ROW_STATUS_MASK)


def test_ref_kinds():
    assert (layout.REF_KIND_EMPTY, layout.REF_KIND_RING, layout.REF_KIND_INLINE,
            layout.REF_KIND_LOST) == (lib.SHM_REF_KIND_EMPTY, lib.SHM_REF_KIND_RING,
                                      lib.SHM_REF_KIND_INLINE, lib.SHM_REF_KIND_LOST)
    assert (refs.KIND_EMPTY, refs.KIND_SHM, refs.KIND_INLINE, refs.KIND_LOST) == (
        lib.SHM_REF_KIND_EMPTY, lib.SHM_REF_KIND_RING, lib.SHM_REF_KIND_INLINE,
        lib.SHM_REF_KIND_LOST)


def test_direct_table_layout():
    """Every word the Triton kernels read or write in the GPU-direct table
    (kernels/ring.py, kernels/direct.py) is where native/shmask_direct.h
    puts it."""
    u64, u32 = 8, 4
    assert layout.DIRECT_DIVERTED_WORD == lib.SHM_DIRECT_DIVERTED_WORD
    assert layout.DIRECT_DONE_WORD == lib.SHM_DIRECT_DONE_WORD
    assert layout.DIRECT_DESC_BYTES_AT == lib.SHM_DIRECT_DESC_OFFSET
    assert layout.DIRECT_DESC_WORD * u64 == lib.SHM_DIRECT_DESC_OFFSET
    assert layout.DIRECT_HEADER_BYTES == lib.SHM_DIRECT_HEADER_BYTES
    assert (layout.DIRECT_ENTRY_BYTES == lib.SHM_DIRECT_ENTRY_BYTES
            == ffi.sizeof("shm_direct_entry"))
    assert (lib.SHM_DIRECT_DESC_OFFSET + ffi.sizeof("shm_direct_step_desc")
            <= lib.SHM_DIRECT_HEADER_BYTES)
    desc = {"status": layout.DESC_STATUS, "forms": layout.DESC_FORMS,
            "lengths": layout.DESC_LENGTHS, "id_offsets": layout.DESC_ID_OFFSETS,
            "offsets": layout.DESC_OFFSETS, "ids": layout.DESC_IDS,
            "values": layout.DESC_VALUES, "selected": layout.DESC_SELECTED,
            "target": layout.DESC_TARGET, "slots": layout.DESC_SLOTS,
            "vocab": layout.DESC_VOCAB}
    for field, word in desc.items():
        assert ffi.offsetof("shm_direct_step_desc", field) == u64 * word, field
    assert ffi.sizeof(dict(ffi.typeof("shm_direct_step_desc").fields)["vocab"].type) == u32
    assert (layout.DIRECT_TARGET_WORD * u64
            == lib.SHM_DIRECT_DESC_OFFSET + ffi.offsetof("shm_direct_step_desc", "target"))
    addresses = {"lengths": layout.ENTRY_LENGTHS, "flags": layout.ENTRY_FLAGS,
                 "ids": layout.ENTRY_IDS, "logprobs": layout.ENTRY_LOGPROBS}
    counts = {"rows": layout.ENTRY_ROWS, "rows_capacity": layout.ENTRY_ROWS_CAPACITY,
              "words": layout.ENTRY_WORDS, "words_capacity": layout.ENTRY_WORDS_CAPACITY,
              "nnz": layout.ENTRY_NNZ, "nnz_capacity": layout.ENTRY_NNZ_CAPACITY,
              "vocab": layout.ENTRY_VOCAB, "diverted": layout.ENTRY_DIVERTED}
    fields = dict(ffi.typeof("shm_direct_entry").fields)
    for group, size in ((addresses, u64), (counts, u32)):
        for field, word in group.items():
            assert fields[field].offset == size * word, field
            assert ffi.sizeof(fields[field].type) == size, field
    assert set(fields) == set(addresses) | set(counts)
