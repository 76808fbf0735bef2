"""Run SGLang 0.5.23's real `Sampler.forward` on the CPU, released and as
shmask/integrations/sglang.patch changes it, on the same inputs (a helper
for the compat tests; it holds no tests).

    sampler_context(max_tokens, backend="pytorch", deterministic=False)
        context manager: publishes the runtime context the sampler reads
        (build the Sampler and call forward inside it).
    load_sampler_module(patched, patch=PATCH) -> module
        the released sampler.py (patched=False) or that file with only its own
        section of `patch` applied, each under a name of its own; cached.
    load_module(file, patched, patch=PATCH) -> module
        the same for any file of the package (the scheduler's
        batch_result_processor.py, for materialize_sampling_mask_output).
    sampling_info(logits, *, temperatures, top_ks, top_ps, min_ps,
                  mask_rows, support_rows, seeds=None) -> SamplingBatchInfo
        built by SGLang's own SamplingBatchInfo.from_schedule_batch from
        real SamplingParams (top_k -1 = off, temperature 0 = greedy).
    run_forward(module, sampler, logits, info, positions=None, *, torch_seed=0)
        -> (next_token_ids, SamplingMaskOutput)
    ok_rows(output, info) -> [MaskRow(status, ids, selected_logprob, support_logprobs)]
        one per opted-in row, read the way the scheduler's
        materialize_sampling_mask_output reads them (it needs `info` for which
        rows asked "support", as that function needs the requests).

Everything is SGLang's own code except two stand-ins, both for what a process
without torch.distributed has not got: the request and batch objects that
from_schedule_batch reads (`_Req`, `_Batch`: only the attributes it reads),
and the TP group handle (see `sampler_context`).

Seeded (deterministic) sampling cannot run here: on a CPU tensor SGLang's
murmur_hash32 calls sgl_kernel's CPU op, and sgl_kernel ships CUDA builds
only; `run_forward` says so before torch.compile spends ~25 s on the way there.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
import torch

from shmask.integrate import split_patch

REPO = Path(__file__).resolve().parents[2]
PATCH = REPO / "shmask" / "integrations" / "sglang.patch"
SAMPLER_FILE = "sglang/srt/layers/sampler.py"
# The installed file, found through the distribution rather than `import
# sglang`: test_sglang_adapter.py imports SGLang from a patched copy of the
# package, and that copy's sampler.py is the patched one once the patch has a
# section for it.
INSTALLED_SAMPLER = Path(str(importlib.metadata.distribution("sglang").locate_file(SAMPLER_FILE)))
# load_module's cache: (patched, file and digest of its section) -> module
_MODULES: dict[tuple[bool, str], ModuleType] = {}


def _importable_sglang() -> None:
    """Drop SGLang from sys.modules when the tree it was imported from is
    gone, so the next import finds the installed package. In one pytest
    process test_sglang_adapter.py imports SGLang from a patched copy (kept
    until the process ends; this guards any tree removed earlier); SGLang
    imports many of its modules lazily (ServerArgs resolution, the sampler's
    softmax), and those would no longer be found. The cached sampler modules go too: they were bound to
    the dropped modules (and so does shmask.adapters.sglang_spill, whose
    class derives from SGLang's SamplingMaskOutput)."""
    package = sys.modules.get("sglang")
    if package is None or Path(package.__file__ or "").is_file():
        return
    for name in [name for name in sys.modules if name == "sglang" or name.startswith("sglang.")]:
        del sys.modules[name]
    # shmask's one module that subclasses an SGLang type, bound to the dropped tree
    sys.modules.pop("shmask.adapters.sglang_spill", None)
    _MODULES.clear()


# ------------------------------------------------------------ the context

@contextmanager
def sampler_context(max_tokens: int, backend: str = "pytorch",
                    deterministic: bool = False, disaggregation: str = "null") -> Iterator[Any]:
    """Publish a single-rank SGLang runtime context for the duration of the
    block, then put the previous one back (by identity: nothing of it is
    touched). Yields the RuntimeContext. `disaggregation`: the server's
    --disaggregation-mode ("null", "prefill", "decode").

    The config is a real ServerArgs resolved by SGLang's own `create_context`
    (as a launcher's `publish` does, rank 0 of 1), made current by
    `use_context`. Process groups are never built without torch.distributed,
    so the TP groups are stated with `get_parallel().override`, as the error
    for an unbuilt group asks: a one-rank handle carrying what the sampler
    reads (`Sampler.__init__` keeps `device_group`, which is only passed to
    torch.distributed calls, all behind `dist.is_initialized()`)."""
    _importable_sglang()
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy", sampling_backend=backend,
                      sampling_mask_max_tokens=max_tokens,
                      enable_deterministic_inference=deterministic,
                      disaggregation_mode=disaggregation)
    context = runtime_context.create_context(args, role="test",
                                             ranks=runtime_context.SpawnRanks(world_rank=0))
    group = SimpleNamespace(rank_in_group=0, world_size=1, device_group=None)
    with runtime_context.use_context(context), context.parallel.override(tp_group=group,
                                                                         attn_tp_group=group):
        yield context


