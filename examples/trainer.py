"""An RL trainer's side of shmask: rollouts from the example
server (examples/server.py, SGLang's /generate) with their sampling masks
as binary rows, packed into one batch, and a GRPO-style loss whose
importance ratio replays the rollout's sampler, one optimizer step at a
time.

    python examples/trainer.py [--prompts 4 --samples 4 --steps 2 --max-new-tokens 32 --top-k 50
                                [--check]]

What a trainer integrates is three calls (docs/training.md):

    batch = shmask.train.from_binary([meta_info, ...], vocab=V)  # the responses' rows, packed
    batch = batch.to(device)                                     # pinned host memory, one copy
    out = replay_logprobs(logits, targets, batch.offsets, batch.ids, forms=batch.forms,
                          valid=batch.valid, temperature=T, full=True)

`from_binary` takes each sequence's meta_info as `shmask.binary_rows.loads`
left it (the base64 rows already decoded into numpy arrays, never Python
lists) and packs the micro-batch's sequences into a few flat tensors:
`seq_offsets` [S + 1] (the packed sequences' cu_seqlens), `offsets` [N + 1]
into `ids` (token t's support: its ascending ids, or bitmask words where
`forms[t]` is 1), `valid` [N] and `rollout_logprobs` [N] (the sampler's
logprob of each sampled token: "selected" mode carries it).
`replay_logprobs` gives, for each generated token t, the logprob of the
sampled token under the trainer's logits restricted to the support S_t the
sampler drew it from,

    logp_S(t) = z[t, a_t] / T - logsumexp_{v in S_t} z[t, v] / T

and its gradient. No dense [N, V] mask is built: a trainer that builds one
by hand scatters the ids into N x V booleans (here 151,936 columns a token;
at 16,384 tokens 2.5 GB), masks a copy of the logits and takes a full
log-softmax over it, all for a quantity that depends on the support's
columns alone. The replay kernel reads only the support's logits (a gather
of L values per token, or a bitmask row's words) and writes each token's
gradient row once, in one pass; `full=True` adds, from the same launch
(one more read of each row), the target's full-vocabulary logp and the support's mass under the
trainer's policy (how much of it the sampler kept: a drift diagnostic).

The steps here:
1. The example server starts as a child process (its own process group,
   a free port, small sizes); the trainer waits for /health and, whatever
   happens, stops it at the end (SIGTERM: the server stops its engine and
   the producer unlinks its ring; then SIGKILL to whatever of the group is
   left). The kernel sends the server SIGTERM if the trainer dies first
   (PR_SET_PDEATHSIG, workload.exit_with). Requests go over the stdlib's
   urllib.
2. G prompts x K samples (`sampling_params.sampling_seed` k), each with
   `return_sampling_mask`, `sampling_mask_format` "base64",
   `sampling_logprobs_mode` "selected" and `return_logprob`. The generated
   tokens are `output_ids` (checked against meta_info's
   `output_token_logprobs`, `[logprob, token id, null]` per token, whose
   logprobs must equal the rows' selected-mode values).
3. `from_binary(..., vocab=V)`, V the example engine's vocabulary
   (workload.VOCAB, 151,936).
4. A toy policy: an embedding of the previous token (a fixed BOS id before
   each sequence's first) and a linear head, teacher-forced on the
   generated tokens: logits [N, V], one row per generated token of the
   batch, in the batch's order.
5. The replay, `full=True`, targets the generated tokens, temperature 1
   (the requests' own: the replay must use the rollout's temperature).
6. GRPO-style loss. A toy reward per sequence (the fraction of even token
   ids); advantage A = (reward - group mean) / (group std + 1e-6) within
   each prompt's K samples (population std); per token, the truncated
   importance ratio r = exp(logp_S - rollout_logprob) between the
   trainer's support-restricted policy and the sampler's, and PPO's clipped
   surrogate:

       loss = -mean over defined tokens of min(r A, clip(r, 1 - eps, 1 + eps) A)

   A token whose logp_S is NaN (an undefined row: status not OK, the
   target outside its support, malformed ids; none from this server) or
   without a rollout logprob is masked out of the loss and counted. Then
   backward and an Adam step, --steps times, and the loss once more after
   the last step (logp_S alone: full=False). The example engine's logprobs
   are a seeded stand-in (workload.py) and the policy is random, so most
   ratios start far from 1 and are clipped; with a real engine and the
   policy whose weights it serves they start at 1.

It prints a short report and, as its last line, the same as one JSON
object (tests/test_example_trainer.py reads it); --check also compares the
first sequence's replay with the dense-mask reference
(reference_replay_logprobs), the one [L, V] mask this script builds.
Without CUDA it runs on the CPU, the replay kernel in Triton's interpreter
(chosen by shmask.kernels on its own): there each row costs ~0.1 s
(full=True reads all 151,936 columns of it, in Python-driven blocks), so
--max-new-tokens defaults to 8 instead of 32: 128 tokens, about 15 s a step
on an idle 2-core machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from shmask.kernels import reference_replay_logprobs, replay_logprobs, use_interpreter
from workload import VOCAB, describe_exit, exit_with

from shmask.binary_rows import loads
from shmask.train import FORM_BITMASK, ReplayBatch, from_binary

HERE = Path(__file__).resolve().parent
BOS = 0  # the toy policy's "previous token" before a sequence's first
HEALTH_TIMEOUT_S = 60
# urllib without the environment's proxies: the server is on this machine.
HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class TrainerFailed(Exception):
    """The server or a response was not what the trainer needs: the message says which."""


# ------------------------------------------------------------------ the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with(parent: int) -> None:
    """In the server's process, between fork and exec: SIGTERM when the
    trainer dies (even by SIGKILL), so no server outlives it."""
    exit_with(parent)
    if os.getppid() != parent:  # the trainer died before the line above
        os._exit(1)


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """examples/server.py on a free port, in its own process group, once
    /health answers 200. Its output goes to this process's stderr (stdout
    is the report). SHMASK_* settings (SHMASK_NAME_PREFIX: its ring's name)
    are inherited."""
    env = dict(os.environ)
    env.setdefault("SHMASK_RING_MB", "16")  # a few hundred KB of rows here
    for attempt in range(3):  # a free port can be taken before the server binds it
        port = free_port()
        command = [sys.executable, str(HERE / "server.py"), "--port", str(port),
                   "--requests", str(args.requests), "--tokens", str(args.tokens),
                   "--top-k", str(args.top_k), "--seed", str(args.seed)]
        process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr,
                                   stderr=sys.stderr, start_new_session=True,
                                   preexec_fn=functools.partial(_die_with, os.getpid()))
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(process, url)
            return process, url
        except TrainerFailed:
            stop_server(process)
            if process.returncode != 1 or attempt == 2:  # 1: the port was taken
                raise
        except BaseException:
            stop_server(process)
            raise
    raise AssertionError("unreachable")


def wait_healthy(process: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while True:
        try:
            with HTTP.open(url + "/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # not listening yet (or 503: an engine process failed; it exits then)
        if process.poll() is not None:
            raise TrainerFailed(f"the server {describe_exit(process.returncode)} before it "
                                "answered /health")
        if time.monotonic() > deadline:
            raise TrainerFailed(f"the server did not answer /health within {HEALTH_TIMEOUT_S} s")
        time.sleep(0.1)


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM (the server stops its engine, whose producer unlinks its
    ring), then SIGKILL to whatever of its process group is left."""
    try:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the group is gone: the usual case
        process.wait()


# ------------------------------------------------------------------ rollouts
def generate(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One /generate, its body parsed by shmask.binary_rows.loads: the
    binary-rows object in meta_info arrives decoded (BinaryRows)."""
    request = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with HTTP.open(request, timeout=120) as reply:
            return loads(reply.read())
    except urllib.error.HTTPError as exc:
        raise TrainerFailed(f"/generate answered {exc.code}: {exc.read().decode()[:400]}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise TrainerFailed(f"/generate failed: {getattr(exc, 'reason', exc)}") from None


def rollouts(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """G prompts x K samples, prompt-major (sequence g K + k is prompt g's
    k-th sample), sent at once as a rollout worker sends them."""
    bodies = [{
        "text": f"Question {g}: how many even numbers are there below {10 * (g + 1)}?",
        "sampling_params": {"max_new_tokens": args.max_new_tokens, "top_k": args.top_k,
                            "sampling_seed": k},
        "return_sampling_mask": True,
        "sampling_mask_format": "base64",
        "sampling_logprobs_mode": "selected",
        "return_logprob": True,
        "rid": f"prompt{g}-sample{k}",
    } for g in range(args.prompts) for k in range(args.samples)]
    with ThreadPoolExecutor(min(len(bodies), 16)) as pool:
        return list(pool.map(lambda body: generate(url, body), bodies))


def generated_tokens(response: dict[str, Any], where: str) -> tuple[list[int], list[float]]:
    """A response's generated token ids (`output_ids`) and the sampled
    tokens' logprobs (meta_info's `output_token_logprobs`, SGLang's
    [logprob, token id, text] per token), checked against each other."""
    tokens = response["output_ids"]
    entries = response["meta_info"]["output_token_logprobs"]
    if [entry[1] for entry in entries] != tokens:
        raise TrainerFailed(f"{where}: output_ids and output_token_logprobs name other tokens")
    return tokens, [entry[0] for entry in entries]


# ------------------------------------------------------------------ the policy
class ToyPolicy(torch.nn.Module):
    """logits of the next token from the previous one alone: enough to have
    [N, V] logits with a gradient."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, previous: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(previous)))


def support_sizes(batch: ReplayBatch) -> np.ndarray:
    """Each token's support size from the batch's CSR offsets and forms: an
    ids row's length, a bitmask row's set bits (0 for a row not valid)."""
    offsets, forms = batch.offsets.cpu().numpy(), batch.forms.cpu().numpy()
    ids = batch.ids.cpu().numpy()
    sizes = np.diff(offsets)
    for t in np.flatnonzero(forms == FORM_BITMASK):
        words = np.ascontiguousarray(ids[offsets[t]:offsets[t + 1]])
        sizes[t] = int(np.unpackbits(words.view(np.uint8)).sum())
    sizes[~batch.valid.cpu().numpy()] = 0
    return sizes


def grpo_loss(policy: ToyPolicy, previous: torch.Tensor, targets: torch.Tensor,
              batch: ReplayBatch, advantages: torch.Tensor, eps: float, full: bool = True
              ) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor]:
    """(loss, the replay's output, defined [N], ratio [N]): PPO's clipped
    surrogate over the tokens whose logp_S and rollout logprob are defined.
    The output is a ReplayOutput (logp_support, logp_full, support_mass)
    with `full`, else logp_S alone."""
    logits = policy(previous)  # [N, V]
    out = replay_logprobs(logits, targets, batch.offsets, batch.ids, forms=batch.forms,
                          valid=batch.valid, temperature=1.0, full=full)
    logp_s = out.logp_support if full else out
    assert batch.rollout_logprobs is not None
    rollout = batch.rollout_logprobs
    defined = torch.isfinite(logp_s) & torch.isfinite(rollout)
    # Undefined tokens take no part: their ratio is 1 and their weight 0 (no NaN reaches backward).
    log_ratio = (logp_s - rollout).masked_fill(~defined, 0.0)
    ratio = torch.exp(log_ratio)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - eps, 1 + eps) * advantages)
    loss = -(surrogate * defined).sum() / defined.sum().clamp(min=1)
    return loss, out, defined, ratio


