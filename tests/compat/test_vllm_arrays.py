"""Arrays for in-process consumers (SHMASK_MASK_FORMAT=arrays) through the
released vLLM 0.33.0: the patched OutputProcessor (shmask/integrations/
vllm.patch applied to a copy of the installed files, as test_vllm_patch
does), fed real EngineCoreOutputs through vLLM's own msgpack codec over
several steps, builds each CompletionOutput's sampling_mask itself; in
arrays mode its token_ids are int32 numpy arrays equal, position for
position, to the lists it builds by default, for every output kind that
LLM.generate and AsyncLLM use; and every ring record is back after the
copies. Nothing is stubbed for vLLM (tests/compat/_vllm_helpers.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from test_vllm_patch import PATCHED_PRELUDE, ROOT, patched_tree  # noqa: F401 - the patched copy fixture

_PROBE = PATCHED_PRELUDE + textwrap.dedent("""
    kind = sys.argv[2]

    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
    from vllm.v1.outputs import SamplingMaskLists
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    rids = ["r0", "r1", "r2"]
    frontend = processor.OutputProcessor(None, log_stats=False)
    for rid in rids:
        params = SamplingParams(max_tokens=16, detokenize=False,
                                output_kind=getattr(RequestOutputKind, kind))
        frontend.add_request(EngineCoreRequest(rid, [1, 2], None, params, None, time.time(),
                                               None, None, None, external_req_id=rid), None)
    rng = np.random.default_rng(5)
    shm = scheduler.shmask_vllm
    got, steps = {rid: [] for rid in rids}, 3
    for step in range(steps):
        positions = [1, 2, 1]  # r1: two positions per step (speculative decoding)
        rows = [np.sort(rng.choice(151_936, int(n), replace=False)).astype(np.int32)
                for n in rng.integers(0, 200, sum(positions))]
        offsets = np.cumsum([0] + [r.size for r in rows])
        masks = SamplingMaskLists(np.concatenate(rows), offsets,
                                  np.cumsum([0] + positions).tolist())
        published = shm.publish_step(masks)   # what the patched scheduler calls
        last = step == steps - 1
        outputs = [EngineCoreOutput(rid, [5] * n, new_sampling_mask=published.slice_request(i, n),
                                    finish_reason=FinishReason.LENGTH if last else None)
                   for i, (rid, n) in enumerate(zip(rids, positions))]
        wire = MsgpackEncoder().encode(EngineCoreOutputs(outputs=outputs))
        received = MsgpackDecoder(EngineCoreOutputs).decode(wire).outputs
        for out in frontend.process_outputs(received).request_outputs:
            mask = out.outputs[0].sampling_mask
            if mask is None:
                continue
            got[out.request_id].append({
                "types": sorted({type(x).__name__ for x in mask.token_ids}),
                "dtypes": sorted({str(getattr(x, "dtype", "list")) for x in mask.token_ids}),
                "writeable": any(getattr(x, "flags", None) is not None and x.flags.writeable
                                 for x in mask.token_ids),
                "rows": [np.asarray(x).tolist() for x in mask.token_ids],
                "csr_ok": bool(np.array_equal(shm.mask_csr(mask)[0], np.concatenate(
                    [np.asarray(x, np.int32) for x in mask.token_ids]))),
            })
    # Every record back once its copy was made: close the step's queues
    # (they hold ring buffers), reclaim, and count what is still in use.
    publisher = shm._publisher
    publisher.finish_step()
    for queue in publisher._queues:
        queue.close()
    publisher._queues.clear()
    publisher.writer.reclaim()
    print(json.dumps({"got": got, "ring_in_use": publisher.writer.ring_usage()[0],
                      "format": shm._resolver.mask_format}))
""")


def _run(tree, prefix: str, kind: str, mask_format: str | None) -> dict:
    env = {**os.environ, "SHMASK_NAME_PREFIX": prefix}
    env.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
    env.pop("SHMASK_MASK_FORMAT", None)
    if mask_format is not None:
        env["SHMASK_MASK_FORMAT"] = mask_format
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, str(tree), kind], env=env,
                              capture_output=True, text=True, timeout=240, cwd=ROOT,
                              start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"probe hung: {exc.stderr!s:.3000}")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("kind", ["FINAL_ONLY", "DELTA"])  # LLM.generate, AsyncLLM streaming
def test_arrays_equal_vllms_lists_position_for_position(patched_tree, prefix, kind):  # noqa: F811
    lists = _run(patched_tree, prefix, kind, None)  # the default: unchanged
    arrays = _run(patched_tree, prefix, kind, "arrays")
    assert lists["format"] == "lists" and arrays["format"] == "arrays"
    outputs = 0
    for rid, want in lists["got"].items():
        got = arrays["got"][rid]
        assert len(got) == len(want) > 0
        for w, g in zip(want, got, strict=True):
            assert w["types"] == ["list"]  # vLLM's own nested lists by default
            assert g["types"] == ["ndarray"] and g["dtypes"] == ["int32"] and not g["writeable"]
            assert g["rows"] == w["rows"]  # position for position
            assert g["csr_ok"] and w["csr_ok"]
            outputs += 1
    assert outputs >= 3
    assert lists["ring_in_use"] == 0 and arrays["ring_in_use"] == 0
