"""SGLang PD disaggregation: the prefill and decode servers agree on the
length of the sampling-mask row they hand over (issue 36, item 6).

With ``SGLANG_ENABLE_DISAGG_SAMPLING_MASK`` each server's metadata buffer
holds one row of ``--sampling-mask-max-tokens`` (``cap``) entries a request
(sglang/srt/disaggregation/utils.py, ``MetadataBuffers``), and the transfer
engines copy a request's row as the prefill's item length into the decode's
slot (``send_aux``: ``dst_aux_ptrs[i] + length * dst_aux_index``, the
prefill's length). Released SGLang checks neither side's cap: with a
larger prefill cap the row lands in later requests' slots (past the
buffer's end at the last ones), with a smaller one in earlier requests'.
(With ``SGLANG_RUST_SERVER`` and attention DP, the rows register with the
Rust router's /route registry, which keeps no cap: nothing is checked.)
The patched prefill registers its cap with the bootstrap server next to its
page size; the patched decode asks for it when it first fetches the
prefill's settings (``try_ensure_parallel_info``, before any transfer) and
refuses a mismatch there, naming both values, as SGLang refuses a page-size
or KV-dtype mismatch. A released server on either side: the decode never
asks (released) or the prefill never registers a cap (then nothing is
checked, as released).

This module imports SGLang; only the patched
sglang/srt/disaggregation/common/conn.py calls it.
"""

from __future__ import annotations

from typing import Any

# The key in the prefill's bootstrap registration and in the decode's
# /route query (the bootstrap server answers it only to a decode that asks,
# so a released decode's PrefillServerInfo(**data) sees no unknown field).
KEY = "sampling_mask_max_tokens"


def sampling_mask_cap() -> int | None:
    """This server's row length in the PD metadata buffer: its
    ``--sampling-mask-max-tokens``, or None when the buffer carries no
    sampling-mask rows (``SGLANG_ENABLE_DISAGG_SAMPLING_MASK`` off)."""
    from sglang.srt.environ import envs
    from sglang.srt.runtime_context import get_exec

    if not envs.SGLANG_ENABLE_DISAGG_SAMPLING_MASK.get():
        return None
    return int(get_exec().features.sampling_mask_max_tokens)


def check_prefill_cap(prefill_cap: Any) -> None:
    """Refuse a prefill whose metadata-buffer row length differs from this
    decode server's: RuntimeError naming both. Nothing to check when either
    side's buffer carries no rows (SGLang's own count check of the metadata
    buffers reports a buffer on one side only). ``prefill_cap`` comes from
    the bootstrap server: anything but a non-negative integer is refused."""
    own = sampling_mask_cap()
    if own is None or prefill_cap is None:
        return
    if isinstance(prefill_cap, bool) or not isinstance(prefill_cap, int) or prefill_cap < 0:
        raise RuntimeError(f"Sampling mask cap from the prefill's bootstrap server is not a "
                           f"row length: {prefill_cap!r}")
    if prefill_cap != own:
        raise RuntimeError(
            f"Sampling mask cap mismatch: prefill server has --sampling-mask-max-tokens="
            f"{prefill_cap}, but decode server has --sampling-mask-max-tokens={own}. Both "
            f"servers must use the same value (the first sampling-mask row travels in a "
            f"metadata buffer of that many entries a request).")
