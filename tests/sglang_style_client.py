"""An RL rollout client written for SGLang's HTTP /generate, as such clients
post to it: one request per prompt with `text`, `sampling_params`,
`return_sampling_mask` and `stream`, reading `output_ids` and the sampling
masks from `meta_info`. Nothing in it knows about shmask or the example
server; tests/test_server.py runs it unchanged against examples/server.py.

    python tests/sglang_style_client.py URL --max-new-tokens 32 [--stream]
        [--sampling-logprobs-mode support] PROMPT...

Prints one JSON object per prompt: the prompt, the generated token ids,
each token's sampling support and behaviour logprob(s), the finish reason.
"""

from __future__ import annotations

import argparse
import json
import sys

import httpx


def generate(client: httpx.Client, url: str, prompt: str, max_new_tokens: int,
             stream: bool, logprobs_mode: str | None) -> dict:
    payload = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0, "top_p": 0.95},
        "return_sampling_mask": True,
        "stream": stream,
    }
    if logprobs_mode is not None:
        payload["sampling_logprobs_mode"] = logprobs_mode
    if not stream:
        reply = client.post(url + "/generate", json=payload)
        reply.raise_for_status()
        return reply.json()
    # Streaming: SSE "data: {...}" chunks, each cumulative, then "data: [DONE]".
    last = None
    with client.stream("POST", url + "/generate", json=payload) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"generation failed: {chunk['error']}")
            last = chunk
    if last is None:
        raise RuntimeError("the stream ended without a result")
    return last


def rollout(result: dict, prompt: str) -> dict:
    meta = result["meta_info"]
    token_ids = result["output_ids"]
    masks = meta["output_token_sampling_mask"]
    logprobs = meta["output_token_sampling_logprobs"]
    if not len(token_ids) == len(masks) == len(logprobs) == meta["output_token_sampling_mask_length"]:
        raise RuntimeError(f"{len(token_ids)} tokens, {len(masks)} masks, {len(logprobs)} logprobs")
    return {"prompt": prompt, "text": result["text"], "token_ids": token_ids, "masks": masks,
            "logprobs": logprobs, "finish_reason": meta["finish_reason"],
            "completion_tokens": meta["completion_tokens"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("url")
    parser.add_argument("prompts", nargs="+")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--sampling-logprobs-mode", choices=["selected", "support"])
    args = parser.parse_args()
    with httpx.Client(timeout=60) as client:
        for prompt in args.prompts:
            result = generate(client, args.url, prompt, args.max_new_tokens, args.stream,
                              args.sampling_logprobs_mode)
            sys.stdout.write(json.dumps(rollout(result, prompt)) + "\n")


if __name__ == "__main__":
    main()
