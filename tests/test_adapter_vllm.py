"""shmask.adapters.vllm without vLLM installed (tests/compat runs it against
the real vLLM): one step of masks published, sliced per request, resolved
over real shared memory."""

from __future__ import annotations

import os
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import run_child

import shmask
import shmask.remote_refs
from shmask.adapters import vllm as shmask_vllm

Masks = shmask_vllm._MaskLists  # vLLM's SamplingMaskLists, field for field


def batch(rows, positions=None):
    offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    ids = np.concatenate([np.asarray(r, np.int32) for r in rows] + [np.zeros(0, np.int32)])
    return Masks(ids, offsets, None if positions is None else np.cumsum([0, *positions]).tolist())


@pytest.fixture
def pair(writer, reader):
    publisher = shmask_vllm.MaskPublisher(writer, mask_lists=Masks)
    yield publisher, shmask_vllm.MaskResolver(reader, mask_lists=Masks)
    publisher.close()


def test_rows_come_back_bit_identical(pair):
    publisher, resolver = pair
    rng = np.random.default_rng(3)
    rows = [np.sort(rng.choice(151_936, n, replace=False)) for n in rng.integers(1, 400, 20)]
    step = publisher.publish_step(batch(rows))
    refs = [step.slice_request(i, 1) for i in range(20)]
    assert all(shmask_vllm.is_ref(r) and r.token_ids.nbytes < 200 for r in refs)
    for row, ref in zip(rows, refs, strict=True):
        got = resolver.resolve(ref)
        assert got.token_ids.dtype == np.int32 and got.offsets is None
        np.testing.assert_array_equal(got.token_ids, row)


def test_positions_trimmed_and_errors(pair):
    publisher, resolver = pair
    step = publisher.publish_step(batch([[1], [2, 3], [4], [5, 6, 7]], positions=[1, 3, 0]))
    assert resolver.resolve(step.slice_request(0, 1)).to_nested_list() == [[1]]
    two = resolver.resolve(step.slice_request(1, 2))  # the scheduler kept 2 of 3
    assert two.to_nested_list() == [[2, 3], [4]]
    np.testing.assert_array_equal(two.offsets, [0, 2, 3])
    with pytest.raises(shmask.InvalidRowsError):
        step.slice_request(1, 1)  # sliced already: a second ref would release twice
    with pytest.raises(shmask.InvalidRowsError):
        step.slice_request(2, 1)  # no position this step
    with pytest.raises(IndexError):
        step.slice_request(-1, 1)


def test_unclaimed_chunks_are_released_by_the_next_step(pair):
    publisher, resolver = pair
    first = publisher.publish_step(batch([[1], [2], [3]]))
    kept = first.slice_request(2, 1)
    publisher.publish_step(batch([[9]]))  # gives back requests 0 and 1 of the first step
    assert publisher.finish_step() == 1  # the second step's only request, never sliced
    assert resolver.resolve(kept).to_nested_list() == [[3]]
    with pytest.raises(shmask.ShmaskError):
        resolver.resolve(kept)  # released by the first resolve


def test_plain_masks_pass_through(pair):
    _, resolver = pair
    mask = Masks(np.array([5, 6], np.int32))
    assert not shmask_vllm.is_ref(mask) and resolver.resolve(mask) is mask
    assert resolver.resolve(None) is None


def test_adapter_defaults():
    config = shmask_vllm.adapter_config({})
    assert config.max_tokens == shmask_vllm.VLLM_MAX_TOKENS >= 151_936
    assert shmask_vllm.adapter_config({"SHMASK_MAX_TOKENS": "100"}).max_tokens == 100


def test_no_vllm_needed():
    assert "vllm" not in sys.modules


class _Output:
    """The two fields of vLLM's EngineCoreOutput the resolver touches."""

    def __init__(self, request_id: str, mask) -> None:
        self.request_id = request_id
        self.new_sampling_mask = mask


def test_a_step_the_ring_refuses_goes_out_as_vllms_own_masks(prefix):
    """A mask row shmask refuses must not take the engine core down: the
    step's masks travel as vLLM's own object instead."""
    config = shmask.Config(ring_mb=1, name_prefix=prefix, max_tokens=4)
    with shmask.Writer(config) as writer:
        publisher = shmask_vllm.MaskPublisher(writer, mask_lists=Masks)
        wide = batch([np.arange(10)])  # a row wider than SHMASK_MAX_TOKENS
        assert publisher.publish_step(wide) is wide
        step = publisher.publish_step(batch([[1, 2, 3], [4]]))
        assert shmask_vllm.is_ref(step.slice_request(0, 1))
        publisher.close()


