"""Replay of the rollout's sampler in the trainer: each token's
log-probability under the trainer's logits restricted to the support the
rollout drew it from, and its gradient, without a dense mask.

    logp_S(t) = z[t, a_t] / T_t - logsumexp_{v in S_t} z[t, v] / T_t

A trainer that builds this by hand scatters the ids into a dense
[N, V] mask, masks the logits and takes a full log-softmax: two tensors of
the logits' size and a full read and write of them, for a quantity that
depends on the support's columns alone. Here one program a token reads
only the support's logits, in the forms shmask's rows travel in (CSR
``offsets`` [N + 1] into ``ids``, ``forms`` [N]): an ids-form row's ids,
strictly ascending (a gather of L logits), or a bitmask row's
ceil(V / 32) words, bit j of word w for id 32 w + j (a contiguous read of
the row: a bitmask row holds at least V / 32 ids, a top-p-only support).
``ids`` int32, or int64 read as such (no id wraps onto another; a bitmask
word is then its element's low 32 bits).

Rows with no defined result: an empty support, an id outside [0, V), ids
not strictly ascending, offsets outside ``ids``, a bitmask row of another
word count or with bits at ids >= V, the target outside the support,
``valid`` False (a row whose status was not OK), or a non-finite
logsumexp. Their logp_S is NaN and their gradient is zero.

Backward: ``grad[t, v] = g_t (1[v = a_t] - p_S(v)) / T_t`` for v in S_t, 0
elsewhere; one program a token writes its whole gradient row (an ids
row block by block: a block's zeros, then the support's values in it
while the block is in L2; a bitmask row: each column once, its value or
0) in the same pass, so no separate zero-fill. An ids row's values come
from the scaled logits its forward kept when a gradient is wanted
(``nnz`` floats, read in order beside the ids), not from a second gather
of the logits: a block's values then wait on one read, not on the ids'
read and the gather after it.
The temperature gets no gradient.

With ``full=True`` the same launch reads each whole row too, for the
target's full-vocabulary logp and the support's mass under the trainer's
policy (the truncated importance ratio's and diagnostics' inputs).

Vocab-parallel (:func:`replay_logprobs_vocab_parallel`): logits sharded
by vocabulary over a tensor-parallel group; each rank reads the support
ids in its range, and the max and sum are all-reduced.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from .checks import per_row

__all__ = ["ReplayOutput", "reference_replay_logprobs", "replay_forward", "replay_logprobs",
           "replay_logprobs_vocab_parallel"]

BLOCK = 1024  # support ids a step of one program (forward)
# Bitmask words a step: 64 in the forward (2,048 columns; on the H200,
# N = 16,384 rows of 40%: 1,967 us against 2,472 at 32 and 2,129 at 128),
# 32 in the backward, whose tile also holds the values it writes.
WORD_BLOCK, BACKWARD_WORD_BLOCK = 64, 32
FULL_BLOCK = 4096  # columns a step of the forward's whole-row read (full=True)
# The backward's shape. An ids row holds BACKWARD_CHUNK support ids and
# their values in registers and writes ZERO_BLOCK columns a step; on the
# H100 (N = 16,384, 1,000 / 4,096 / 1 ids a row / 40% bitmask rows, us;
# the committed walk before it, reading each block's ids after its zeros:
# 2,022 / 2,198 / 1,568 / 3,618): 4 warps, 2,048 columns 1,902 / 2,106 /
# 1,565 / 3,587; 4,096 columns 1,948 / 2,152 / 1,563 / 3,585; 8,192 1,998
# / 2,318; 8 warps 1,908-1,945 / 2,080-2,167 (no better); chunks of 2,048
# ids 1,848 / 2,080 but the bitmask rows 4,191 (registers: one kernel
# serves both forms). benchmarks/replay_variants.py measures them again.
ZERO_BLOCK = 2048  # gradient columns written a step (an ids row's block)
BACKWARD_CHUNK = 1024  # support ids (and their values) a program of the backward holds at once
BACKWARD_WARPS = 4
IDS, BITMASK = 0, 1  # a row's form (shmask.kernels.Form)


# logits, targets, offsets, ids, temperature, valid, forms: as the kernels read them
_Args = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
              torch.Tensor]


def _checked(logits: torch.Tensor, targets: torch.Tensor, offsets: torch.Tensor,
             ids: torch.Tensor, temperature: torch.Tensor | float,
             valid: torch.Tensor | None, forms: torch.Tensor | None) -> _Args:
    """The arguments as the kernels read them, each wrong one named (no
    host sync: the offsets' and ids' values are checked by the kernels)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError("logits must be a [N, V] tensor")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"logits must be float64/32/16 or bfloat16, got {logits.dtype}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    n, columns = logits.shape
    if columns == 0:
        raise ValueError("logits must have at least one column (of the vocabulary, or of "
                         "this rank's shard)")
    device = logits.device
    for name, t, shape in (("targets", targets, (n,)), ("offsets", offsets, (n + 1,))):
        if not isinstance(t, torch.Tensor) or t.shape != shape:
            raise ValueError(f"{name} must be a tensor of shape {shape}")
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got {t.dtype}")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1:
        raise ValueError("ids must be a 1-D tensor (every row's support ids, concatenated)")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"ids must hold integers, got {ids.dtype}")
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    temp = per_row(temperature, n, acc, device, "temperature", 1.0, low=1e-30)
    ok = per_row(valid, n, torch.int8, device, "valid", True)
    form = per_row(forms, n, torch.int32, device, "forms", IDS)
    return (logits, targets.to(device=device, dtype=torch.int64).contiguous(),
            offsets.to(device=device, dtype=torch.int64).contiguous(),
            # int64 ids stay int64: a cast would wrap an id past 2**31 onto a
            # real one, which the kernel's range check could then not see
            ids.to(device=device, dtype=ids.dtype if ids.dtype == torch.int64 else torch.int32)
            .contiguous(), temp, ok, form)


