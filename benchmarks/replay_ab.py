"""The replay's kernels against another commit's, alternated in one process
(issue 38): forward and forward + backward of replay_logprobs at N = 16,384,
V = 151,936, bf16, for 1, 1,000 and 4,096-id rows and 40% / 5% bitmask rows,
beside the floors (one read, one gradient write, torch's gather of the
support); every pair's gradients checked bit-identical. CUDA only.

    git show REV:kernels/replay.py > kernels/replay_old.py
    python3 benchmarks/replay_ab.py     # then: rm kernels/replay_old.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import replay as bench  # noqa: E402
from shmask.kernels import replay as new  # noqa: E402


def main() -> int:
    if not torch.cuda.is_available():
        print("replay_ab: needs CUDA", file=sys.stderr)
        return 2
    from shmask.kernels import replay_old as old  # (copied in: the docstring)

    n, vocab = 16384, 151936
    logits, gen = bench.bench_logits(n, vocab)

    def ms(call):
        return bench.timed(call, 7)[0]

    print(f"{torch.cuda.get_device_name()}: one read {ms(lambda: logits.amax(1)):.3f} ms, "
          f"gradient write {ms(lambda: torch.zeros_like(logits)):.3f} ms")
    sets = [("1000 ids", bench.rows_ids(n, vocab, 1000, gen)),
            ("1 id", bench.rows_ids(n, vocab, 1, gen)),
            ("4096 ids", bench.rows_ids(n, vocab, 4096, gen)),
            ("bitmask 40%", bench.rows_bitmask(n, vocab, 0.4, gen)),
            ("bitmask 5%", bench.rows_bitmask(n, vocab, 0.05, gen))]
    for label, (offsets, ids, forms, targets) in sets:
        line = [label]
        if int(forms[0]) == 0:
            index = ids.view(n, -1).long()
            line.append(f"gather {ms(lambda index=index: logits.gather(1, index)):.3f}")
        grads = {}
        for name, module in (("old", old), ("new", new), ("old", old), ("new", new)):
            def both(module=module, offsets=offsets, ids=ids, forms=forms, targets=targets):
                leaf = logits.detach().requires_grad_(True)
                module.replay_logprobs(leaf, targets, offsets, ids, forms=forms).sum().backward()
                return leaf.grad
            grads[name] = both()
            forward = ms(lambda module=module, offsets=offsets, ids=ids, forms=forms,
                         targets=targets: module.replay_logprobs(logits, targets, offsets, ids,
                                                                 forms=forms))
            line.append(f"{name} fwd {forward:.3f} fwd+bwd {ms(both):.3f}")
        same = torch.equal(grads["old"], grads["new"])
        print("  ".join(line) + f"  gradients bit-identical: {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