# --------------------------------------------------------- the modules

class SamplerPatchError(RuntimeError):
    """The patch has no section for sampler.py, or that section does not apply."""


def load_sampler_module(patched: bool, patch: Path = PATCH) -> ModuleType:
    """The sampler module: the installed file (patched=False), or a copy of it
    with `patch`'s sampler.py section applied (`patch -p1 --forward
    --fuzz=0`, nothing else of the patch). Each is imported from its file
    under a name of its own, so both live in one process; cached per process
    (and per patch text)."""
    return load_module(SAMPLER_FILE, patched, patch)


def load_module(file: str, patched: bool, patch: Path = PATCH) -> ModuleType:
    """`load_sampler_module` for any file of the package (`file` as the
    patch names it, e.g. sglang/srt/managers/scheduler_components/
    batch_result_processor.py)."""
    _importable_sglang()
    installed = Path(str(importlib.metadata.distribution("sglang").locate_file(file)))
    stem = "_" + Path(file).stem
    package = file.removesuffix(".py").replace("/", ".").rsplit(".", 1)[0]
    if not patched:
        key = (False, file)
        if key not in _MODULES:
            _MODULES[key] = _import_file(f"{package}.{stem}_released", installed)
        return _MODULES[key]
    patch = Path(patch)
    sections = [section for section in split_patch(patch) if section.path == file]
    if len(sections) != 1:
        count = f"{len(sections)} sections" if sections else "no section"
        raise SamplerPatchError(f"{patch} has {count} for {file}")
    text = sections[0].text
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    key = (True, f"{file}:{digest}")
    if key not in _MODULES:
        if shutil.which("patch") is None:
            raise SamplerPatchError("GNU patch is not installed (Debian/Ubuntu: apt-get install patch)")
        root = Path(tempfile.mkdtemp(prefix="shmask-sampler-"))
        atexit.register(shutil.rmtree, root, True)  # the module's __file__ lives there until exit
        target = root / file
        target.parent.mkdir(parents=True)
        shutil.copy(installed, target)
        applied = subprocess.run(["patch", "-p1", "--forward", "--fuzz=0", "-d", str(root)],
                                 input=text, capture_output=True, text=True, timeout=60)
        if applied.returncode != 0:
            raise SamplerPatchError(f"{patch}: its {file} section does not apply to "
                                    f"{installed}:\n{(applied.stdout + applied.stderr).strip()}")
        name = f"{package}.{stem}_shmask_patched"
        if Path(patch).resolve() != PATCH.resolve():
            name += f"_{digest}"  # a test's own patch never takes the shipped one's name
        _MODULES[key] = _import_file(name, target)
    return _MODULES[key]


