"""Child process of test_sglang_adapter.py's failed-read tests: SGLang's real
tokenizer manager loop, run as a server runs it, reading chunks that cannot
be read.

    python _sglang_tokenizer_child.py <patched sglang root> <shm name prefix>

SGLang 0.5.23 (patched with shmask/integrations/sglang.patch) runs
``TokenizerManager.handle_loop`` under its own ``print_exception_wrapper``,
which kills the process (``kill_process_tree`` of itself, SIGKILL) on any
exception: this process stands in for the server, so the test reads its
exit status. What is real: the TokenizerManager class and its methods
(``init_running_status``, ``init_request_logging_and_dumping``,
``init_ipc_channels``, ``handle_loop``, ``_handle_batch_output``,
``abort_request``, ``_wait_one_response``), SGLang's server args published
with ``runtime_context.publish``, its zmq sockets and msgpack IPC, the
shmask ring. What is not run: ``TokenizerManager.__init__`` (it loads a
model config and a tokenizer from the hub), the scheduler and detokenizer
(this process sends the detokenizer's ``BatchTokenIDOutput`` messages on the
tokenizer's socket and reads what the tokenizer sends to the scheduler).

One message carries four requests: ``late`` (its chunk read after
SHMASK_LEASE_S, its ring space reused), ``ok-selected`` and ``ok-support``
(on time), ``garbled`` (a reference with a garbled entry kind). A second
message carries the on-time requests' last rows (they finish) and a chunk
for ``late``, whose state is gone by then. Each request is awaited as an
Engine caller awaits it (``_wait_one_response``). Prints one ``result``
JSON line: what each request got, the AbortReqs the scheduler received.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import sys
import tempfile
import time
from array import array
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import conftest  # noqa: E402,F401 - the documented stubs (torchvision), before SGLang

PATCHED_ROOT, PREFIX = sys.argv[1], sys.argv[2]
sys.path.insert(0, PATCHED_ROOT)

import msgspec.inspect as mi  # noqa: E402
import numpy as np  # noqa: E402
import zmq  # noqa: E402
from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.managers import io_struct, tokenizer_manager  # noqa: E402
from sglang.srt.server_args import PortArgs, ServerArgs  # noqa: E402
from sglang.srt.utils.watchdog import Watchdog  # noqa: E402

import shmask  # noqa: E402
from shmask.adapters import sglang as adapter  # noqa: E402

LEASE_S = 0.2
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
               "num_hidden_layers": 1, "vocab_size": 1000, "max_position_embeddings": 256,
               "torch_dtype": "float32"}
MODES = {"late": "support", "ok-selected": "selected", "ok-support": "support",
         "garbled": "support"}


def rows_of(rid: str, step: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Seeded row: ids tell the request and step apart."""
    base = (list(MODES).index(rid) + 1) * 10_000 + step * 100
    n = 3 + step
    ids = np.arange(base, base + n, dtype=np.int32)
    logprobs = -np.arange(1, (n if mode == "support" else 1) + 1, dtype=np.float32) / 4
    return ids, logprobs


def expected_lists(rid: str, steps: range) -> list[list[int]]:
    return [rows_of(rid, s, MODES[rid])[0].tolist() for s in steps]


def _filler(t, count: int):
    # A value of each required field's type, as the detokenizer would fill it.
    if isinstance(t, mi.UnionType) and any(isinstance(x, mi.NoneType) for x in t.types):
        return None
    if isinstance(t, mi.ListType):
        return [_filler(t.item_type, 1) for _ in range(count)]
    if isinstance(t, mi.StrType):
        return ""
    if isinstance(t, mi.IntType):
        return 1
    if isinstance(t, mi.BoolType):
        return True
    if isinstance(t, mi.CustomType) and t.cls is array:
        return array("i", [7])
    if isinstance(t, mi.DictType):
        return {}
    raise AssertionError(f"no filler for {t}")


def batch(rids, chunks, finished):
    """A BatchTokenIDOutput as the scheduler sends it (skip_tokenizer_init)."""
    cls = io_struct.BatchTokenIDOutput
    values = {f.name: _filler(f.type, len(rids)) for f in mi.type_info(cls).fields if f.required}
    values.update(rids=rids, finished_reasons=finished, output_token_sampling_mask=chunks,
                  output_ids=[array("i", [7]) for _ in rids], retraction_counts=[0] * len(rids))
    return cls(**values)


