"""From responses to training tensors: the sampling masks of a
micro-batch's sequences, in whichever form the rollout's responses carry
them, packed into one ReplayBatch of a few flat tensors that a trainer
copies to the GPU once (the replay kernel, kernels/replay.py, reads them).

One builder per form (docs/responses.md), each taking one item per
sequence, in batch order:

- ``from_json``: SGLang's meta_info lists: ``output_token_sampling_mask``
  a list per token of ascending ids (None for a dropped row),
  ``output_token_sampling_logprobs`` a list per token of logprobs (support
  mode) or one logprob per token (selected mode; None where dropped or NaN),
  ``output_token_sampling_mask_length`` the number of rows.
- ``from_binary``: binary-rows objects (``"sampling_mask_format":
  "base64"``), parsed, as JSON text, or already decoded (``BinaryRows``,
  what ``shmask.binary_rows.loads`` puts in their place).
- ``from_arrays``: the in-process arrays (``SHMASK_MASK_FORMAT=arrays``):
  SGLang's ``SamplingMaskCSR``, or the ``(token_ids, offsets)`` pair of
  vLLM's ``shmask.adapters.vllm.mask_csr``.
- ``pack_rows``: rows as lists or numpy arrays, for any other source.

Every input is checked whole before a tensor is made; anything wrong raises
ValueError naming the sequence, the token and the rule. A sequence must be
whole (a streamed increment, rows from some start on, is refused): its
tokens line up with the trainer's.

Forms: each response form decodes bitmask rows to ids, so the packer makes
them again by the rule shmask's producers use (kernels/rows.py, ``Form``,
restated here since kernels/ needs triton): an OK row of L ids is a bitmask
iff ``32 L >= V``, where its ceil(V / 32) words cost no more than its ids.

torch is imported only when a batch is made, so a process without it can
import this module (the type names below are for checkers only).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .binary_rows import LENGTH_FIELD, MASK_FIELD, BinaryRows, decode_rows
from .layout import ROW_OK

if TYPE_CHECKING:
    import torch

__all__ = ["ReplayBatch", "from_arrays", "from_binary", "from_json", "pack_rows"]

LOGPROBS_FIELD = "output_token_sampling_logprobs"  # as shmask.adapters.sglang names it
WORD_BITS = 32
FORM_IDS = 0  # a row's ascending ids
FORM_BITMASK = 1  # a row's ceil(V / 32) words, bit j of word w <=> id 32 w + j
_MAX_VOCAB = 2**31  # ids travel as int32


@dataclass
class ReplayBatch:
    """The sampling masks of S sequences, N tokens in all, as flat tensors.

    Sequence s's tokens are ``[seq_offsets[s], seq_offsets[s + 1])``. Token
    t's id data is ``ids[offsets[t]:offsets[t + 1]]``: its ascending support
    ids (``forms[t] == 0``) or its ceil(V / 32) bitmask words (``forms[t] ==
    1``; bit j of word w set <=> id 32 w + j kept, bits at ids >= V zero).
    ``valid[t]`` is False where the row's status was not OK (OVERFLOW,
    INVALID): such a row has no id data and form 0. ``rollout_logprobs`` is
    the rollout's logprob of each sampled token (NaN for a row without one)
    when every sequence's response carried it (selected mode), else None.
    """

    seq_offsets: torch.Tensor  # int64 [S + 1]
    offsets: torch.Tensor  # int64 [N + 1], into ids
    ids: torch.Tensor  # int32 [nnz]
    forms: torch.Tensor  # int32 [N]
    valid: torch.Tensor  # bool [N]
    rollout_logprobs: torch.Tensor | None  # float32 [N]
    vocab: int

    @property
    def num_tokens(self) -> int:
        return int(self.valid.shape[0])

    @property
    def num_sequences(self) -> int:
        return int(self.seq_offsets.shape[0]) - 1

    def to(self, device: torch.device | str | int,
           non_blocking: bool | None = None) -> ReplayBatch:
        """The batch with every tensor on `device`. A copy from the CPU to a
        GPU goes through pinned memory and, by default, does not block: the
        GPU's stream orders it before the kernels that read it. Any other
        copy (a GPU's batch back to the CPU) blocks by default, so its
        tensors hold their values when returned; ``non_blocking=True`` there
        leaves the caller to synchronize before reading them."""
        import torch

        target = torch.device(device)
        from_host = target.type == "cuda" and self.ids.device.type == "cpu"
        source = self.pin_memory() if from_host else self
        overlap = from_host if non_blocking is None else non_blocking
        return source._map(lambda tensor: tensor.to(target, non_blocking=overlap))

    def pin_memory(self) -> ReplayBatch:
        """The batch in page-locked host memory; itself where CUDA is not
        available (nothing could copy from it faster) or it is not on the CPU."""
        import torch

        if not torch.cuda.is_available() or self.ids.device.type != "cpu":
            return self
        return self._map(lambda tensor: tensor if tensor.is_pinned() else tensor.pin_memory())

    def _map(self, move: Callable[[torch.Tensor], torch.Tensor]) -> ReplayBatch:
        logprobs = self.rollout_logprobs
        return ReplayBatch(move(self.seq_offsets), move(self.offsets), move(self.ids),
                           move(self.forms), move(self.valid),
                           None if logprobs is None else move(logprobs), self.vocab)


class _Sequence(NamedTuple):
    """One sequence's rows as the packer takes them: ``ids`` every OK row's
    ascending ids back to back (any integer type; the packer checks the
    values), ``lengths`` int64 [rows] (0 for a row that is not OK),
    ``valid`` bool [rows], ``selected`` the rollout's logprob per row
    (float32, NaN where none) or None where the response did not carry it."""

    ids: np.ndarray
    lengths: np.ndarray
    valid: np.ndarray
    selected: np.ndarray | None


# ---------------------------------------------------------------- builders
def pack_rows(sequences: Sequence[Sequence[Any]], vocab: int, *,
              rollout_logprobs: Sequence[Any] | None = None, bitmasks: bool = True) -> ReplayBatch:
    """One batch from rows given directly: ``sequences[s][t]`` is token t's
    support, a 1-D integer array or list of strictly ascending ids in
    [0, vocab), or None for a row with no data (valid False).
    ``rollout_logprobs`` (optional) holds one float array-like per sequence,
    one value per token. ``bitmasks=False`` keeps every row in ids form (what
    a reader of ids alone needs); otherwise rows with 32 L >= vocab become
    bitmask rows."""
    _check_vocab(vocab)
    if rollout_logprobs is not None and len(rollout_logprobs) != len(sequences):
        raise ValueError(f"rollout_logprobs has {len(rollout_logprobs)} items for "
                         f"{len(sequences)} sequences")
    parts = []
    for s, rows in enumerate(sequences):
        selected = None
        if rollout_logprobs is not None:
            selected = _float_rows(rollout_logprobs[s], f"sequence {s}: rollout_logprobs")
            if selected.size != len(rows):
                raise ValueError(f"sequence {s}: rollout_logprobs has {selected.size} values for "
                                 f"{len(rows)} tokens")
        parts.append(_from_rows(rows, selected, f"sequence {s}"))
    return _pack(parts, vocab, bitmasks)


def from_json(meta_infos: Sequence[Mapping[str, Any]], vocab: int, *,
              bitmasks: bool = True) -> ReplayBatch:
    """One batch from SGLang's JSON-list responses: ``meta_infos[s]`` is
    sequence s's meta_info (parsed JSON) holding ``output_token_sampling_mask``
    (a list per token: ascending ids, or None for a dropped row), and
    optionally ``output_token_sampling_logprobs`` (a list per token of
    logprobs in support mode, one logprob per token in selected mode: those
    become ``rollout_logprobs``) and ``output_token_sampling_mask_length``
    (the rows' count: a response holding fewer rows is a streamed increment,
    refused)."""
    _check_vocab(vocab)
    parts = []
    for s, meta_info in enumerate(meta_infos):
        where = f"sequence {s}"
        if not isinstance(meta_info, Mapping) or MASK_FIELD not in meta_info:
            raise ValueError(f"{where}: expected a meta_info dict holding {MASK_FIELD!r}, got "
                             f"{_describe(meta_info)}")
        rows = meta_info[MASK_FIELD]
        if not isinstance(rows, list):
            raise ValueError(f"{where}: {MASK_FIELD!r} must be a list (a row per token), got "
                             f"{_describe(rows)}")
        _check_whole(meta_info.get(LENGTH_FIELD), 0, len(rows), where)
        logprobs = meta_info.get(LOGPROBS_FIELD)
        part = _from_rows(rows, None, where)
        if logprobs is not None:
            part = part._replace(selected=_json_selected(logprobs, part, where))
        parts.append(part)
    return _pack(parts, vocab, bitmasks)


def from_binary(objs: Sequence[Any], vocab: int | None = None, *,
                bitmasks: bool = True) -> ReplayBatch:
    """One batch from binary-rows responses: ``objs[s]`` is sequence s's
    binary-rows object in any form ``decode_rows`` takes (the parsed dict,
    its JSON text, or a meta_info dict holding it), or already decoded
    (``BinaryRows``, or a meta_info dict holding one: what
    ``shmask.binary_rows.loads`` gives). Selected-mode rows carry the
    rollout's logprobs. The object carries no vocabulary: ``vocab`` None
    keeps every row in ids form and makes the batch's vocab one past its
    largest id (the smallest the ids fit); give the model's to bound the ids
    and to have bitmask rows."""
    if vocab is not None:
        _check_vocab(vocab)
    parts = []
    for s, obj in enumerate(objs):
        where = f"sequence {s}"
        length = obj.get(LENGTH_FIELD) if isinstance(obj, Mapping) else None
        rows: Any = obj[MASK_FIELD] if isinstance(obj, Mapping) and MASK_FIELD in obj else obj
        if not isinstance(rows, BinaryRows):
            try:
                rows = decode_rows(rows)
            except ValueError as exc:  # BinaryRowsError names the field
                raise ValueError(f"{where}: {exc}") from exc
        _check_whole(length, rows.start, rows.rows, where)
        status = np.asarray(rows.status)
        selected = np.asarray(rows.logprobs, np.float32) if rows.mode == "selected" else None
        parts.append(_Sequence(np.asarray(rows.ids), np.asarray(rows.lengths, np.int64),
                               status == ROW_OK, selected))
    if vocab is None:
        largest = max((int(part.ids.max()) for part in parts if part.ids.size), default=0)
        return _pack(parts, largest + 1, bitmasks=False)
    return _pack(parts, vocab, bitmasks)


def from_arrays(masks: Sequence[Any], vocab: int, *, bitmasks: bool = True) -> ReplayBatch:
    """One batch from the in-process arrays (``SHMASK_MASK_FORMAT=arrays``):
    ``masks[s]`` is sequence s's SGLang ``SamplingMaskCSR`` (``token_ids``,
    ``offsets``, ``status``, ``logprobs``, ``support``; or the meta_info
    dict holding it under ``output_token_sampling_mask``), or a
    ``(token_ids, offsets)`` pair of CSR arrays (vLLM's
    ``shmask.adapters.vllm.mask_csr``: no status, every row valid).
    Selected-mode rows carry the rollout's logprobs."""
    _check_vocab(vocab)
    parts = []
    for s, mask in enumerate(masks):
        where = f"sequence {s}"
        if isinstance(mask, Mapping) and MASK_FIELD in mask:
            mask = mask[MASK_FIELD]
        if isinstance(mask, tuple) and len(mask) == 2:
            ids, offsets = (np.asarray(a) for a in mask)
            status, selected = None, None
        elif all(hasattr(mask, name) for name in ("token_ids", "offsets", "status", "support")):
            ids, offsets, status = (np.asarray(mask.token_ids), np.asarray(mask.offsets),
                                    np.asarray(mask.status))
            selected = None if mask.support else np.asarray(mask.logprobs, np.float32)
        else:
            raise ValueError(f"{where}: expected a SamplingMaskCSR or a (token_ids, offsets) "
                             f"pair, got {_describe(mask)}")
        lengths = _csr_lengths(ids, offsets, where)
        valid = np.ones(lengths.size, bool) if status is None else status == ROW_OK
        if valid.shape != lengths.shape:
            raise ValueError(f"{where}: {valid.size} statuses for {lengths.size} rows")
        parts.append(_Sequence(_integers(ids, where), lengths, valid, selected))
    return _pack(parts, vocab, bitmasks)


