"""What the vLLM compat tests share: batches shaped as vLLM's model runner
hands them to the scheduler, and one step through the real IPC path.

vLLM 0.33 imports on this CPU machine with the packages of
requirements-deps.txt alone: no module is stubbed for it (the guide says so;
test_vllm_patch imports the patched modules from a copy of the installed
package).
"""

from __future__ import annotations

import numpy as np
from vllm import envs
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.outputs import SamplingMaskLists
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

VOCAB = 151_936


def batch_masks(rows: list[list[int]], positions: list[int] | None = None) -> SamplingMaskLists:
    """A batch SamplingMaskLists as vLLM's SamplingMaskTensors.tolists builds
    it: int32 ids, int64 offsets, cu_num_generated_tokens with several
    positions per request."""
    offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    ids = np.concatenate([np.asarray(r, np.int32) for r in rows] + [np.zeros(0, np.int32)])
    cu = None if positions is None else np.cumsum([0, *positions]).tolist()
    return SamplingMaskLists(ids, offsets, cu)


def random_rows(rng: np.random.Generator, count: int, max_len: int) -> list[list[int]]:
    """Ascending distinct ids, like a top-k/top-p support."""
    return [np.sort(rng.choice(VOCAB, int(n), replace=False)).tolist()
            for n in rng.integers(1, max_len + 1, count)]


def secure_ipc() -> tuple[MsgpackEncoder, MsgpackDecoder]:
    """vLLM's engine-core -> frontend codec, with its default settings."""
    assert not envs.VLLM_ALLOW_INSECURE_SERIALIZATION, "tests must run with vLLM's defaults"
    return MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)


def through_ipc(outputs: list[EngineCoreOutput]) -> tuple[list[EngineCoreOutput], list[int]]:
    """Encode as the engine core does, decode as the frontend does; also the
    frame sizes (frame 0 is the message, the others out-of-band arrays)."""
    encoder, decoder = secure_ipc()
    frames = [bytes(f) for f in encoder.encode(EngineCoreOutputs(outputs=outputs))]
    return decoder.decode(frames).outputs, [len(f) for f in frames]