async def main(model: Path) -> dict:
    # Resolving server args reads the model's config.json: a tiny local one
    # in ``model``, a directory removed when the child ends (no weights, no
    # tokenizer: skip_tokenizer_init, as the scheduler's token-id outputs go
    # straight to the tokenizer manager).
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))
    server_args = ServerArgs(model_path=str(model), skip_tokenizer_init=True, device="cpu")
    runtime_context.publish(server_args, role="tokenizer")
    port_args = PortArgs.init_new(server_args)

    manager = tokenizer_manager.TokenizerManager.__new__(tokenizer_manager.TokenizerManager)
    # What __init__ sets from the published config before the parts that
    # need a model (the same expressions).
    tm = tokenizer_manager
    manager.server_args = server_args
    manager.enable_metrics = tm.get_observability().enable_metrics
    manager.incremental_streaming_output = tm.get_serving().incremental_streaming_output
    manager.enable_lora = tm.get_lora().enable_lora
    manager.enable_trace = tm.get_observability().enable_trace
    manager.skip_tokenizer_init = tm.get_serving().skip_tokenizer_init
    manager.crash_dump_folder = tm.get_observability().crash_dump_folder
    manager.disaggregation_mode = tm.DisaggregationMode(tm.get_disagg().disaggregation_mode)
    manager.init_running_status()
    manager.init_request_logging_and_dumping()
    manager.init_ipc_channels(port_args)
    manager.soft_watchdog = Watchdog.create(
        debug_name="TokenizerManager",
        watchdog_timeout=tm.get_device().soft_watchdog_timeout, soft=True)

    context = zmq.Context()
    detokenizer = context.socket(zmq.PUSH)
    detokenizer.connect(port_args.tokenizer_ipc_name)
    scheduler = context.socket(zmq.PULL)
    scheduler.connect(port_args.scheduler_input_ipc_name)

    config = shmask.Config(ring_mb=1, name_prefix=PREFIX, lease_s=LEASE_S, full_wait_ms=20)
    writer, reader = shmask.Writer(config), shmask.Reader(config)
    adapter.configure(writer=writer, reader=reader)
    try:
        rows = {rid: adapter.SamplingMaskRows(mode) for rid, mode in MODES.items()}
        objs = {rid: io_struct.GenerateReqInput(
            rid=rid, input_ids=[1, 2], return_sampling_mask=True,
            sampling_logprobs_mode=mode, stream=False) for rid, mode in MODES.items()}
        for rid, obj in objs.items():
            state = tokenizer_manager.ReqState(
                [], False, asyncio.Event(), obj, tokenizer_manager.APIServerReqTimeStats(
                    disagg_mode=manager.disaggregation_mode))
            state.time_stats.set_created_time(time.perf_counter())
            manager.rid_to_state[rid] = state

        # "late": taken, then read after its lease, its space reused.
        rows["late"].append(*rows_of("late", 0, "support"))
        late = rows["late"].take()
        time.sleep(LEASE_S * 2)
        writer.reclaim()
        for rid in ("ok-selected", "ok-support", "garbled"):
            rows[rid].append(*rows_of(rid, 0, MODES[rid]))
        chunks = dict(zip(("ok-selected", "ok-support", "garbled"),
                          adapter.take_all([rows[r] for r in ("ok-selected", "ok-support",
                                                              "garbled")]), strict=True))
        valid_garbled = chunks["garbled"]
        ref = bytearray(valid_garbled.ref)
        ref[-shmask.refs.ENTRY_DTYPE.itemsize] ^= 0x80  # the entry's kind byte
        chunks["garbled"] = adapter.SamplingMaskChunk(bytes(ref))
        chunks["late"] = late
        first = list(MODES)

        loop_task = asyncio.create_task(
            tokenizer_manager.print_exception_wrapper(manager.handle_loop))

        async def client(responses) -> dict:  # type: ignore[no-untyped-def]
            outs = []
            try:
                async for out in responses:
                    outs.append(out)
            except Exception as exc:  # noqa: BLE001 - the error SGLang answers the caller with
                return {"error": type(exc).__name__, "status_code": getattr(exc, "status_code", None),
                        "detail": str(getattr(exc, "detail", exc)), "outputs": len(outs)}
            meta = outs[-1]["meta_info"]
            return {"finish_reason": meta["finish_reason"],
                    "masks": meta.get("output_token_sampling_mask"),
                    "mask_length": meta.get("output_token_sampling_mask_length")}

        # Each caller's wait, taken while its state exists (as generate_request does).
        clients = {rid: asyncio.create_task(client(manager._wait_one_response(objs[rid])))
                   for rid in MODES}
        io_struct.sock_send(detokenizer, batch(first, [chunks[r] for r in first],
                                               [None] * len(first)))
        # The loop must still be serving: a second message, the on-time
        # requests' last rows (they finish), and a chunk for "late", whose
        # state is gone by then (given back by the tokenizer).
        await asyncio.sleep(0.5)
        second = ["ok-selected", "ok-support", "late"]
        for rid in second:
            rows[rid].append(*rows_of(rid, 1, MODES[rid]))
        later = adapter.take_all([rows[r] for r in second])
        io_struct.sock_send(detokenizer, batch(
            second, later, [{"type": "length", "length": 2}, {"type": "length", "length": 2},
                            None]))
        done = await asyncio.wait_for(asyncio.gather(*clients.values()), timeout=60)
        outcomes = dict(zip(clients, done, strict=True))
        await asyncio.sleep(0.2)  # the loop handles the second message's "late" chunk

        aborts = []
        while scheduler.poll(500):
            raw = scheduler.recv()
            # The tokenizer's scheduler socket carries pickles (send_pyobj)
            message = pickle.loads(raw) if raw[:1] == b"\x80" else io_struct.msgpack_decode(raw)
            aborts.append([type(message).__name__, getattr(message, "rid", None)])
        loop_alive = not loop_task.done()
        loop_task.cancel()
        valid_garbled.release()
        return {
            "outcomes": outcomes, "aborts": aborts, "loop_alive": loop_alive,
            "expected": {rid: expected_lists(rid, range(2)) for rid in ("ok-selected",
                                                                        "ok-support")},
        }
    finally:
        for r in rows.values():
            r.close()
        detokenizer.close(linger=0)
        scheduler.close(linger=0)
        context.term()
        reader.close()
        writer.close()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="shmask-compat-model-") as folder:
        print("result", json.dumps(asyncio.run(main(Path(folder)))), flush=True)