# ------------------------------------------------------------- per source
def _from_rows(rows: Sequence[Any], selected: np.ndarray | None, where: str) -> _Sequence:
    """A sequence from a row per token (ids, or None for no data)."""
    valid = np.fromiter((row is not None for row in rows), bool, len(rows))
    present = [np.asarray(row) for row in rows if row is not None]
    if any(row.ndim != 1 for row in present):
        bad = next(i for i, row in enumerate(present) if row.ndim != 1)
        raise ValueError(f"{where}, token {int(np.flatnonzero(valid)[bad])}: a row must be 1-D "
                         f"(its ids), got shape {present[bad].shape}")
    lengths = np.zeros(len(rows), np.int64)
    lengths[valid] = np.fromiter(map(len, present), np.int64, len(present))
    # Empty rows left out: numpy makes [] a float array, which would make every id a float.
    ids = np.concatenate([row for row in present if row.size] or [np.zeros(0, np.int64)])
    return _Sequence(_integers(ids, where), lengths, valid, selected)


def _json_selected(logprobs: Any, part: _Sequence, where: str) -> np.ndarray | None:
    """The rollout's logprob per row from a JSON logprobs field: the values
    themselves in selected mode (None: NaN), None in support mode, after
    checking the field's shape against the rows'."""
    if not isinstance(logprobs, list) or len(logprobs) != part.lengths.size:
        count = len(logprobs) if isinstance(logprobs, list) else _describe(logprobs)
        raise ValueError(f"{where}: {LOGPROBS_FIELD!r} has {count} rows, "
                         f"{MASK_FIELD!r} {part.lengths.size}")
    support = any(isinstance(row, list) for row in logprobs)
    if not support:
        return _float_rows(logprobs, f"{where}: {LOGPROBS_FIELD!r}")
    if any(row is not None and not isinstance(row, list) for row in logprobs):
        raise ValueError(f"{where}: {LOGPROBS_FIELD!r} mixes support-mode lists with "
                         f"selected-mode values")
    counts = np.fromiter((0 if row is None else len(row) for row in logprobs), np.int64,
                         len(logprobs))
    ragged = np.flatnonzero(counts != part.lengths)
    if ragged.size:
        t = int(ragged[0])
        raise ValueError(f"{where}, token {t}: {counts[t]} logprobs for {part.lengths[t]} ids")
    return None