def test_vllm_default_takes_whole_vocabulary_rows():
    assert shmask_vllm.VLLM_MAX_TOKENS >= 262_208  # Gemma 3's vocabulary


def test_one_bad_reference_costs_only_its_own_output(pair, reader):
    publisher, resolver = pair
    step = publisher.publish_step(batch([[1], [2, 3], [4]]))
    outputs = [_Output(f"r{i}", step.slice_request(i, 1)) for i in range(3)]
    reader.discard(shmask.ChunkRef.from_bytes(outputs[0].new_sampling_mask.token_ids.tobytes()))
    assert resolver.resolve_outputs(outputs) == ["r0"]  # to be aborted in the engine core
    assert outputs[0].new_sampling_mask is None  # given back already: its request fails
    assert outputs[0].finish_reason == 3  # vLLM's FinishReason.ERROR
    assert "DoubleReleaseError" in outputs[0].error.message
    assert outputs[1].new_sampling_mask.token_ids.tolist() == [2, 3]
    assert outputs[2].new_sampling_mask.token_ids.tolist() == [4]


def test_one_message_of_two_rings_and_several_positions(pair, config, reader):
    """resolve_outputs copies the leader's step as one table; a reference of
    another ring, one with several positions, a plain mask: each resolves as
    resolve() would resolve it alone, and every record goes back."""
    publisher, resolver = pair
    with shmask.Writer(config) as other_writer:
        other = shmask_vllm.MaskPublisher(other_writer, mask_lists=Masks)
        step = publisher.publish_step(batch([[1], [2, 3], [4], [5, 6, 7], [8, 9]],
                                            positions=[1, 3, 1]))
        second = other.publish_step(batch([[11], [12, 13]]))
        outputs = [_Output("a", step.slice_request(0, 1)), _Output("b", second.slice_request(0, 1)),
                   _Output("c", step.slice_request(1, 2)), _Output("d", Masks(np.array([7], np.int32))),
                   _Output("e", second.slice_request(1, 1)), _Output("f", step.slice_request(2, 1))]
        # the same size: only their bytes tell the two rings' references apart
        assert outputs[0].new_sampling_mask.token_ids.size == outputs[1].new_sampling_mask.token_ids.size
        sent = [o.new_sampling_mask.token_ids.tobytes() for o in outputs if o.request_id != "d"]
        assert resolver.resolve_outputs(outputs) == []
        got = {o.request_id: o.new_sampling_mask.to_nested_list() for o in outputs}
        assert got == {"a": [[1]], "b": [[11]], "c": [[2, 3], [4]], "d": [[7]], "e": [[12, 13]],
                       "f": [[8, 9]]}
        np.testing.assert_array_equal(outputs[2].new_sampling_mask.offsets, [0, 2, 3])
        assert outputs[0].new_sampling_mask.offsets is None
        for data in sent:  # every record given back
            with pytest.raises(shmask.DoubleReleaseError):
                reader.open(shmask.ChunkRef.from_bytes(data))
        other.close()


def test_what_fails_after_the_step_copy_fails_alone(pair, monkeypatch):
    """A reference whose positions are malformed is left out of the step's
    copy (its own open says why), and a request whose mask cannot be built
    after the copy fails alone: the others keep their rows, and no released
    record is opened twice."""
    publisher, resolver = pair
    step = publisher.publish_step(batch([[1], [2], [3], [4]]))
    outputs = [_Output(f"r{i}", step.slice_request(i, 1)) for i in range(4)]
    bad = outputs[1].new_sampling_mask
    outputs[1].new_sampling_mask = Masks(bad.token_ids, None, [1, 2])  # not [0, n]
    made = resolver._resolved_type

    def refuse_three(ids, *rest):
        if ids.tolist() == [3]:
            raise RuntimeError("no mask for request r2")
        return made(ids, *rest)

    monkeypatch.setattr(resolver, "_resolved_type", refuse_three)
    assert sorted(resolver.resolve_outputs(outputs)) == ["r1", "r2"]
    assert "cu_num_generated_tokens" in outputs[1].error.message
    assert "RuntimeError: no mask for request r2" in outputs[2].error.message
    assert [o.new_sampling_mask.to_nested_list() for o in (outputs[0], outputs[3])] == [[[1]], [[4]]]


