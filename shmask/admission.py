"""Which requests for sampling masks a server admits (issue 36, items 2 and 7).

One rule, torch-free, for every server that returns masks in SGLang's
shape: the patched SGLang scheduler (``shmask.adapters.sglang_sampler.
sampling_mask_refusal``) and the example server (examples/server.py), so a
client sees the same 400 from both. ``shmask.kernels.check_admission`` is
the kernels' own check of their arguments (a capture call's settings
against its ``max_tokens``), not a server's request rule.
"""

from __future__ import annotations

import numpy as np

# SGLang's normalised top_k for "all" (-1 in a request): TOP_K_ALL
TOP_K_ALL = 1 << 30


def sampling_mask_refusal(*, top_k: int, top_p: float, min_p: float, cap: int,
                          vocab: int | None = None, capture: str = "shmask",
                          past_cap: str = "exact") -> str | None:
    """Why a request that asks for sampling masks is refused (the 400's
    message), or None to admit it. ``top_k`` as SGLang normalises it (-1 or
    TOP_K_ALL: all), ``cap`` is --sampling-mask-max-tokens, ``vocab`` the
    model's vocabulary size when known, ``capture`` and ``past_cap`` the
    SHMASK_CAPTURE and SHMASK_PAST_CAP settings (a PD prefill server passes
    "status").

    Released SGLang admits greedy (top_k 1) and finite ``1 < top_k <= cap``
    only (its message, word for word, with ``capture="engine"``). With
    shmask's capture any bounded support is admitted too: ``top_p < 1`` as
    a float32 (top-p-only, the RL rollout setting) or ``min_p > 0`` (at most
    1 / min_p ids) at any top_k, and with past_cap "exact" a finite top_k
    above ``cap`` (such rows travel whole). The full vocabulary (no top_k
    below V, top_p rounding to 1, no min_p) is refused with a message that
    says what to set."""
    if top_k == 1 or 1 < top_k <= cap:
        return None
    released = ("return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k "
                f"<= {cap}; got top_k={top_k}. Lower top_k or increase --sampling-mask-max-tokens.")
    if capture != "shmask":
        return released
    if float(np.float32(top_p)) < 1.0 or min_p > 0:
        return None
    full_top_k = top_k < 1 or (vocab is not None and top_k >= vocab) or top_k >= TOP_K_ALL
    if full_top_k:
        shown = "-1 (all)" if top_k >= TOP_K_ALL or top_k == -1 else str(top_k)
        rounds = ", which is 1.0 as a float32" if top_p < 1 else ""
        return ("return_sampling_mask cannot return the full vocabulary: set top_p < 1 (got "
                f"top_p={top_p!r}{rounds}), min_p > 0, or a finite top_k below the "
                f"vocabulary size (got top_k={shown}).")
    return None if past_cap == "exact" else released