def _float_rows(values: Any, what: str) -> np.ndarray:
    """One float32 value per row (None becomes NaN)."""
    try:
        array = np.array(values, dtype=np.float64)  # None -> NaN; exact for float32 values
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what}: expected one number (or None) per token: {exc}") from None
    if array.ndim != 1:
        raise ValueError(f"{what}: expected one number per token, got shape {array.shape}")
    return array.astype(np.float32)


def _csr_lengths(ids: np.ndarray, offsets: np.ndarray, where: str) -> np.ndarray:
    """Each row's length from CSR offsets, which must run from 0 to ids.size
    without going back."""
    if ids.ndim != 1 or offsets.ndim != 1 or offsets.size == 0:
        raise ValueError(f"{where}: token_ids must be 1-D and offsets 1-D with rows + 1 values, "
                         f"got shapes {ids.shape} and {offsets.shape}")
    if offsets.dtype.kind not in "iu":
        raise ValueError(f"{where}: offsets must be integers, got {offsets.dtype}")
    lengths = np.diff(offsets.astype(np.int64))
    if int(offsets[0]) != 0 or int(offsets[-1]) != ids.size or (lengths < 0).any():
        raise ValueError(f"{where}: offsets must rise from 0 to {ids.size} (the ids), got "
                         f"{offsets[0]}..{offsets[-1]}"
                         + (f", falling at row {int(np.argmax(lengths < 0))}"
                            if (lengths < 0).any() else ""))
    return lengths


