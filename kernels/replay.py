"""Replay of the rollout's sampler in the trainer: each token's
log-probability under the trainer's logits restricted to the support the
rollout drew it from, and its gradient, without a dense mask.

    logp_S(t) = z[t, a_t] / T_t - logsumexp_{v in S_t} z[t, v] / T_t

A trainer that builds this by hand scatters the ids into a dense
[N, V] mask, masks the logits and takes a full log-softmax: two tensors of
the logits' size and a full read and write of them, for a quantity that
depends on the support's columns alone. Here one program a token reads
only the support's logits (the ids form: CSR ``offsets`` [N + 1] into
``ids``, each row's ids strictly ascending, as shmask's rows travel).

Rows with no defined result: an empty support, an id outside [0, V), ids
not strictly ascending, offsets outside ``ids``, the target outside the
support, ``valid`` False (a row whose status was not OK), or a
non-finite logsumexp. Their logp_S is NaN and their gradient is zero.

Backward: ``grad[t, v] = g_t (1[v = a_t] - p_S(v)) / T_t`` for v in S_t, 0
elsewhere; one program a token writes its whole gradient row (the zeros,
then the support's values) in the same pass, so no separate zero-fill.
The temperature gets no gradient.

Not here yet (issue 38): bitmask rows (top-p-only supports), the
vocab-parallel form, the full-vocabulary logp and support mass in the
same pass, collation from responses (``shmask.train``).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .checks import per_row

__all__ = ["reference_replay_logprobs", "replay_forward", "replay_logprobs"]

BLOCK = 1024  # support ids a step of one program
ZERO_BLOCK = 4096  # gradient columns zeroed a step


def _checked(logits: torch.Tensor, targets: torch.Tensor, offsets: torch.Tensor,
             ids: torch.Tensor, temperature: torch.Tensor | float,
             valid: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The arguments as the kernels read them, each wrong one named (no
    host sync: the offsets' and ids' values are checked by the kernels)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError("logits must be a [N, V] tensor")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"logits must be float64/32/16 or bfloat16, got {logits.dtype}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    n, _ = logits.shape
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
    return (logits, targets.to(device=device, dtype=torch.int64).contiguous(),
            offsets.to(device=device, dtype=torch.int64).contiguous(),
            ids.to(device=device, dtype=torch.int32).contiguous(), temp, ok)


def replay_forward(logits: torch.Tensor, targets: torch.Tensor, offsets: torch.Tensor,
                   ids: torch.Tensor, *, temperature: torch.Tensor | float = 1.0,
                   valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_S [N], logsumexp_S [N]) with no autograd graph: float32
    (float64 for float64 logits), NaN where a row has no defined result.
    ``temperature`` a positive scalar or [N] tensor; ``valid`` bool [N]."""
    args = _checked(logits, targets, offsets, ids, temperature, valid)
    return _forward(*args)


