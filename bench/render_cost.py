"""What one request's output costs the Python that turns it into a response: per generated token, and per
logprob entry (the sampled token's, and each ``top_logprobs`` alternative).

No server and no model run here: the embedded model's tokenizer and the service's own code paths do the
work a front end does for each token of a choice (``TextStream`` detokenizes it, ``TokenTexts`` turns its
logprobs into text and bytes, the format encodes it: OpenAI chat and completions, streamed and not, and
the native JSON lines), on synthetic token ids and logprobs (ids drawn from the vocabulary, the token
texts cache warm as on a running server). For each format it reports microseconds per token without
logprobs, microseconds per logprob entry (the rest of the time with ``--top-logprobs`` alternatives,
divided by the entries: k + 1 per token), the bytes of answer per entry, and the longest single call (a
non-streamed answer is encoded at its end in one go: that call holds the event loop).

These figures size ``MAX_REQUEST_WORK`` (README, Configuration; docs/reliability.md, "Hostile input, by
class"). Run it alone on the machine:

    .venv/bin/python bench/render_cost.py --tokens 2048 --top-logprobs 20
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time

from llm_api.engine.request import FinishReason, TokenLogprob
from llm_api.model.settings import Settings
from llm_api.protocols.common.openai_call import OpenAICall
from llm_api.protocols.native.encoder import NativeStream
from llm_api.text.detokenizer import TextStream
from llm_api.text.logprobs import TokenTexts


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of one choice")
    parser.add_argument("--top-logprobs", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="the fastest round is reported")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    return parser.parse_args()


def encoders(kind: str):
    """A fresh encoder per run: (delta(text, items), choice_finish(), finish() -> the final payload)."""
    if kind.startswith("native"):
        stream = NativeStream("<|endoftext|>", streaming=kind.endswith("stream"), json_lines=True, with_logprobs=True)
        return (lambda text, items: stream.delta(text, 0, items),
                lambda: stream.choice_finish(0, FinishReason.LENGTH, 1), lambda: stream.finish(FinishReason.LENGTH, 1, 1))
    api, mode = kind.split("-")
    call = OpenAICall(kind=api, model="m", stream=mode == "stream", include_usage=False, with_logprobs=True)
    return (lambda text, items: call.delta(text, 0, items), lambda: call.choice_finish(0, FinishReason.LENGTH),
            lambda: call.finish(FinishReason.LENGTH, 1, 1))


def run(tokenizer, texts: TokenTexts, ids: list[int], logprobs: list[TokenLogprob] | None, kind: str) -> dict:
    delta, choice_finish, finish = encoders(kind)
    stream = TextStream(tokenizer, (), "<|endoftext|>")
    size, longest = 0, 0.0
    started = time.perf_counter()
    for i, token_id in enumerate(ids):
        t0 = time.perf_counter()
        text = stream.push([token_id]).text
        items = (texts.item(logprobs[i]),) if logprobs is not None else ()
        size += len(delta(text, items) if (text or items) else "")
        longest = max(longest, time.perf_counter() - t0)
    t0 = time.perf_counter()
    size += len(choice_finish()) + len(finish())
    longest = max(longest, time.perf_counter() - t0)
    return {"seconds": time.perf_counter() - started, "bytes": size, "longest_call_s": longest}


def main() -> None:
    args = parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Settings.from_env().model_path)
    texts = TokenTexts(tokenizer)
    rng = random.Random(0)
    sample = "The quick brown fox jumps over the lazy dog; naïve café, 東京, 🙂. " * 400
    ids = tokenizer(sample, add_special_tokens=False)["input_ids"][: args.tokens]
    vocab = len(tokenizer)
    k = args.top_logprobs
    with_lp = [TokenLogprob(t, -rng.random(), tuple((rng.randrange(vocab), -rng.random() * 10) for _ in range(k)))
               for t in ids]
    for lp in with_lp:  # a running server's token texts cache is warm
        texts.item(lp)
    kinds = ["chat-stream", "chat-whole", "completions-stream", "completions-whole", "native-stream", "native-whole"]
    results = {}
    for kind in kinds:
        plain = min((run(tokenizer, texts, ids, None, kind) for _ in range(args.rounds)), key=lambda r: r["seconds"])
        rich = min((run(tokenizer, texts, ids, with_lp, kind) for _ in range(args.rounds)), key=lambda r: r["seconds"])
        entries = len(ids) * (k + 1)
        results[kind] = {
            "us_per_token_without_logprobs": round(plain["seconds"] / len(ids) * 1e6, 2),
            "us_per_logprob_entry": round((rich["seconds"] - plain["seconds"]) / entries * 1e6, 3),
            "bytes_per_logprob_entry": round((rich["bytes"] - plain["bytes"]) / entries, 1),
            "answer_mb_with_logprobs": round(rich["bytes"] / 1e6, 2),
            "longest_call_ms_with_logprobs": round(rich["longest_call_s"] * 1e3, 1),
        }
        print(f"{kind:20s} {json.dumps(results[kind])}")
    summary = {"tokens": len(ids), "top_logprobs": k, "machine": platform.processor() or platform.machine(),
               "python": platform.python_version(), "formats": results}
    if args.out:
        with open(args.out, "w") as out:
            json.dump(summary, out, indent=1)


if __name__ == "__main__":
    main()