# ------------------------------------------------------------------ the run
def train(url: str, args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    responses = rollouts(url, args)
    rollout_s = time.perf_counter() - t0
    sequences = [generated_tokens(r, f"sequence {s}") for s, r in enumerate(responses)]

    # 3. the responses' rows, packed (CSR, flat tensors), then on the device
    batch = from_binary([r["meta_info"] for r in responses], vocab=VOCAB)
    lengths = [len(tokens) for tokens, _ in sequences]
    if batch.seq_offsets.diff().tolist() != lengths:
        raise TrainerFailed(f"the rows count {batch.seq_offsets.diff().tolist()} tokens per "
                            f"sequence, output_ids {lengths}")
    if batch.rollout_logprobs is None:
        raise TrainerFailed("the rows carry no rollout logprobs (selected mode does)")
    claimed = np.array([lp for _, logprobs in sequences for lp in logprobs], np.float32)
    if not np.array_equal(claimed, batch.rollout_logprobs.numpy(), equal_nan=True):
        raise TrainerFailed("output_token_logprobs and the rows' selected logprobs differ")
    sizes = support_sizes(batch)  # on the host, before the copy
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batch = batch.to(device)
    n, s, g, k = batch.num_tokens, batch.num_sequences, args.prompts, args.samples

    # 4. teacher forcing: token t's logits from the token before it
    targets = torch.tensor([t for tokens, _ in sequences for t in tokens], dtype=torch.int64)
    previous = torch.tensor([p for tokens, _ in sequences for p in [BOS, *tokens[:-1]]],
                            dtype=torch.int64)
    targets, previous = targets.to(device), previous.to(device)

    # 6. rewards and group-normalized advantages, one per sequence, then per token
    rewards = np.array([np.mean(np.asarray(tokens) % 2 == 0) if tokens else 0.0
                        for tokens, _ in sequences]).reshape(g, k)
    advantages = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-6)
    per_token = torch.repeat_interleave(torch.tensor(advantages.reshape(-1), dtype=torch.float32),
                                        torch.tensor(lengths)).to(device)

    torch.manual_seed(args.seed)
    policy = ToyPolicy(VOCAB, args.width).to(device)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    print(f"rollouts: {g} prompts x {k} samples from {url}/generate in {rollout_s:.2f} s "
          f"(base64 rows, selected mode, top_k {args.top_k}, max_new_tokens {args.max_new_tokens})")
    bitmask_rows = int((batch.forms == FORM_BITMASK).sum())
    print(f"batch: {s} sequences, {n} tokens, {batch.ids.numel():,} int32 of id data "
          f"({bitmask_rows} bitmask rows); a dense mask would be {n} x {VOCAB:,} "
          f"= {n * VOCAB / 1e6:.1f} M entries")
    print(f"rewards (fraction of even ids) per prompt: "
          f"{'; '.join(' '.join(f'{r:.2f}' for r in row) for row in rewards)}")
    mode = "Triton's interpreter" if use_interpreter() else "compiled"
    losses: list[float] = []
    for step in range(args.steps + 1):
        started = time.perf_counter()
        if step < args.steps:
            loss, out, defined, ratio = grpo_loss(policy, previous, targets, batch, per_token,
                                                  args.eps)
            if not bool(defined.any()):
                raise TrainerFailed("no token has a defined logp_S: nothing to train on")
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        else:  # the loss after the last step: logp_S alone will do
            with torch.no_grad():
                loss, out, defined, ratio = grpo_loss(policy, previous, targets, batch, per_token,
                                                      args.eps, full=False)
        elapsed = time.perf_counter() - started
        losses.append(loss.item())
        if step == 0:  # the replay's view of the batch, before any step
            first = out, defined, ratio
        kept = defined.cpu()
        r = ratio.detach().cpu()[kept]
        clipped = float(((r < 1 - args.eps) | (r > 1 + args.eps)).float().mean())
        what = f"step {step + 1}: loss before it" if step < args.steps else \
            f"after {args.steps} steps: loss"
        print(f"{what} {losses[-1]:.6f} (ratio median {float(r.median()):.3g}, "
              f"{clipped:.0%} outside [1 - eps, 1 + eps]); replay + loss"
              f"{' + backward + Adam' if step < args.steps else ''} {elapsed:.2f} s on {device} "
              f"({mode})")

    out, defined, _ = first
    logp_s, logp_full, mass = (x.detach().cpu() for x in out)
    kept = defined.cpu()
    undefined = n - int(kept.sum())
    # full=True's outputs agree: logp_full = logp_S + log(support mass) where defined
    identity = float((logp_full[kept] - logp_s[kept] - torch.log(mass[kept])).abs().max()) \
        if kept.any() else math.nan
    report: dict[str, Any] = {
        "tokens": n, "sequences": s, "prompts": g, "samples": k,
        "max_new_tokens": args.max_new_tokens, "defined": n - undefined, "undefined": undefined,
        "bitmask_rows": bitmask_rows, "top_k": args.top_k,
        "support_size_mean": float(sizes.mean()) if n else 0.0,
        "support_size_min": int(sizes.min()) if n else 0,
        "support_size_max": int(sizes.max()) if n else 0,
        "support_mass_mean": float(mass[kept].mean()) if kept.any() else math.nan,
        "support_mass_min": float(mass[kept].min()) if kept.any() else math.nan,
        "support_mass_max": float(mass[kept].max()) if kept.any() else math.nan,
        "logp_full_identity_error": identity,
        "loss": losses, "device": str(device), "interpreter": use_interpreter(),
    }
    print(f"replay: {n - undefined}/{n} rows defined ({undefined} undefined, masked out of the "
          f"loss); support size mean {report['support_size_mean']:.1f} ids "
          f"(min {report['support_size_min']}, max {report['support_size_max']}, top_k "
          f"{args.top_k}); support mass under the toy policy mean "
          f"{report['support_mass_mean']:.3g} (min {report['support_mass_min']:.3g}, max "
          f"{report['support_mass_max']:.3g}); |logp_full - logp_S - log mass| <= {identity:.2g}")
    if args.check:
        report["reference_max_error"] = check_against_dense(policy, previous, targets, batch,
                                                            lengths[0])
        print(f"check: the first sequence's {lengths[0]} rows against the dense-mask reference: "
              f"max |difference| {report['reference_max_error']:.2g}")
    return report


