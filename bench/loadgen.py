#!/usr/bin/env python3
"""Load generator for OpenAI-compatible servers (Tessera's gateway, llama.cpp's llama-server,
vLLM, ...): N concurrent sessions, each sending streaming requests back to back, for a
duration or a number of requests. Prints one markdown table row: request count, errors,
time to first token (TTFT) p50/p99, inter-token latency (ITL: the gaps between streamed
chunks after the first) p50/p99 and aggregate output tokens per second.

Examples:
  python3 bench/loadgen.py --url http://127.0.0.1:8000 --concurrency 8 --duration 20 --header
  python3 bench/loadgen.py --url http://127.0.0.1:8080 --label llama-server --requests 64 \\
      --prompt-tokens 256 --max-tokens 128 --ignore-eos

Each request gets its own random prompt (so no request reuses another's prefix cache) of
about --prompt-tokens tokens, sized with the server's /tokenize when it has one (Tessera's
and vLLM's take {"prompt"}, llama-server's {"content"}), else estimated. Output tokens are
the server's `usage.completion_tokens` when it streams usage, else the number of non-empty
chunks. `--ignore-eos` sends the `ignore_eos: true` extension (Tessera, vLLM, llama-server)
so every request produces exactly --max-tokens tokens.

`--constrained K` makes K of the sessions send a `json_schema` response_format (structured
outputs, see BENCH_SCHEMA: a list of records long enough that --max-tokens ends it) to
measure what constrained decoding costs the whole batch: compare the tok/s of the same run
with `--constrained 0`.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from dataclasses import dataclass, field

import requests

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river mountain signal garden harbor lantern copper "
         "meadow thunder candle valley feather compass engine silver forest window ladder canyon violet").split()


# What the constrained sessions' outputs must follow: records with bounded fields, up to 64
# of them, so the grammar stays open for the whole --max-tokens budget.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array", "maxItems": 64,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "role": {"enum": ["admin", "user", "guest"]},
                    "score": {"type": "number", "minimum": 0, "maximum": 1},
                },
                "required": ["name", "age", "role"], "additionalProperties": False,
            },
        },
    },
    "required": ["records"], "additionalProperties": False,
}


@dataclass
class Result:
    ok: bool
    status: int = 0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks; NaN for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class Client:
    def __init__(self, args):
        self.args = args
        self.base = args.url.rstrip("/")
        self.headers = {"Content-Type": "application/json"}
        if args.api_key:
            self.headers["Authorization"] = f"Bearer {args.api_key}"
        self.model = args.model or self._first_model()
        self.words_per_token = self._calibrate()

    def _first_model(self) -> str:
        r = requests.get(f"{self.base}/v1/models", headers=self.headers, timeout=30)
        r.raise_for_status()
        return r.json()["data"][0]["id"]

    def count_tokens(self, text: str) -> int | None:
        for body in ({"prompt": text, "model": self.model}, {"content": text}):
            try:
                r = requests.post(f"{self.base}/tokenize", json=body, headers=self.headers, timeout=30)
            except requests.RequestException:
                return None
            if r.status_code == 200:
                tokens = r.json().get("tokens")
                if isinstance(tokens, list):
                    return len(tokens)
        return None

    def _calibrate(self) -> float:
        sample = " ".join(random.Random(0).choice(WORDS) for _ in range(400))
        n = self.count_tokens(sample)
        return 400 / n if n else 0.75

    def prompt(self, rng: random.Random) -> str:
        words = max(1, round(self.args.prompt_tokens * self.words_per_token))
        return " ".join(rng.choice(WORDS) for _ in range(words))

    def body(self, prompt: str, constrained: bool = False) -> dict:
        a = self.args
        body = {"model": self.model, "max_tokens": a.max_tokens, "temperature": a.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        if constrained:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "records", "schema": BENCH_SCHEMA, "strict": True}}
        if a.ignore_eos:
            body["ignore_eos"] = True
        if a.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body

    def run_one(self, prompt: str, constrained: bool = False) -> Result:
        path = "/v1/chat/completions" if self.args.endpoint == "chat" else "/v1/completions"
        start = time.perf_counter()
        res = Result(ok=False)
        chunks, usage_tokens, last = 0, None, None
        try:
            with requests.post(self.base + path, json=self.body(prompt, constrained), headers=self.headers, stream=True,
                               timeout=(10, self.args.timeout)) as r:
                res.status = r.status_code
                if r.status_code != 200:
                    res.error = r.text[:200]
                    return res
                for line in r.iter_lines():
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        res.error = str(event["error"])[:200]
                        return res
                    if event.get("usage"):
                        usage_tokens = event["usage"].get("completion_tokens")
                    if not any(_text(c) for c in event.get("choices") or []):
                        continue
                    now = time.perf_counter()
                    chunks += 1
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        res.gaps.append(now - last)
                    last = now
        except (requests.RequestException, ValueError) as e:
            res.error = f"{type(e).__name__}: {e}"[:200]
            return res
        res.tokens = usage_tokens if usage_tokens is not None else chunks
        res.ok = res.ttft is not None
        return res


def _text(choice: dict) -> str:
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (without /v1)")
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent sessions")
    p.add_argument("--duration", type=float, help="seconds to keep starting requests (default 20 unless --requests)")
    p.add_argument("--requests", type=int, help="total requests to send")
    p.add_argument("--prompt-tokens", type=int, default=128, help="approximate prompt length in tokens")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="send the ignore_eos extension")
    p.add_argument("--constrained", type=int, default=0,
                   help="how many of the sessions send a json_schema response_format (structured outputs)")
    p.add_argument("--timeout", type=float, default=600, help="per-request read timeout, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", help="first column of the row (default: the URL)")
    p.add_argument("--header", action="store_true", help="print the table header first")
    p.add_argument("--json", action="store_true", help="also print the numbers as one JSON line on stderr")
    args = p.parse_args(argv)
    if args.duration is None and args.requests is None:
        args.duration = 20.0
    if args.concurrency < 1 or (args.requests is not None and args.requests < 1):
        p.error("--concurrency and --requests must be at least 1")
    if not 0 <= args.constrained <= args.concurrency:
        p.error("--constrained must be between 0 and --concurrency")

    client = Client(args)
    results: list[Result] = []
    lock = threading.Lock()
    issued = [0]
    t_start = time.perf_counter()
    deadline = t_start + args.duration if args.duration is not None else None

    def take_ticket() -> int | None:
        with lock:
            if args.requests is not None and issued[0] >= args.requests:
                return None
            if deadline is not None and time.perf_counter() >= deadline:
                return None
            issued[0] += 1
            return issued[0]

    def session(index: int):
        while (ticket := take_ticket()) is not None:
            prompt = client.prompt(random.Random(args.seed * 1_000_003 + ticket))
            r = client.run_one(prompt, constrained=index < args.constrained)
            with lock:
                results.append(r)

    threads = [threading.Thread(target=session, args=(i,), daemon=True) for i in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t_start

    ok = [r for r in results if r.ok]
    errors = len(results) - len(ok)
    ttfts = [r.ttft * 1e3 for r in ok]
    gaps = [g * 1e3 for r in ok for g in r.gaps]
    out_tokens = sum(r.tokens for r in ok)
    tok_s = out_tokens / wall if wall > 0 else 0.0
    row = {
        "label": args.label or args.url, "concurrency": args.concurrency, "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens, "constrained": args.constrained, "requests": len(ok), "errors": errors,
        "ttft_p50_ms": percentile(ttfts, 0.5), "ttft_p99_ms": percentile(ttfts, 0.99),
        "itl_p50_ms": percentile(gaps, 0.5), "itl_p99_ms": percentile(gaps, 0.99),
        "output_tok_s": tok_s, "wall_s": wall,
    }
    if args.header:
        print("| server | conc | prompt | max tok | requests | errors | TTFT p50 ms | TTFT p99 ms "
              "| ITL p50 ms | ITL p99 ms | out tok/s |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {row['label']} | {args.concurrency} | {args.prompt_tokens} | {args.max_tokens} | {len(ok)} | {errors} "
          f"| {row['ttft_p50_ms']:.1f} | {row['ttft_p99_ms']:.1f} | {row['itl_p50_ms']:.1f} | {row['itl_p99_ms']:.1f} "
          f"| {tok_s:.1f} |")
    if args.json:
        print(json.dumps(row), file=sys.stderr)
    if errors:
        first = next(r for r in results if not r.ok)
        print(f"loadgen: {errors} failed request(s); first: status {first.status} {first.error}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