def _forward(logits: torch.Tensor, targets: torch.Tensor, offsets: torch.Tensor,
             ids: torch.Tensor, temp: torch.Tensor, ok: torch.Tensor,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    n, vocab = logits.shape
    acc = temp.dtype
    out = torch.empty(n, dtype=acc, device=logits.device)
    logz = torch.empty(n, dtype=acc, device=logits.device)
    if n:
        _replay_forward_kernel[(n,)](
            logits, logits.stride(0), vocab, targets, temp, offsets, ids, ids.numel(), ok,
            out, logz, BLOCK=BLOCK, F64=acc == torch.float64)
    return out, logz


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, offsets: torch.Tensor,
                ids: torch.Tensor, temp: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        out, logz = _forward(logits, targets, offsets, ids, temp, ok)
        ctx.save_for_backward(logits, targets, offsets, ids, temp, logz)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        logits, targets, offsets, ids, temp, logz = ctx.saved_tensors
        n, vocab = logits.shape
        grad = torch.empty((n, vocab), dtype=logits.dtype, device=logits.device)
        if n:
            _replay_backward_kernel[(n,)](
                logits, logits.stride(0), vocab, targets, temp, offsets, ids, logz,
                grad_out.to(temp.dtype).contiguous(), grad, BLOCK=BLOCK, ZERO_BLOCK=ZERO_BLOCK,
                F64=temp.dtype == torch.float64)
        return grad, None, None, None, None, None


def replay_logprobs(logits: torch.Tensor, targets: torch.Tensor, offsets: torch.Tensor,
                    ids: torch.Tensor, *, temperature: torch.Tensor | float = 1.0,
                    valid: torch.Tensor | None = None) -> torch.Tensor:
    """logp_S [N] of each token (differentiable in ``logits``): the
    target's log-probability under ``logits / temperature`` restricted to
    its support, row t's support ids ``ids[offsets[t]:offsets[t + 1]]``
    (strictly ascending). NaN, and no gradient, where a row has no defined
    result (the module docstring)."""
    return _Replay.apply(*_checked(logits, targets, offsets, ids, temperature, valid))


@triton.jit
def _support_block(logits_row, vocab, ids_ptr, idx, live, inv_t, F64: tl.constexpr):
    """One block of a row's support: ids, which are in [0, V), and their
    scaled logits (-inf where not live or out of range)."""
    ids = tl.load(ids_ptr + idx, mask=live, other=0)
    in_range = (ids >= 0) & (ids < vocab)
    z = tl.load(logits_row + ids, mask=live & in_range, other=float("-inf"))
    z = z.to(tl.float64) if F64 else z.to(tl.float32)
    return ids, in_range, z * inv_t


@triton.jit
def _row_span(offsets_ptr, nnz, row):
    """The row's [start, end) in ids, and whether the offsets are sound
    (inside ids, not decreasing, not empty)."""
    start = tl.load(offsets_ptr + row)
    end = tl.load(offsets_ptr + row + 1)
    sound = (start >= 0) & (end <= nnz) & (end > start)
    return tl.where(sound, start, 0), tl.where(sound, end, 0), sound


@triton.jit
def _replay_forward_kernel(
    logits_ptr, stride_row, vocab, target_ptr, temp_ptr, offsets_ptr, ids_ptr, nnz, ok_ptr,
    out_ptr, logz_ptr, BLOCK: tl.constexpr, F64: tl.constexpr,
):
    """Program per token: an online logsumexp over the support's logits
    (block maxima, the running sum rescaled), whether the target is in the
    support, and the checks that make a row undefined."""
    row = tl.program_id(0)
    logits_row = logits_ptr + row.to(tl.int64) * stride_row
    start, end, sound = _row_span(offsets_ptr, nnz, row)
    target = tl.load(target_ptr + row)
    inv_t = 1.0 / tl.load(temp_ptr + row)
    m = tl.full([], float("-inf"), tl.float64 if F64 else tl.float32)
    s = tl.zeros([], dtype=tl.float64 if F64 else tl.float32)
    found = tl.zeros([], dtype=tl.int1)
    bad = tl.zeros([], dtype=tl.int1)
    for first in range(start, end, BLOCK):
        idx = first + tl.arange(0, BLOCK)
        live = idx < end
        ids, in_range, z = _support_block(logits_row, vocab, ids_ptr, idx, live, inv_t, F64)
        before = tl.load(ids_ptr + idx - 1, mask=live & (idx > start), other=-1)
        bad |= tl.max((live & (~in_range | (ids <= before))).to(tl.int32), axis=0) > 0
        found |= tl.max((live & (ids == target)).to(tl.int32), axis=0) > 0
        new_m = tl.maximum(m, tl.max(z, axis=0))
        # all -inf so far: nothing to rescale (exp(-inf - -inf) is NaN)
        scale = tl.where(new_m == float("-inf"), 0.0, tl.exp(m - new_m))
        terms = tl.where(z == float("-inf"), 0.0, tl.exp(z - new_m))
        s = s * scale + tl.sum(terms, axis=0)
        m = new_m
    logz = m + tl.log(s)
    target_ok = (target >= 0) & (target < vocab)
    z_t = tl.load(logits_row + tl.where(target_ok, target, 0))
    z_t = (z_t.to(tl.float64) if F64 else z_t.to(tl.float32)) * inv_t
    ok = (sound & ~bad & found & target_ok & (tl.load(ok_ptr + row) != 0)
          & (tl.abs(logz) < float("inf")) & (tl.abs(z_t) < float("inf")))
    tl.store(out_ptr + row, tl.where(ok, z_t - logz, float("nan")))
    tl.store(logz_ptr + row, tl.where(ok, logz, float("nan")))


@triton.jit
def _replay_backward_kernel(
    logits_ptr, stride_row, vocab, target_ptr, temp_ptr, offsets_ptr, ids_ptr, logz_ptr,
    grad_out_ptr, grad_ptr, BLOCK: tl.constexpr, ZERO_BLOCK: tl.constexpr, F64: tl.constexpr,
):
    """Program per token: its gradient row, zeros and then
    g (1[v = a] - exp(z_v / T - logsumexp)) / T at the support's ids; a row
    the forward left undefined (NaN logsumexp) stays zero."""
    row = tl.program_id(0)
    grad_row = grad_ptr + row.to(tl.int64) * vocab
    for first in range(0, vocab, ZERO_BLOCK):
        cols = first + tl.arange(0, ZERO_BLOCK)
        tl.store(grad_row + cols, tl.zeros([ZERO_BLOCK], dtype=grad_ptr.dtype.element_ty),
                 mask=cols < vocab)
    tl.debug_barrier()  # the zeros, before this row's support values land on them
    logz = tl.load(logz_ptr + row)
    g = tl.load(grad_out_ptr + row)
    if logz == logz:  # defined (NaN otherwise)
        logits_row = logits_ptr + row.to(tl.int64) * stride_row
        # the forward found this row's offsets sound and its ids in range
        start = tl.load(offsets_ptr + row)
        end = tl.load(offsets_ptr + row + 1)
        target = tl.load(target_ptr + row)
        inv_t = 1.0 / tl.load(temp_ptr + row)
        for first in range(start, end, BLOCK):
            idx = first + tl.arange(0, BLOCK)
            live = idx < end
            ids, in_range, z = _support_block(logits_row, vocab, ids_ptr, idx, live, inv_t, F64)
            p = tl.exp(z - logz)
            value = g * (tl.where(ids == target, 1.0, 0.0) - p) * inv_t
            tl.store(grad_row + ids, value.to(grad_ptr.dtype.element_ty), mask=live & in_range)


# ---------------------------------------------------------------- reference


def reference_replay_logprobs(logits: torch.Tensor, targets: torch.Tensor, offsets: torch.Tensor,
                              ids: torch.Tensor, *, temperature: torch.Tensor | float = 1.0,
                              valid: torch.Tensor | None = None,
                              compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The dense-mask computation a trainer writes by hand (scatter the ids
    into a [N, V] mask, masked log-softmax, gather), in ``compute_dtype``,
    differentiable; NaN where :func:`replay_logprobs` gives NaN."""
    n, vocab = logits.shape
    temp = per_row(temperature, n, compute_dtype, logits.device, "temperature", 1.0)
    ok = per_row(valid, n, torch.bool, logits.device, "valid", True)
    offsets = offsets.to(torch.int64).cpu()
    ids = ids.to(torch.int64).cpu()
    mask = torch.zeros(n, vocab, dtype=torch.bool)
    sound = torch.ones(n, dtype=torch.bool)
    for t in range(n):
        start, end = int(offsets[t]), int(offsets[t + 1])
        row = ids[max(start, 0):max(end, 0)]
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
