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

import socket
import time
from types import SimpleNamespace

import _sglang_sampler as harness
import numpy as np
import pytest
import requests
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


CONN_FILE = "sglang/srt/disaggregation/common/conn.py"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def bootstrap():
    """SGLang's own bootstrap server of a prefill (the patched conn.py's
    CommonKVBootstrapServer: aiohttp in a thread) on a free port."""
    conn = harness.load_module(CONN_FILE, patched=True)
    port = _free_port()
    server = conn.CommonKVBootstrapServer("127.0.0.1", port)
    deadline = time.monotonic() + 30
    while True:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline, "the bootstrap server did not start"
        time.sleep(0.05)
    yield conn, port
    server.close()


def _register_prefill(conn, port: int, cap: int, enabled: bool, monkeypatch) -> None:
    """A one-rank prefill registers with the bootstrap server through the
    patched CommonKVManager.register_to_bootstrap, in a published runtime
    context whose --sampling-mask-max-tokens is ``cap``. What stands in: the
    manager's own fields the method reads (its ranks, address and KV
    settings; a manager is otherwise built from a loaded model's KV pool)."""
    monkeypatch.setenv("SGLANG_ENABLE_DISAGG_SAMPLING_MASK", "1" if enabled else "0")
    manager = conn.CommonKVManager.__new__(conn.CommonKVManager)
    manager.__dict__.update(
        dist_init_addr=None, bootstrap_host="127.0.0.1", bootstrap_port=port,
        attn_tp_size=1, attn_tp_rank=0, attn_cp_size=1, attn_cp_rank=0, attn_dp_size=1,
        attn_dp_rank=0, pp_size=1, pp_rank=0, system_dp_size=1, system_dp_rank=0,
        local_ip="127.0.0.1", rank_port=_free_port(), kv_args=SimpleNamespace(page_size=1),
        kv_cache_dtype_str="bfloat16", kv_layout=None, dsv41_spec_layout=None)
    with harness.sampler_context(cap, disaggregation="prefill"):
        manager.register_to_bootstrap()


def _decode_fetches(conn, port: int, cap: int, monkeypatch) -> object:
    """A decode server's first fetch of the prefill's settings through the
    patched CommonKVManager.try_ensure_parallel_info, in a published runtime
    context whose --sampling-mask-max-tokens is ``cap``. What stands in: the
    manager's own fields the checks read, and its TP/CP/PP rank mapping
    (which needs the decode's process groups). Returns the PrefillServerInfo
    it keeps."""
    monkeypatch.setenv("SGLANG_ENABLE_DISAGG_SAMPLING_MASK", "1")
    manager = conn.CommonKVManager.__new__(conn.CommonKVManager)
    manager.__dict__.update(
        prefill_info_table={}, kv_args=SimpleNamespace(page_size=1, state_types=()),
        kv_cache_dtype_str="bfloat16", kv_layout=None, dsv41_spec_layout=None,
        attn_tp_size=1, attn_cp_size=1, dcp_size=1, is_mla_backend=False,
        is_hybrid_mla_backend=False, _resolve_rank_mapping=lambda info: None)
    address = f"127.0.0.1:{port}"
    with harness.sampler_context(cap, disaggregation="decode"):
        assert manager.try_ensure_parallel_info(address)
    return manager.prefill_info_table[address]


def test_a_prefill_decode_cap_mismatch_is_refused_with_both_values(bootstrap, monkeypatch):
    """The first row travels in a metadata buffer of `cap` entries a request
    on each side, copied at the prefill's length: a decode whose cap
    differs from the prefill's refuses it when it first fetches the
    prefill's settings (before any transfer), naming both values; equal caps
    pass, and the settings it keeps are SGLang's own (no extra field)."""
    conn, port = bootstrap
    _register_prefill(conn, port, 128, True, monkeypatch)
    with pytest.raises(RuntimeError) as refused:
        _decode_fetches(conn, port, 64, monkeypatch)
    message = str(refused.value)
    assert "prefill server has --sampling-mask-max-tokens=128" in message
    assert "decode server has --sampling-mask-max-tokens=64" in message
    info = _decode_fetches(conn, port, 128, monkeypatch)
    assert info.page_size == 1 and not hasattr(info, "sampling_mask_max_tokens")


def test_a_released_decode_sees_no_extra_field_and_a_prefill_without_rows_no_check(
        bootstrap, monkeypatch):
    """The bootstrap server answers the cap only to a decode that asks:
    the released decode's query gets SGLang's fields alone, which its
    PrefillServerInfo(**data) takes. A prefill whose metadata buffer
    carries no rows registers none, and any decode cap passes."""
    conn, port = bootstrap
    _register_prefill(conn, port, 128, False, monkeypatch)
    released = requests.get(f"http://127.0.0.1:{port}/route?prefill_dp_rank=-1&"
                            f"prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1",
                            timeout=5).json()
    assert "sampling_mask_max_tokens" not in released
    released_conn = harness.load_module(CONN_FILE, patched=False)
    assert released_conn.PrefillServerInfo(**released).page_size == 1
    assert _decode_fetches(conn, port, 64, monkeypatch).page_size == 1
