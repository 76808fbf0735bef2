"""SGLang 0.5.23's prefill -> decode handoff of a request's first sampling-mask
row (issue 36, item 6, first part), through shmask's rows.

What is SGLang's own: `MetadataBuffers` (sglang/srt/disaggregation/utils.py,
with SGLANG_ENABLE_DISAGG_SAMPLING_MASK=1: one row of `cap` entries a
request), its `set_buf` on the prefill side (which takes the row with
`req.sampling_mask_rows.view()`), its `get_buf`, and the decode side's
`DecodeTransferQueue._commit_transfer_to_req` (sglang/srt/disaggregation/
decode.py), which appends the row to the decode request's
`sampling_mask_rows`. The rows objects are the patched SGLang's, i.e.
shmask's `SamplingMaskRows` over a real ring. What stands in: the KV
transfer itself (both sides share one MetadataBuffers, as the transfer
engine's copy makes them equal), and the plain request fields both methods
read (ids, cached-token counts, the bootstrap room and host, the time
stats; no logprobs, no speculative decoding, no hierarchical cache).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from shmask.adapters import sglang as adapter

CAP = 64


@pytest.fixture(autouse=True)
def _ends(writer, reader, monkeypatch):
    monkeypatch.setitem(adapter._ends, "writer", writer)
    monkeypatch.setitem(adapter._ends, "reader", reader)
    monkeypatch.setenv("SGLANG_ENABLE_DISAGG_SAMPLING_MASK", "1")


def _request(mode: str, rows: adapter.SamplingMaskRows, index: int) -> SimpleNamespace:
    """The fields set_buf and _commit_transfer_to_req read of a Req."""
    return SimpleNamespace(
        rid=f"r{index}", metadata_buffer_index=index, output_ids=[11 + index], cached_tokens=0,
        cached_tokens_device=0, cached_tokens_host=0, cached_tokens_storage=0,
        get_mm_token_counts=lambda: (0, 0, 0), return_logprob=False, return_sampling_mask=True,
        sampling_logprobs_mode=mode, sampling_mask_rows=rows, hidden_states_tensor=None,
        bootstrap_room=1000 + index, bootstrap_host="10.0.0.1",
        pd_rebootstrap_forced_output_id=None,
        time_stats=SimpleNamespace(set_wait_queue_entry_time=lambda: None))


@pytest.mark.parametrize("mode", ["support", "selected"])
def test_sampling_mask_row_reaches_decode_unchanged(mode):
    from sglang.srt.disaggregation.decode import DecodeTransferQueue
    from sglang.srt.disaggregation.utils import MetadataBuffers
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    buffers = MetadataBuffers(4, hidden_size=8, hidden_states_dtype=torch.float32,
                              max_sampling_mask_tokens=CAP)
    assert buffers.enable_sampling_mask
    rng = np.random.default_rng(3)
    ids = np.sort(rng.choice(151_936, CAP, replace=False)).astype(np.int32)  # a full row
    logprobs = -rng.random(CAP if mode == "support" else 1, dtype=np.float32) - 0.5
    prefill_rows = adapter.SamplingMaskRows(mode)
    prefill_rows.append(ids, logprobs)
    buffers.set_buf(_request(mode, prefill_rows, 2))  # prefill: view() into the buffer

    decode_rows = adapter.SamplingMaskRows(mode)
    decode_req = SimpleNamespace(metadata_buffer_index=2, is_rebootstrap=False,
                                 kv_receiver=SimpleNamespace(clear=lambda: None),
                                 req=_request(mode, decode_rows, 2))
    decode_req.req.output_ids = []
    queue = DecodeTransferQueue.__new__(DecodeTransferQueue)
    queue.metadata_buffers = buffers
    queue.spec_algorithm = SpeculativeAlgorithm.NONE
    queue.scheduler = SimpleNamespace(
        kv_checksum_computer=None, tree_cache=None,
        batch_result_processor=SimpleNamespace(_maybe_update_reasoning_tokens=lambda *a: None))
    queue._commit_hicache_local_restore_to_req = lambda req: None  # no hierarchical cache
    queue._commit_transfer_to_req(decode_req)

    assert decode_req.req.output_ids == [13]
    masks, values = decode_rows.take().to_lists(support_logprobs=mode == "support")
    assert masks == [ids.tolist()]
    want = logprobs.tolist() if mode == "support" else float(logprobs[0])
    assert values == [want]
    # the prefill side's queue still holds its row (view() re-queues it)
    again, _ = prefill_rows.take().to_lists(support_logprobs=mode == "support")
    assert again == [ids.tolist()]
    prefill_rows.close()
    decode_rows.close()