def replay_forward(logits: torch.Tensor, targets: torch.Tensor, offsets: torch.Tensor,
                   ids: torch.Tensor, *, temperature: torch.Tensor | float = 1.0,
                   valid: torch.Tensor | None = None, forms: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_S [N], logsumexp_S [N]) with no autograd graph: float32
    (float64 for float64 logits), NaN where a row has no defined result.
    ``temperature`` a positive scalar or [N] tensor; ``valid`` bool [N];
    ``forms`` int [N] (0: ids, 1: bitmask words; all ids when None)."""
    out, logz, _, _, _ = _forward(*_checked(logits, targets, offsets, ids, temperature, valid,
                                            forms), full=False)
    return out, logz


def _launch_forward(logits: torch.Tensor, col_start: int, vocab: int, targets: torch.Tensor,
                    temp: torch.Tensor, offsets: torch.Tensor, ids: torch.Tensor,
                    ok: torch.Tensor, form: torch.Tensor, outputs: tuple[torch.Tensor, ...],
                    full: bool, partial: bool, save: bool) -> torch.Tensor | None:
    """_replay_forward_kernel over the rows into ``outputs`` (four [N]
    tensors); with ``save``, the ids rows' scaled logits the backward
    reads (``zs``, aligned with ``ids``; -inf at an id another shard
    holds), else None."""
    n, n_cols = logits.shape
    zs = torch.empty(ids.numel(), dtype=temp.dtype, device=logits.device) if save else None
    # without save the kernel has no zs store (SAVE off): an output stands in
    if n:
        _replay_forward_kernel[(n,)](
            logits, logits.stride(0), col_start, n_cols, vocab, targets, temp, offsets, ids,
            ids.numel(), ok, form, *outputs, outputs[0] if zs is None else zs, BLOCK=BLOCK,
            WORD_BLOCK=WORD_BLOCK, ROW_BLOCK=FULL_BLOCK, FULL=full, PARTIAL=partial,
            F64=temp.dtype == torch.float64, SAVE=save)
    return zs


def _forward(logits: torch.Tensor, targets: torch.Tensor, offsets: torch.Tensor,
             ids: torch.Tensor, temp: torch.Tensor, ok: torch.Tensor, form: torch.Tensor,
             full: bool, save: bool = False,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """logp_S, logsumexp_S and, with ``full`` (else empty), the target's
    full-vocabulary logp and the support's mass, from one launch; with
    ``save``, the scaled logits the backward reads."""
    n, vocab = logits.shape
    acc = temp.dtype
    out = torch.empty(n, dtype=acc, device=logits.device)
    logz = torch.empty(n, dtype=acc, device=logits.device)
    logp_full = torch.empty(n if full else 0, dtype=acc, device=logits.device)
    mass = torch.empty(n if full else 0, dtype=acc, device=logits.device)
    zs = _launch_forward(logits, 0, vocab, targets, temp, offsets, ids, ok, form,
                         (out, logz, logp_full, mass), full, False, save)
    return out, logz, logp_full, mass, zs


def _backward(logits: torch.Tensor, col_start: int, vocab: int, targets: torch.Tensor,
              temp: torch.Tensor, offsets: torch.Tensor, ids: torch.Tensor, form: torch.Tensor,
              logz: torch.Tensor, zs: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """The dense gradient of logits (or of a shard holding columns from
    ``col_start``): each row written once, in one launch; ``zs`` what the
    forward kept."""
    n, n_cols = logits.shape
    grad = torch.empty((n, n_cols), dtype=logits.dtype, device=logits.device)
    if n:
        _replay_backward_kernel[(n,)](
            logits, logits.stride(0), col_start, n_cols, vocab, targets, temp, offsets, ids, zs,
            form, logz, grad_out.to(temp.dtype).contiguous(), grad,
            WORD_BLOCK=BACKWARD_WORD_BLOCK, ZERO_BLOCK=ZERO_BLOCK, CHUNK=BACKWARD_CHUNK,
            F64=temp.dtype == torch.float64, num_warps=BACKWARD_WARPS)
    return grad


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, offsets: torch.Tensor,
                ids: torch.Tensor, temp: torch.Tensor, ok: torch.Tensor, form: torch.Tensor,
                full: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out, logz, logp_full, mass, zs = _forward(logits, targets, offsets, ids, temp, ok, form,
                                                  full, save=ctx.needs_input_grad[0])
        if zs is not None:
            ctx.save_for_backward(logits, targets, offsets, ids, temp, form, logz, zs)
        ctx.mark_non_differentiable(logp_full, mass)
        return out, logp_full, mass

    @staticmethod
    @once_differentiable  # the gradient is not itself differentiable: say so, not zero
    def backward(ctx: Any, grad_out: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        logits, targets, offsets, ids, temp, form, logz, zs = ctx.saved_tensors
        n, vocab = logits.shape
        grad = _backward(logits, 0, vocab, targets, temp, offsets, ids, form, logz, zs, grad_out)
        return grad, None, None, None, None, None, None, None


class ReplayOutput(NamedTuple):
    """replay_logprobs(..., full=True): logp_S (with the gradient), the
    target's full-vocabulary logp and the support's mass under the
    trainer's policy, exp(logsumexp_S - logsumexp_V) (no gradient)."""

    logp_support: torch.Tensor
    logp_full: torch.Tensor
    support_mass: torch.Tensor