def check_against_dense(policy: ToyPolicy, previous: torch.Tensor, targets: torch.Tensor,
                        batch: ReplayBatch, rows: int) -> float:
    """--check: the replay of the first sequence's rows against
    reference_replay_logprobs, the dense [rows, V] mask and masked
    log-softmax a trainer would write by hand (float64), built only here."""
    with torch.no_grad():
        logits = policy(previous[:rows])
        offsets, ids = batch.offsets[:rows + 1], batch.ids
        options = {"forms": batch.forms[:rows], "valid": batch.valid[:rows]}
        ours = replay_logprobs(logits, targets[:rows], offsets, ids, **options)
        dense = reference_replay_logprobs(logits, targets[:rows], offsets, ids, **options)
    if not torch.equal(ours.isnan(), dense.isnan()):
        return math.inf
    both = ~ours.isnan()
    return float((ours[both].double() - dense[both]).abs().max()) if both.any() else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4, help="G: prompts (GRPO's groups)")
    parser.add_argument("--samples", type=int, default=4, help="K: samples per prompt (at least 2)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="tokens per sample (default 32; 8 where the replay runs in Triton's "
                             "interpreter, which takes ~0.1 s a token on a CPU)")
    parser.add_argument("--top-k", type=int, default=50, help="the requests' top_k (the supports)")
    parser.add_argument("--eps", type=float, default=0.2, help="PPO's clip range")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam's learning rate")
    parser.add_argument("--width", type=int, default=64, help="the toy policy's embedding width")
    parser.add_argument("--requests", type=int, default=64,
                        help="the example engine's distinct completions (server --requests)")
    parser.add_argument("--tokens", type=int, default=64,
                        help="the engine's longest completion (server --tokens)")
    parser.add_argument("--seed", type=int, default=0, help="the engine's and the policy's seed")
    parser.add_argument("--check", action="store_true",
                        help="also check the first sequence's replay against the dense-mask "
                             "reference (builds that one [L, V] mask)")
    args = parser.parse_args()
    if args.max_new_tokens is None:
        args.max_new_tokens = 8 if use_interpreter() else 32
    if min(args.prompts, args.steps, args.max_new_tokens, args.top_k, args.width) < 1 \
            or args.samples < 2:
        parser.error("--prompts, --steps, --max-new-tokens, --top-k and --width must be "
                     "positive, --samples at least 2")
    # SIGTERM ends the run through the finally below, which stops the server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        process, url = start_server(args)
    except TrainerFailed as exc:
        print(f"trainer failed: {exc}", file=sys.stderr)
        return 1
    try:
        report = train(url, args)
    except TrainerFailed as exc:
        print(f"trainer failed: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_server(process)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