def test_a_reference_of_another_shape_fails_alone(pair):
    """A reference that is not 1-D (2-D of the step's length, or 0-d) among
    a step's: it fails alone, saying so; the others keep their rows."""
    publisher, resolver = pair
    step = publisher.publish_step(batch([[1], [2], [3], [4]]))
    outputs = [_Output(f"r{i}", step.slice_request(i, 1)) for i in range(4)]
    ref = outputs[1].new_sampling_mask.token_ids
    outputs[1].new_sampling_mask = Masks(ref.reshape(-1, 1))  # len() is the step's stride
    outputs[3].new_sampling_mask = Masks(np.array(7, np.uint8))
    assert sorted(resolver.resolve_outputs(outputs)) == ["r1", "r3"]
    assert all("1-D" in outputs[i].error.message for i in (1, 3))
    assert [outputs[i].new_sampling_mask.to_nested_list() for i in (0, 2)] == [[[1]], [[3]]]


# ------------------------------------------- arrays for in-process consumers
def test_arrays_mode_equals_lists_position_for_position(writer, reader):
    """The same step resolved in lists mode (the default: vLLM's own type)
    and in arrays mode: to_nested_list gives int32 arrays equal to the lists,
    one per position; the fields are the same."""
    rng = np.random.default_rng(11)
    positions = [1, 3, 2, 1]
    rows = [np.sort(rng.choice(151_936, n, replace=False)) for n in rng.integers(0, 300, 7)]
    publisher = shmask_vllm.MaskPublisher(writer, mask_lists=Masks)
    lists = shmask_vllm.MaskResolver(reader, mask_lists=Masks)
    arrays = shmask_vllm.MaskResolver(reader, mask_lists=Masks, mask_format="arrays")
    assert lists.mask_format == "lists"
    try:
        kept = [1, 3, 1, 1]
        first = publisher.publish_step(batch(rows, positions))
        want = [lists.resolve(first.slice_request(i, n)) for i, n in enumerate(kept)]
        second = publisher.publish_step(batch(rows, positions))
        got = [arrays.resolve(second.slice_request(i, n)) for i, n in enumerate(kept)]
        for w, g in zip(want, got, strict=True):
            assert type(w) is Masks  # the default: vLLM's own type, its lists
            assert isinstance(g, Masks) and type(g) is shmask_vllm.arrays_mask_type(Masks)
            nested = g.to_nested_list()
            assert all(isinstance(x, np.ndarray) and x.dtype == np.int32
                       and not x.flags.writeable for x in nested)
            assert [x.tolist() for x in nested] == w.to_nested_list()
            np.testing.assert_array_equal(g.token_ids, w.token_ids)
        ids, offsets = shmask_vllm.mask_csr(SimpleNamespace(
            token_ids=[x for g in got for x in g.to_nested_list()]))
        assert ids.dtype == np.int32 and offsets.tolist() == np.cumsum(
            [0] + [len(r) for r in rows[:1] + rows[1:4] + rows[4:5] + rows[6:7]]).tolist()
        np.testing.assert_array_equal(ids, np.concatenate(
            rows[:1] + rows[1:4] + rows[4:5] + rows[6:7]))
    finally:
        publisher.close()  # frees its queues' buffers; published chunks stay until released
    writer.reclaim()
    assert writer.ring_usage()[0] == 0, "every record must be back after its copy"


def test_arrays_mode_from_the_environment(reader, prefix):
    config = shmask_vllm.adapter_config({"SHMASK_MASK_FORMAT": "arrays",
                                         "SHMASK_NAME_PREFIX": prefix})
    assert config.mask_format == "arrays"
    with shmask.Reader(config) as own:
        resolver = shmask_vllm.MaskResolver(own, mask_lists=Masks)
        assert resolver.mask_format == "arrays"
    with pytest.raises(shmask.ShmaskError, match="mask_format"):
        shmask_vllm.MaskResolver(reader, mask_lists=Masks, mask_format="csv")
    assert shmask_vllm.MaskResolver(reader, mask_lists=Masks).mask_format == "lists"


def test_empty_values_mean_unset_for_the_adapters_defaults():
    config = shmask_vllm.adapter_config({"SHMASK_MAX_TOKENS": "", "SHMASK_QUEUE_ROWS": " "})
    assert config.max_tokens == shmask_vllm.VLLM_MAX_TOKENS
    assert config.queue_rows == shmask_vllm.VLLM_QUEUE_ROWS