def _integers(ids: np.ndarray, where: str) -> np.ndarray:
    if ids.dtype.kind not in "iu":  # bools, floats, strings, Python ints past int64
        raise ValueError(f"{where}: ids must be integers, got {ids.dtype}")
    return ids


def _check_whole(length: Any, start: int, rows: int, where: str) -> None:
    """A response's rows are the whole sequence: from row 0, as many as its
    length field (when present) counts."""
    if start != 0 or length is not None and length != rows:
        raise ValueError(f"{where}: the response holds rows {start}..{start + rows} of "
                         f"{length if length is not None else 'more'} (a streamed increment?): "
                         "pass each sequence's whole response")


def _check_vocab(vocab: Any) -> None:
    if not isinstance(vocab, int | np.integer) or isinstance(vocab, bool) \
            or not 0 < vocab <= _MAX_VOCAB:
        raise ValueError(f"vocab must be an int in [1, 2**31], got {vocab!r}")


def _describe(value: Any) -> str:
    return type(value).__name__


# ------------------------------------------------------------------ packing
def _pack(parts: list[_Sequence], vocab: int, bitmasks: bool) -> ReplayBatch:
    """The sequences concatenated, checked, and the wide rows made bitmasks."""
    import torch

    for s, part in enumerate(parts):
        if part.selected is not None and part.selected.shape != part.lengths.shape:
            raise ValueError(f"sequence {s}: {part.selected.size} logprobs for "
                             f"{part.lengths.size} tokens")
    seq_offsets = _offsets(np.array([part.lengths.size for part in parts], np.int64))
    lengths = np.concatenate([part.lengths for part in parts] or [np.zeros(0, np.int64)])
    valid = np.concatenate([part.valid for part in parts] or [np.zeros(0, bool)])
    ids = np.concatenate([part.ids for part in parts] or [np.zeros(0, np.int32)])

    dropped_with_ids = np.flatnonzero(~valid & (lengths != 0))
    if dropped_with_ids.size:
        t = int(dropped_with_ids[0])
        raise ValueError(f"{_where(seq_offsets, t)}: a row that is not OK has {lengths[t]} ids "
                         "(it must have none)")
    offsets = _offsets(lengths)
    if offsets[-1] != ids.size:  # only a source's own bug: each checks its CSR
        raise ValueError(f"the rows' lengths sum to {offsets[-1]}, but they hold {ids.size} ids")
    ids = _checked_ids(ids, offsets, vocab, seq_offsets)

    forms = np.full(lengths.size, FORM_IDS, np.int32)
    if bitmasks:
        forms[valid & (WORD_BITS * lengths >= vocab)] = FORM_BITMASK
    data, data_offsets = _with_bitmasks(ids, offsets, forms, vocab)

    selected = [part.selected for part in parts]
    logprobs = None
    if all(values is not None for values in selected):
        logprobs = torch.from_numpy(np.concatenate(
            [values for values in selected if values is not None] or [np.zeros(0, np.float32)]))
    return ReplayBatch(torch.from_numpy(seq_offsets), torch.from_numpy(data_offsets),
                       torch.from_numpy(data), torch.from_numpy(forms), torch.from_numpy(valid),
                       logprobs, int(vocab))