def _import_file(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec, as import does (NamedTuple and pickling look it up)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


# ------------------------------------------------------- the batch info

class _Req:
    """What SamplingBatchInfo.from_schedule_batch (and the penalizers it
    builds) read of a scheduler Req."""

    def __init__(self, params: Any, mask: bool, support: bool):
        self.sampling_params = params
        self.custom_logit_processor = None
        self.return_sampling_mask = mask
        self.sampling_logprobs_mode = "support" if support else "selected"


class _Batch:
    """What from_schedule_batch reads of a ScheduleBatch (a class, not a
    SimpleNamespace: the penalizer orchestrator keeps a weakref to it)."""

    def __init__(self, reqs: list[_Req], device: str):
        self.reqs = reqs
        self.device = device


def sampling_info(logits: torch.Tensor, *, temperatures: Sequence[float], top_ks: Sequence[int],
                  top_ps: Sequence[float], min_ps: Sequence[float], mask_rows: Sequence[int],
                  support_rows: Sequence[int], seeds: Sequence[int] | None = None) -> Any:
    """A real SamplingBatchInfo for the [B, V] batch `logits` (only its shape
    and device are read), from SGLang's SamplingBatchInfo.from_schedule_batch:
    one real SamplingParams per row (normalised by SGLang: top_k -1 becomes
    TOP_K_ALL, temperature 0 becomes top_k 1), `mask_rows` the rows that
    return a sampling mask, `support_rows` (among them) those in "support"
    mode. Call inside `sampler_context`: from_schedule_batch reads it.

    `seeds` are the rows' sampling_seed. SGLang keeps them only under
    deterministic inference (and then seeds every row, 42 by default), so
    seeds outside a deterministic context raise rather than vanish."""
    from sglang.srt.runtime_context import get_exec
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.sampling.sampling_params import SamplingParams

    batch, vocab = logits.shape
    columns = {"temperatures": temperatures, "top_ks": top_ks, "top_ps": top_ps, "min_ps": min_ps}
    if seeds is not None:
        columns["seeds"] = seeds
    for name, column in columns.items():
        if len(column) != batch:
            raise ValueError(f"{name}: {len(column)} values for a batch of {batch}")
    if not set(support_rows) <= set(mask_rows):
        raise ValueError(f"support_rows {sorted(support_rows)} must be among mask_rows {sorted(mask_rows)}")
    if seeds is not None and not get_exec().deterministic.enable_deterministic_inference:
        raise ValueError("seeds need sampler_context(..., deterministic=True): SGLang drops "
                         "sampling_seed without deterministic inference")
    reqs = []
    for row in range(batch):
        params = SamplingParams(temperature=temperatures[row], top_k=top_ks[row], top_p=top_ps[row],
                                min_p=min_ps[row], sampling_seed=None if seeds is None else seeds[row])
        params.verify(vocab)
        reqs.append(_Req(params, row in mask_rows, row in support_rows))
    return SamplingBatchInfo.from_schedule_batch(_Batch(reqs, str(logits.device)), vocab)


# ------------------------------------------------------------ the forward

def run_forward(module: ModuleType, sampler: Any, logits: torch.Tensor, info: Any,
                positions: torch.Tensor | None = None, *,
                torch_seed: int | None = 0) -> tuple[torch.Tensor, Any]:
    """`sampler.forward` on a copy of `logits` (forward softmaxes them in
    place), without logprobs; returns (next_token_ids, the output's
    sampling_mask_output). `torch_seed` seeds torch's global generator first,
    so two forwards on the same inputs draw the same unseeded samples
    (torch.multinomial); None leaves it alone."""
    if info.sampling_seed is not None and logits.device.type == "cpu" \
            and importlib.util.find_spec("sgl_kernel") is None:
        raise RuntimeError("seeded sampling on the CPU needs sgl_kernel's murmur_hash32_cpu "
                           "(SGLang's murmur_hash32), and sgl_kernel is not installed")
    batch = logits.shape[0]
    if positions is None:
        positions = torch.zeros(batch, dtype=torch.int64, device=logits.device)
    output = module.LogitsProcessorOutput(next_token_logits=logits.clone())
    if torch_seed is not None:
        torch.manual_seed(torch_seed)
    next_token_ids = sampler.forward(output, info, return_logprob=False, top_logprobs_nums=[0] * batch,
                                     token_ids_logprobs=[None] * batch, positions=positions)
    return next_token_ids, output.sampling_mask_output


class MaskRow(NamedTuple):
    status: int  # SamplingMaskStatus: 0 OK, 1 OVERFLOW, 2 INVALID
    ids: np.ndarray | None  # token_ids[row, :length]; None unless OK
    selected_logprob: float | None  # None unless OK
    support_logprobs: np.ndarray | None  # support_logprobs[support row, :length]; "support" rows only


def ok_rows(output: Any, info: Any) -> list[MaskRow]:
    """One MaskRow per opted-in row, in batch order, read as SGLang's
    materialize_sampling_mask_output reads them: ids and logprobs only for
    OK rows, the support logprobs' rows counted over the "support" requests
    in batch order (whatever their status). `info` says which rows opted in
    and which asked "support" (its CPU flags, as the scheduler's requests)."""
    token_ids = output.token_ids.cpu().numpy()
    lengths = output.lengths.tolist()
    statuses = output.statuses.tolist()
    selected = output.selected_logprobs.cpu().numpy()
    support = None if output.support_logprobs is None else output.support_logprobs.cpu().numpy()
    flags = [wants_support for opted_in, wants_support in zip(
        info.return_sampling_masks, info.return_sampling_support_logprobs, strict=True) if opted_in]
    assert len(flags) == len(lengths), f"{len(lengths)} mask rows for {len(flags)} opted-in requests"
    rows = []
    support_row = 0
    for row, is_support in enumerate(flags):
        status, length = int(statuses[row]), int(lengths[row])
        if status == 0:
            rows.append(MaskRow(status, token_ids[row, :length], float(selected[row]),
                                support[support_row, :length] if is_support else None))
        else:
            rows.append(MaskRow(status, None, None, None))
        support_row += is_support
    return rows