def test_start_engine_core_makes_the_ring_before_the_first_step(monkeypatch, prefix):
    monkeypatch.setattr(shmask_vllm, "_publisher", None)
    monkeypatch.setattr(shmask_vllm, "mask_type", lambda: shmask_vllm._MaskLists)  # no vLLM
    monkeypatch.setenv("SHMASK_NAME_PREFIX", prefix)
    monkeypatch.setenv("SHMASK_RING_MB", "1")
    publisher = shmask_vllm.start_engine_core()
    try:
        assert shmask_vllm._publisher is publisher and not publisher.writer.closed
        assert prefix in publisher.writer.segment_name
        assert shmask_vllm.start_engine_core() is publisher
        steps = shmask_vllm.publish_step(batch([[5, 7]]))
        assert shmask_vllm._publisher is publisher  # the first step used it
        assert shmask_vllm.is_ref(steps.slice_request(0, 1))
    finally:
        publisher.close()


def test_start_engine_core_turns_metrics_on_with_log_stats(prefix):
    """In a child (metrics are process-wide): log_stats on, vLLM's labels
    on shmask's series, the ring shown at start."""
    pytest.importorskip("prometheus_client")
    child = textwrap.dedent("""
        from prometheus_client import REGISTRY, generate_latest
        from shmask import metrics
        from shmask.adapters import vllm
        vllm.mask_type = lambda: vllm._MaskLists  # vLLM not imported: quick
        vllm.start_frontend(log_stats=False)
        assert not metrics.enabled()
        publisher = vllm.start_engine_core(log_stats=True,
                                           metrics_labels={"model_name": "m", "engine": 0})
        print(publisher.writer.segment_name)
        print(generate_latest(REGISTRY).decode())
        publisher.close()
    """)
    env = dict(os.environ, SHMASK_NAME_PREFIX=prefix, SHMASK_RING_MB="1")
    done = run_child([sys.executable, "-c", child], env)
    assert done.returncode == 0, done.stderr
    segment, text = done.stdout.split("\n", 1)
    labels = f'engine="0",model_name="m",segment="{segment}"'
    assert f"shmask_ring_capacity_bytes{{{labels}}} 1.048576e+06" in text.splitlines()


@pytest.mark.parametrize("remote", ["off", "nixl-unavailable"])
def test_a_headless_engine_core_sends_its_masks_inline_to_a_front_end_elsewhere(
        monkeypatch, prefix, reader, remote):
    """A headless engine core (its front-end on another node, vLLM's
    local_client False): with SHMASK_REMOTE off, or on where the ring cannot
    be exported to NIXL, every mask rides inline in its reference (no ring
    made), so a front-end that cannot map this host's /dev/shm reads it."""
    monkeypatch.setenv("SHMASK_NAME_PREFIX", prefix)
    monkeypatch.setitem(shmask_vllm._outputs, "head", None)
    if remote == "off":
        monkeypatch.delenv("SHMASK_REMOTE", raising=False)
    else:
        monkeypatch.setenv("SHMASK_REMOTE", "nixl")

        def no_nixl(*args, **kwargs):
            raise ImportError("No module named 'nixl_cu12'")

        monkeypatch.setattr(shmask.remote_refs, "Leaving", no_nixl)
    assert shmask_vllm.outputs_go_to(["tcp://10.1.2.3:5571"]) == "10.1.2.3:5571"
    publisher = shmask_vllm.MaskPublisher(mask_lists=Masks)
    try:
        assert publisher.writer.segment is None and publisher.leaving is None
        assert [n for n in os.listdir("/dev/shm") if n.startswith(prefix)] == []
        rows = [[3, 9], [4], [7, 8, 11]]
        step = publisher.publish_step(batch(rows))
        outputs = [SimpleNamespace(request_id=f"r{i}", finish_reason=None,
                                   new_sampling_mask=step.slice_request(i, 1))
                   for i in range(3)]
        assert all(shmask.ChunkRef.from_bytes(o.new_sampling_mask.token_ids.tobytes()).inline
                   for o in outputs)
        resolver = shmask_vllm.MaskResolver(reader, mask_lists=Masks)
        assert resolver.resolve_outputs(outputs) == []
        assert [o.new_sampling_mask.token_ids.tolist() for o in outputs] == rows
    finally:
        publisher.close()
        shmask_vllm.outputs_go_to(None)


def test_a_front_end_on_this_host_keeps_the_ring(monkeypatch, prefix):
    monkeypatch.setenv("SHMASK_NAME_PREFIX", prefix)
    monkeypatch.setenv("SHMASK_RING_MB", "1")
    assert shmask_vllm.outputs_go_to(None) is None
    publisher = shmask_vllm.MaskPublisher(mask_lists=Masks)
    try:
        assert publisher.writer.segment is not None and publisher.leaving is None
    finally:
        publisher.close()