def _where(seq_offsets: np.ndarray, token: int) -> str:
    """'sequence s, token t' of a token's index in the batch."""
    s = int(np.searchsorted(seq_offsets, token, side="right")) - 1
    return f"sequence {s}, token {token - int(seq_offsets[s])}"


def _offsets(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def _checked_ids(ids: np.ndarray, offsets: np.ndarray, vocab: int,
                 seq_offsets: np.ndarray) -> np.ndarray:
    """The ids as int32, once each is known to lie in [0, vocab) and to be
    larger than the one before it in its row."""
    if not ids.size:
        return ids.astype(np.int32)
    # Bounds as Python ints: no comparison against a type's limits can wrap.
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        k = int(np.flatnonzero((ids < 0) | (ids >= vocab))[0])
        raise ValueError(f"{_where(seq_offsets, _row_of(offsets, k))}: id {ids[k]} is outside "
                         f"[0, {vocab})")
    ids = ids.astype(np.int32, copy=False)
    row_starts = np.zeros(ids.size, bool)
    row_starts[offsets[:-1][offsets[:-1] < ids.size]] = True
    not_rising = np.flatnonzero((ids[1:] <= ids[:-1]) & ~row_starts[1:])
    if not_rising.size:
        k = int(not_rising[0])
        raise ValueError(f"{_where(seq_offsets, _row_of(offsets, k))}: ids not strictly "
                         f"ascending: {ids[k]} then {ids[k + 1]}")
    return ids


def _row_of(offsets: np.ndarray, k: int) -> int:
    """The row holding the k-th id."""
    return int(np.searchsorted(offsets, k, side="right")) - 1


def _with_bitmasks(ids: np.ndarray, offsets: np.ndarray, forms: np.ndarray,
                   vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(id data, its offsets): the ids of ids-form rows as they are, each
    bitmask row's ids replaced by its words, all int32."""
    is_bitmask = forms == FORM_BITMASK
    if not is_bitmask.any():
        return ids, offsets
    words = -(-vocab // WORD_BITS)
    lengths = np.diff(offsets)
    data_lengths = np.where(is_bitmask, words, lengths)
    data_offsets = _offsets(data_lengths)
    data = np.zeros(int(data_offsets[-1]), np.int32)  # a bitmask's words start clear
    in_bitmask = np.repeat(is_bitmask, lengths)  # per id
    # ids-form rows keep their order: their ids fill their rows' places
    data[np.repeat(~is_bitmask, data_lengths)] = ids[~in_bitmask]
    # bitmask rows: each id is one bit of the word at its row's start + id // 32.
    # Ascending ids in ascending rows give ascending word positions, so each
    # word's bits are a run: one reduceat ors each run together.
    set_ids = ids[in_bitmask]
    word_at = (np.repeat(data_offsets[:-1][is_bitmask], lengths[is_bitmask])
               + set_ids // WORD_BITS)
    bits = np.left_shift(np.uint32(1), (set_ids % WORD_BITS).astype(np.uint32))
    runs = np.flatnonzero(np.diff(word_at, prepend=-1))
    data[word_at[runs]] = np.bitwise_or.reduceat(bits, runs).view(np.int32)
    return data, data_offsets