def replay_logprobs(logits: torch.Tensor, targets: torch.Tensor, offsets: torch.Tensor,
                    ids: torch.Tensor, *, temperature: torch.Tensor | float = 1.0,
                    valid: torch.Tensor | None = None, forms: torch.Tensor | None = None,
                    full: bool = False) -> Any:
    """logp_S [N] of each token (differentiable in ``logits``): the
    target's log-probability under ``logits / temperature`` restricted to
    its support, row t's id data ``ids[offsets[t]:offsets[t + 1]]``: its
    ascending ids, or its bitmask words where ``forms[t]`` is 1. NaN, and
    no gradient, where a row has no defined result (the module docstring).
    ``full=True``: a :class:`ReplayOutput`, the same launch also reading
    each whole row for the target's full-vocabulary logp (NaN only for a
    target outside [0, V) or a non-finite row) and the support's mass
    (NaN where logp_S is)."""
    out, logp_full, mass = _Replay.apply(
        *_checked(logits, targets, offsets, ids, temperature, valid, forms), full)
    return ReplayOutput(out, logp_full, mass) if full else out


class _ReplayVocabParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, targets: torch.Tensor, offsets: torch.Tensor,
                ids: torch.Tensor, temp: torch.Tensor, ok: torch.Tensor, form: torch.Tensor,
                vocab_start: int, vocab: int, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        n = shard.shape[0]
        acc = temp.dtype
        m, s, z_t, checks = (torch.empty(n, dtype=acc, device=shard.device) for _ in range(4))
        zs = _launch_forward(shard, vocab_start, vocab, targets, temp, offsets, ids, ok, form,
                             (m, s, z_t, checks), False, True, ctx.needs_input_grad[0])
        # the row's max, then every shard's sum rescaled to it, and the
        # target's logit from the shard that holds it (-inf elsewhere)
        m_all = m.clone()
        dist.all_reduce(m_all, dist.ReduceOp.MAX, group=group)
        s_all = torch.where(m == float("-inf"), 0.0, s * torch.exp(m - m_all))
        dist.all_reduce(s_all, dist.ReduceOp.SUM, group=group)
        dist.all_reduce(z_t, dist.ReduceOp.MAX, group=group)
        logz = m_all + torch.log(s_all)
        defined = (checks > 0) & logz.isfinite() & z_t.isfinite()
        nan = torch.full_like(logz, float("nan"))
        logz = torch.where(defined, logz, nan)
        if zs is not None:
            ctx.save_for_backward(shard, targets, offsets, ids, temp, form, logz, zs)
        ctx.vocab_start, ctx.vocab = vocab_start, vocab
        return torch.where(defined, z_t - logz, nan)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        shard, targets, offsets, ids, temp, form, logz, zs = ctx.saved_tensors
        grad = _backward(shard, ctx.vocab_start, ctx.vocab, targets, temp, offsets, ids, form,
                         logz, zs, grad_out)
        return grad, None, None, None, None, None, None, None, None, None


