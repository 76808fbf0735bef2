"""shmask/integrations/vllm.patch against the installed vLLM 0.33.0: it applies
cleanly (`patch --dry-run` on the package's own files), the guide holds it
verbatim, and the patched modules import and work: the patched output
processor, fed real EngineCoreOutputs through vLLM's codec, returns the
masks to the client."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import vllm

ROOT = Path(__file__).resolve().parents[2]
PATCH = ROOT / "shmask" / "integrations" / "vllm.patch"
GUIDE = ROOT / "docs" / "integrations" / "vllm.md"
SITE = Path(vllm.__file__).resolve().parents[1]  # the directory holding vllm/
PATCHED = ["vllm/v1/core/sched/scheduler.py", "vllm/v1/engine/core.py",
           "vllm/v1/engine/output_processor.py", "vllm/v1/worker/gpu/sample/sampler.py"]


def test_installed_release_is_the_one_patched():
    assert vllm.__version__ == "0.33.0"


def test_patch_applies_cleanly_to_installed_files():
    result = subprocess.run(["patch", "--dry-run", "-p1", "-d", str(SITE), "-i", str(PATCH)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAILED" not in result.stdout and "offset" not in result.stdout.lower()
    assert sorted(line.split()[-1] for line in result.stdout.splitlines()) == sorted(PATCHED)


def test_patch_is_small_and_in_the_guide():
    text = PATCH.read_text()
    changed = [line for line in text.splitlines()
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert 0 < len(changed) < 30
    assert text in GUIDE.read_text(), "the guide must hold the patch verbatim"


@pytest.fixture
def patched_tree(tmp_path):
    for relative in PATCHED:
        target = tmp_path / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SITE / relative, target)
    result = subprocess.run(["patch", "-p1", "-d", str(tmp_path), "-i", str(PATCH)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return tmp_path


# What every probe of the patched modules starts with: the patched files
# loaded under their real module names from the copy in argv[1] (the rest of
# vLLM is the installed package).
PATCHED_PRELUDE = textwrap.dedent("""
    import importlib.util, json, sys, time
    import numpy as np

    def load(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    tree = sys.argv[1]
    scheduler = load("vllm.v1.core.sched.scheduler", tree + "/vllm/v1/core/sched/scheduler.py")
    processor = load("vllm.v1.engine.output_processor", tree + "/vllm/v1/engine/output_processor.py")
""")

# One frontend step through the patched modules.
_PROBE = PATCHED_PRELUDE + textwrap.dedent("""
    assert scheduler.shmask_vllm.publish_step and scheduler.Scheduler.update_from_output
    assert scheduler.__file__.startswith(tree) and processor.__file__.startswith(tree)

    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
    from vllm.v1.outputs import SamplingMaskLists
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    frontend = processor.OutputProcessor(None, log_stats=False)
    for i in range(3):
        params = SamplingParams(max_tokens=8, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        frontend.add_request(EngineCoreRequest(f"r{i}", [1, 2], None, params, None,
                                               time.time(), None, None, None,
                                               external_req_id=f"r{i}"), None)
    masks = SamplingMaskLists(np.array([10, 11, 20, 30, 31, 32, 40], np.int32),
                              np.array([0, 2, 3, 6, 7]), [0, 1, 3, 4])
    step = scheduler.shmask_vllm.publish_step(masks)   # what the patched scheduler calls
    outputs = [EngineCoreOutput(f"r{i}", [5] * n, new_sampling_mask=step.slice_request(i, n))
               for i, n in [(0, 1), (1, 2), (2, 1)]]
    wire = MsgpackEncoder().encode(EngineCoreOutputs(outputs=outputs))
    received = MsgpackDecoder(EngineCoreOutputs).decode(wire).outputs
    result = frontend.process_outputs(received)
    for out in result.request_outputs:
        print(out.request_id, out.outputs[0].sampling_mask.token_ids)
""")


def test_patched_modules_import_and_deliver_masks(patched_tree, prefix):
    env = {**os.environ, "SHMASK_NAME_PREFIX": prefix}
    env.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
    result = subprocess.run([sys.executable, "-c", _PROBE, str(patched_tree)], env=env,
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "r0 [[10, 11]]", "r1 [[20], [30, 31, 32]]", "r2 [[40]]"]


def test_unpatched_frontend_would_not_deliver(writer):
    """The end-to-end check above is real: without the frontend half of the
    patch, vLLM would hand the client the reference's bytes as token ids."""
    import numpy as np
    from _vllm_helpers import batch_masks, through_ipc
    from vllm.v1.engine import EngineCoreOutput

    from shmask.adapters import vllm as shmask_vllm

    publisher = shmask_vllm.MaskPublisher(writer)
    try:
        step = publisher.publish_step(batch_masks([[10, 11, 12]]))
        [output], _ = through_ipc([EngineCoreOutput("r0", [5], new_sampling_mask=step.slice_request(0, 1))])
        nested = output.new_sampling_mask.to_nested_list()
        assert nested != [[10, 11, 12]]
        assert nested[0][:4] == list(np.frombuffer(b"SMRB", np.uint8))
    finally:
        publisher.close()


# One message of six requests through the patched OutputProcessor, three of
# whose references are garbled in one byte each (entry kind, mode, segment
# index: what RefBatch.build refuses for the whole joined batch). argv[2]:
# "queue" (AsyncLLM: each request's RequestOutputCollector) or "list"
# (LLMEngine: the returned RequestOutputs).
_BAD_REF_PROBE = PATCHED_PRELUDE + textwrap.dedent("""
    mode = sys.argv[2]

    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
    from vllm.v1.outputs import SamplingMaskLists
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
    from shmask.refs import ENTRY_DTYPE

    rids = [f"r{i}" for i in range(6)]
    frontend = processor.OutputProcessor(None, log_stats=False)
    queues = {}
    for rid in rids:
        params = SamplingParams(max_tokens=8, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        queue = (processor.RequestOutputCollector(RequestOutputKind.DELTA, rid)
                 if mode == "queue" else None)
        queues[rid] = queue
        frontend.add_request(EngineCoreRequest(rid, [1, 2], None, params, None, time.time(),
                                               None, None, None, external_req_id=rid),
                             None, queue=queue)
    rows = [[100 * i + k for k in range(i + 1)] for i in range(6)]
    offsets = np.cumsum([0] + [len(r) for r in rows])
    masks = SamplingMaskLists(np.array(sum(rows, []), np.int32), offsets, None)
    step = scheduler.shmask_vllm.publish_step(masks)
    outputs = [EngineCoreOutput(rid, [5], new_sampling_mask=step.slice_request(i, 1))
               for i, rid in enumerate(rids)]
    wire = MsgpackEncoder().encode(EngineCoreOutputs(outputs=outputs))
    received = MsgpackDecoder(EngineCoreOutputs).decode(wire).outputs
    garbles = {"r1": ("kind", 0x80), "r3": ("mode", 0x40), "r4": ("segment", 0x05)}
    for i, out in enumerate(received):
        if out.request_id in garbles:
            field, xor = garbles[out.request_id]
            data = bytearray(out.new_sampling_mask.token_ids.tobytes())
            data[len(data) - ENTRY_DTYPE.itemsize + ENTRY_DTYPE.fields[field][1]] ^= xor
            out.new_sampling_mask = SamplingMaskLists(np.frombuffer(bytes(data), np.uint8))
    result = frontend.process_outputs(received)
    got = {}
    if mode == "queue":
        for rid, queue in queues.items():
            try:
                out = queue.get_nowait()
            except Exception as exc:
                got[rid] = {"error": type(exc).__name__, "message": str(exc),
                            "status": int(getattr(exc, "status_code", 0))}
                continue
            got[rid] = {"mask": out.outputs[0].sampling_mask.token_ids,
                        "finish_reason": out.outputs[0].finish_reason}
    else:
        for out in result.request_outputs:
            mask = out.outputs[0].sampling_mask
            got[out.request_id] = {"mask": mask.token_ids if mask else None,
                                   "finish_reason": out.outputs[0].finish_reason,
                                   "finished": out.finished}
    print(json.dumps({"got": got, "reqs_to_abort": result.reqs_to_abort,
                      "rows": dict(zip(rids, rows)),
                      "left": sorted(frontend.request_states)}))
""")


@pytest.mark.parametrize("mode", ["queue", "list"])  # AsyncLLM, LLMEngine
def test_one_bad_ref_fails_only_its_request_in_vllm_resolve_outputs(patched_tree, prefix, mode):
    """Three garbled references (entry kind, mode, segment index) among six,
    through vLLM's codec and the patched OutputProcessor.process_outputs:
    each garbled request fails alone, as vLLM fails one request (AsyncLLM:
    its caller gets a 500 GenerationError naming the error; LLMEngine: its
    output finishes with reason "error"), and is aborted in the engine core;
    the other three get their exact masks."""
    env = {**os.environ, "SHMASK_NAME_PREFIX": prefix}
    env.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
    result = subprocess.run([sys.executable, "-c", _BAD_REF_PROBE, str(patched_tree), mode],
                            env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    got, bad = report["got"], ["r1", "r3", "r4"]
    for rid in ("r0", "r2", "r5"):
        assert got[rid]["mask"] == [report["rows"][rid]], (rid, got[rid])
        assert got[rid]["finish_reason"] is None
    for rid in bad:
        if mode == "queue":
            assert got[rid]["error"] == "GenerationError" and got[rid]["status"] == 500, got[rid]
            assert "sampling mask could not be read (InvalidRefError" in got[rid]["message"]
        else:  # LLMEngine hands vLLM's own error outputs over without their message
            assert got[rid] == {"mask": None, "finish_reason": "error", "finished": True}
    assert sorted(report["reqs_to_abort"]) == bad
    assert report["left"] == ["r0", "r2", "r5"]


_ENGINE_CORE_PROBE = textwrap.dedent("""
    import importlib.util, inspect, json, sys
    tree = sys.argv[1]
    spec = importlib.util.spec_from_file_location("vllm.v1.engine.core",
                                                  tree + "/vllm/v1/engine/core.py")
    core = importlib.util.module_from_spec(spec)
    sys.modules["vllm.v1.engine.core"] = core
    spec.loader.exec_module(core)
    from shmask.adapters import vllm as adapter
    from vllm.v1.engine.utils import EngineZmqAddresses
    init = core.EngineCoreProc.__init__
    source = inspect.getsource(init)
    call = "shmask_vllm.outputs_go_to(None if local_client else addresses.outputs)"
    # after the handshake gave the addresses, before super().__init__ makes the Scheduler
    print(json.dumps({
        "adapter": core.shmask_vllm is adapter,
        "local_client": "local_client" in inspect.signature(init).parameters,
        "order": 0 < source.index("as addresses:") < source.index(call)
                 < source.index("super().__init__("),
        "headless": adapter.outputs_go_to(EngineZmqAddresses(
            inputs=["tcp://10.1.2.3:5570"], outputs=["tcp://10.1.2.3:5571"]).outputs),
        "local": adapter.outputs_go_to(None),
    }))
""")


def test_the_engine_core_says_where_its_outputs_go(patched_tree, prefix):
    """The core.py hunk runs in the released EngineCoreProc.__init__ where
    vLLM has ``local_client`` (False for a headless engine core: its
    front-end is on another node) and the handshake's ``addresses.outputs``
    (EngineZmqAddresses), before the Scheduler (whose publisher reads it)."""
    env = {**os.environ, "SHMASK_NAME_PREFIX": prefix}
    result = subprocess.run([sys.executable, "-c", _ENGINE_CORE_PROBE, str(patched_tree)],
                            env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got == {"adapter": True, "local_client": True, "order": True,
                   "headless": "10.1.2.3:5571", "local": None}


_SAMPLER_PROBE = textwrap.dedent("""
    import importlib.util, inspect, json, sys
    tree = sys.argv[1]
    name = "vllm.v1.worker.gpu.sample.sampler"
    spec = importlib.util.spec_from_file_location(
        name, tree + "/vllm/v1/worker/gpu/sample/sampler.py")
    sampler = importlib.util.module_from_spec(spec)
    sys.modules[name] = sampler
    spec.loader.exec_module(sampler)
    from shmask.adapters import vllm_gpu
    # every method that makes vLLM's masks passes them through published()
    makers = [f for f in vars(sampler.Sampler).values() if inspect.isfunction(f)
              and "from_logits" in f.__code__.co_names]
    source = inspect.getsource(makers[0]) if makers else ""
    print(json.dumps({
        "adapter": sampler.shmask_vllm_gpu is vllm_gpu,
        "makers": len(makers),
        "passed": all("published" in f.__code__.co_names for f in makers),
        "order": 0 < source.index("SamplingMaskTensors.from_logits(")
                 < source.index("shmask_vllm_gpu.published(sampling_mask_tensors)")
                 < source.index("SamplerOutput("),
    }))
""")


def test_the_sampler_passes_vllms_masks_to_the_gpu_publisher(patched_tree, prefix):
    """The sampler.py hunk runs in the released Sampler: the masks vLLM's
    compaction makes go through ``vllm_gpu.published`` before the
    SamplerOutput carries them to AsyncOutput (tests/compat/
    test_vllm_gpu_publish.py runs what published does with them)."""
    env = {**os.environ, "SHMASK_NAME_PREFIX": prefix}
    result = subprocess.run([sys.executable, "-c", _SAMPLER_PROBE, str(patched_tree)],
                            env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got == {"adapter": True, "makers": 1, "passed": True, "order": True}