def replay_logprobs_vocab_parallel(
    logits_shard: torch.Tensor, targets: torch.Tensor, offsets: torch.Tensor, ids: torch.Tensor,
    *, vocab_start: int, vocab: int, group: Any = None,
    temperature: torch.Tensor | float = 1.0, valid: torch.Tensor | None = None,
    forms: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`replay_logprobs` with the logits sharded by vocabulary over
    a tensor-parallel group (Megatron's layout: this rank holds columns
    [vocab_start, vocab_start + logits_shard.shape[1]) of ``vocab``). Every
    rank passes the same targets and supports; each reads the logits of
    the support ids it holds, the max and the sum are all-reduced over
    ``group`` (torch.distributed; None: the default group), and each
    rank's gradient is its shard's, with no communication in backward.
    The same result on every rank, and the unsharded call's up to the
    order of the sums."""
    if not isinstance(vocab_start, int) or not isinstance(vocab, int) or not (
            0 <= vocab_start and vocab_start + logits_shard.shape[-1] <= vocab):
        raise ValueError(f"the shard [{vocab_start}, {vocab_start} + "
                         f"{logits_shard.shape[-1]}) does not lie in a vocabulary of {vocab}")
    args = _checked(logits_shard, targets, offsets, ids, temperature, valid, forms)
    return _ReplayVocabParallel.apply(*args, vocab_start, vocab, group)


@triton.jit
def _to_acc(x, F64: tl.constexpr):
    return x.to(tl.float64) if F64 else x.to(tl.float32)


@triton.jit
def _support_block(logits_row, col_start, n_cols, vocab, ids_ptr, idx, live, inv_t,
                   F64: tl.constexpr):
    """One block of an ids row: its ids, which are in [0, V), which of them
    this shard holds ([col_start, col_start + n_cols): all of them unless
    vocab-parallel), and their scaled logits (-inf where not held)."""
    ids = tl.load(ids_ptr + idx, mask=live, other=0)
    in_range = (ids >= 0) & (ids < vocab)
    mine = live & (ids >= col_start) & (ids < col_start + n_cols)
    z = tl.load(logits_row + (ids - col_start), mask=mine, other=float("-inf"))
    return ids, in_range, mine, _to_acc(z, F64) * inv_t


@triton.jit
def _row_span(offsets_ptr, nnz, row):
    """The row's [start, end) in ids, and whether the offsets are sound
    (inside ids, not decreasing, not empty)."""
    start = tl.load(offsets_ptr + row)
    end = tl.load(offsets_ptr + row + 1)
    sound = (start >= 0) & (end <= nnz) & (end > start)
    return tl.where(sound, start, 0), tl.where(sound, end, 0), sound


@triton.jit
def _bitmask_block(logits_row, col_start, n_cols, ids_ptr, start, word0, word_end, inv_t,
                   WORD_BLOCK: tl.constexpr, F64: tl.constexpr):
    """Words [word0, word0 + WORD_BLOCK) (below word_end) of a bitmask row
    as a [WORD_BLOCK, 32] tile: global columns, which bits are set among
    the columns this shard holds, and their scaled logits."""
    words = word0 + tl.arange(0, WORD_BLOCK)
    bits = tl.load(ids_ptr + start + words, mask=words < word_end, other=0)
    lane = tl.arange(0, 32)
    cols = words[:, None] * 32 + lane[None, :]
    mine = (cols >= col_start) & (cols < col_start + n_cols)
    set_ = mine & (((bits[:, None] >> lane[None, :]) & 1) != 0)
    z = tl.load(logits_row + (cols - col_start), mask=mine, other=float("-inf"))
    return cols, set_, mine, _to_acc(z, F64) * inv_t


@triton.jit
def _online(m, s, z, keep):
    """The running logsumexp (max m, sum s of exp(z - m)) with the kept z."""
    z = tl.where(keep, z, float("-inf"))
    new_m = tl.maximum(m, tl.max(z))
    # all -inf so far: nothing to rescale (exp(-inf - -inf) is NaN)
    scale = tl.where(new_m == float("-inf"), 0.0, tl.exp(m - new_m))
    terms = tl.where(z == float("-inf"), 0.0, tl.exp(z - new_m))
    return new_m, s * scale + tl.sum(terms)


@triton.jit
def _replay_forward_kernel(
    logits_ptr, stride_row, col_start, n_cols, vocab, target_ptr, temp_ptr, offsets_ptr, ids_ptr,
    nnz, ok_ptr, form_ptr, out_ptr, logz_ptr, full_ptr, mass_ptr, zs_ptr, BLOCK: tl.constexpr,
    WORD_BLOCK: tl.constexpr, ROW_BLOCK: tl.constexpr, FULL: tl.constexpr,
    PARTIAL: tl.constexpr, F64: tl.constexpr, SAVE: tl.constexpr,
):
    """Program per token: an online logsumexp over the support's logits
    (block maxima, the running sum rescaled), whether the target is in the
    support, and the checks that make a row undefined (each from the
    row's whole id data, so every shard of a vocab-parallel call agrees).
    PARTIAL (vocab-parallel): this shard's max and sum, the target's
    scaled logit where this shard holds it (else -inf) and whether the
    row's checks passed, into out, logz, full and mass, for the caller's
    all-reduces. SAVE (a gradient is wanted): an ids row's scaled logits
    into zs (its ids' places; -inf where another shard holds the id)."""
    row = tl.program_id(0)
    logits_row = logits_ptr + row.to(tl.int64) * stride_row
    start, end, sound = _row_span(offsets_ptr, nnz, row)
    target = tl.load(target_ptr + row)
    target_ok = (target >= 0) & (target < vocab)
    safe_target = tl.where(target_ok, target, 0)
    inv_t = 1.0 / tl.load(temp_ptr + row)
    m = tl.full([], float("-inf"), tl.float64 if F64 else tl.float32)
    s = tl.zeros([], dtype=tl.float64 if F64 else tl.float32)
    found = tl.zeros([], dtype=tl.int1)
    bad = tl.zeros([], dtype=tl.int1)
    if tl.load(form_ptr + row) == 1:
        # a bitmask row: exactly ceil(V / 32) words, no bit at an id >= V
        n_words = (vocab + 31) // 32
        bad = end - start != n_words
        if ~bad:
            last = tl.load(ids_ptr + start + n_words - 1)
            bad = (vocab % 32 != 0) & ((last >> (vocab % 32)) != 0)
            # only the words that cover this shard's columns
            for word0 in range(col_start // 32, (col_start + n_cols + 31) // 32, WORD_BLOCK):
                cols, set_, mine, z = _bitmask_block(logits_row, col_start, n_cols, ids_ptr, start,
                                                     word0, n_words, inv_t, WORD_BLOCK, F64)
                m, s = _online(m, s, z, set_)
            word = tl.load(ids_ptr + start + safe_target // 32)
            found = ((word >> (safe_target % 32)) & 1) != 0
    else:
        for first in range(start, end, BLOCK):
            idx = first + tl.arange(0, BLOCK)
            live = idx < end
            ids, in_range, mine, z = _support_block(logits_row, col_start, n_cols, vocab, ids_ptr,
                                                    idx, live, inv_t, F64)
            before = tl.load(ids_ptr + idx - 1, mask=live & (idx > start), other=-1)
            bad |= tl.max((live & (~in_range | (ids <= before))).to(tl.int32)) > 0
            found |= tl.max((live & (ids == target)).to(tl.int32)) > 0
            m, s = _online(m, s, z, mine)
            if SAVE:
                tl.store(zs_ptr + idx, z, mask=live)
    held = target_ok & (target >= col_start) & (target < col_start + n_cols)
    z_t = _to_acc(tl.load(logits_row + tl.where(held, target - col_start, 0), mask=held,
                          other=0.0), F64) * inv_t
    z_t = tl.where(held, z_t, float("-inf"))
    checks = sound & ~bad & found & target_ok & (tl.load(ok_ptr + row) != 0)
    if PARTIAL:
        tl.store(out_ptr + row, m)
        tl.store(logz_ptr + row, s)
        tl.store(full_ptr + row, z_t)
        tl.store(mass_ptr + row, checks.to(tl.float32))
    else:
        logz = m + tl.log(s)
        ok = checks & (tl.abs(logz) < float("inf")) & (tl.abs(z_t) < float("inf"))
        tl.store(out_ptr + row, tl.where(ok, z_t - logz, float("nan")))
        tl.store(logz_ptr + row, tl.where(ok, logz, float("nan")))
        if FULL:
            # the whole row's logsumexp (a read of it, as a trainer's own
            # log-softmax makes): the target's logp under the full policy
            # and the support's share of it
            m_v = tl.full([], float("-inf"), tl.float64 if F64 else tl.float32)
            s_v = tl.zeros([], dtype=tl.float64 if F64 else tl.float32)
            for col0 in range(0, vocab, ROW_BLOCK):
                cols = col0 + tl.arange(0, ROW_BLOCK)
                z = tl.load(logits_row + cols, mask=cols < vocab, other=float("-inf"))
                m_v, s_v = _online(m_v, s_v, _to_acc(z, F64) * inv_t, cols < vocab)
            logz_v = m_v + tl.log(s_v)
            full_ok = target_ok & (tl.abs(logz_v) < float("inf")) & (tl.abs(z_t) < float("inf"))
            tl.store(full_ptr + row, tl.where(full_ok, z_t - logz_v, float("nan")))
            tl.store(mass_ptr + row, tl.where(ok & full_ok, tl.exp(logz - logz_v), float("nan")))


@triton.jit
def _gradient(g, ids, target, z, logz, inv_t):
    """d logp_S / d logit at ``ids`` (z: their logits / T), times the
    incoming g: g (1[id = a] - exp(z - logsumexp_S)) / T."""
    return g * (tl.where(ids == target, 1.0, 0.0) - tl.exp(z - logz)) * inv_t


@triton.jit
def _replay_backward_kernel(
    logits_ptr, stride_row, col_start, n_cols, vocab, target_ptr, temp_ptr, offsets_ptr, ids_ptr,
    zs_ptr, form_ptr, logz_ptr, grad_out_ptr, grad_ptr, WORD_BLOCK: tl.constexpr,
    ZERO_BLOCK: tl.constexpr, CHUNK: tl.constexpr, F64: tl.constexpr,
):
    """Program per token: its gradient row (this shard's columns),
    g (1[v = a] - exp(z_v / T - logsumexp)) / T at the support's ids and 0
    elsewhere, each column written once from the program's own registers
    or just after (a bitmask row's tile holds its values; an ids row's
    block is zeroed, then the support ids in it written, with the scaled
    logits the forward kept in zs); a row the forward left undefined (NaN
    logsumexp) all zeros."""
    row = tl.program_id(0)
    grad_row = grad_ptr + row.to(tl.int64) * n_cols
    logz = tl.load(logz_ptr + row)
    defined = logz == logz  # NaN otherwise
    bitmask = tl.load(form_ptr + row) == 1
    g = tl.load(grad_out_ptr + row)
    logits_row = logits_ptr + row.to(tl.int64) * stride_row
    # the forward found a defined row's offsets sound and its ids in range
    start = tl.load(offsets_ptr + row)
    end = tl.load(offsets_ptr + row + 1)
    target = tl.load(target_ptr + row)
    inv_t = 1.0 / tl.load(temp_ptr + row)
    if defined & bitmask:
        for word0 in range(col_start // 32, (col_start + n_cols + 31) // 32, WORD_BLOCK):
            cols, set_, mine, z = _bitmask_block(logits_row, col_start, n_cols, ids_ptr, start,
                                                 word0, (vocab + 31) // 32, inv_t, WORD_BLOCK,
                                                 F64)
            value = _gradient(g, cols, target, z, logz, inv_t)
            tl.store(grad_row + (cols - col_start),
                     tl.where(set_, value, 0.0).to(grad_ptr.dtype.element_ty), mask=mine)
    else:
        # Block by block: a block's zeros, then the support values that fall
        # in it, while its sectors are still in L2. Zeroing the whole row
        # first sent each value's 2-byte write to a sector already evicted:
        # a read-modify-write of DRAM per support id (the H200 probe: the
        # backward 2.9 ms against the gradient write's 1.5). The support is
        # read CHUNK ids at a time (one read for a row of up to CHUNK ids)
        # and its values held in registers; each block then takes its ids
        # by a mask, so no block waits on a read or a count of its ids.
        end = tl.where(defined, end, start)  # an undefined row: zeros alone
        zeros = tl.zeros([ZERO_BLOCK], dtype=grad_ptr.dtype.element_ty)
        zeroed = tl.zeros([], dtype=tl.int32)  # columns [0, zeroed) written
        for first in range(start, end, CHUNK):
            idx = first + tl.arange(0, CHUNK)
            live = idx < end
            ids = tl.load(ids_ptr + idx, mask=live, other=0)
            z = tl.load(zs_ptr + idx, mask=live, other=0.0)
            col = ids - col_start  # the id's column in this shard (int64 ids stay int64)
            mine = live & (col >= 0) & (col < n_cols)
            value = _gradient(g, ids, target, z, logz, inv_t).to(grad_ptr.dtype.element_ty)
            # ids in a block an earlier chunk zeroed (its barrier passed)
            tl.store(grad_row + col, value, mask=mine & (col < zeroed))
            last = tl.max(tl.where(mine, col, -1))  # ascending: the chunk's last held column
            while zeroed <= last:
                cols = zeroed + tl.arange(0, ZERO_BLOCK)
                tl.store(grad_row + cols, zeros, mask=cols < n_cols)
                tl.debug_barrier()  # the block's zeros, before its support values land on them
                tl.store(grad_row + col, value,
                         mask=mine & (col >= zeroed) & (col < zeroed + ZERO_BLOCK))
                zeroed += ZERO_BLOCK
        for col0 in range(zeroed, n_cols, ZERO_BLOCK):  # past the last held id: zeros alone
            cols = col0 + tl.arange(0, ZERO_BLOCK)
            tl.store(grad_row + cols, zeros, mask=cols < n_cols)


# ---------------------------------------------------------------- reference


def reference_replay_logprobs(logits: torch.Tensor, targets: torch.Tensor, offsets: torch.Tensor,
                              ids: torch.Tensor, *, temperature: torch.Tensor | float = 1.0,
                              valid: torch.Tensor | None = None,
                              forms: torch.Tensor | None = None,
                              compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The dense-mask computation a trainer writes by hand (scatter the ids
    into a [N, V] mask, masked log-softmax, gather), in ``compute_dtype``,
    differentiable; NaN where :func:`replay_logprobs` gives NaN."""
    n, vocab = logits.shape
    temp = per_row(temperature, n, compute_dtype, logits.device, "temperature", 1.0)
    ok = per_row(valid, n, torch.bool, logits.device, "valid", True)
    form = per_row(forms, n, torch.int32, torch.device("cpu"), "forms", IDS)
    offsets = offsets.to(torch.int64).cpu()
    ids = ids.to(torch.int64).cpu()
    mask = torch.zeros(n, vocab, dtype=torch.bool)
    sound = torch.ones(n, dtype=torch.bool)
    n_words = (vocab + 31) // 32
    for t in range(n):
        start, end = int(offsets[t]), int(offsets[t + 1])
        data = ids[max(start, 0):max(end, 0)]
        if int(form[t]) == BITMASK:
            bits = (data[:, None] >> torch.arange(32)) & 1  # int64: no sign to carry
            row = (bits.reshape(-1) != 0).nonzero()[:, 0]
            if len(data) != n_words:
                row = torch.tensor([-1])
        else:
            row = data
        if not (0 <= start < end <= ids.numel()) or not ((row >= 0) & (row < vocab)).all() \
                or not (row[1:] > row[:-1]).all():
            sound[t] = False
            continue
        mask[t, row] = True
    mask = mask.to(logits.device)
    z = logits.to(compute_dtype) / temp[:, None]
    logp = torch.log_softmax(z.masked_fill(~mask, float("-inf")), dim=1)
    t_ok = (targets >= 0) & (targets < vocab)
    safe = torch.where(t_ok, targets, 0).to(torch.int64)[:, None]
    out = logp.gather(1, safe)[:, 0]
    defined = sound.to(logits.device) & ok & t_ok & mask.gather(1, safe)[:, 0] & out.isfinite()
    return torch.where(defined, out, torch.full_like(out, float("nan")))
