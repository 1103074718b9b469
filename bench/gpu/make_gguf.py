#!/usr/bin/env python3
"""Writes a random-weight GGUF of a Llama-3-8B shape that both Tessera and llama.cpp load, for
side-by-side runs on the device (bench/gpu/llama_cpp.sh).

    python3 make_gguf.py TOKENIZER.gguf OUT.gguf

Shape: hidden 4096, 32 layers, FFN 14336, 32 query / 8 KV heads of 128, RoPE theta 500000, untied
output, every 2-D weight bf16 (what ANCHORS.md's llama.cpp numbers used). The vocabulary and
tokenizer are copied from TOKENIZER.gguf (the default model, SmolLM2: 49,152 tokens), so the file
is small enough to write in seconds. Weights are N(0, 0.02) drawn on the GPU with torch (norms 1),
so logits stay finite; the values don't matter for speed. Needs gguf-py (llama.cpp's, on
PYTHONPATH), numpy and torch.
"""
import sys

import os

import gguf
import numpy as np

# TESSERA_GGUF_TINY=1: a 2-layer, 256-wide model drawn with numpy (checks the file loads, here).
TINY = os.environ.get("TESSERA_GGUF_TINY") == "1"
HIDDEN, LAYERS, FFN, HEADS, KV_HEADS, HEAD_DIM = (256, 2, 512, 4, 2, 64) if TINY else (4096, 32, 14336, 32, 8, 128)


def copy_tokenizer(reader: gguf.GGUFReader, w: gguf.GGUFWriter) -> int:
    vocab = 0
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        main = field.types[0]
        value = field.contents()
        if main == gguf.GGUFValueType.ARRAY:
            w.add_key_value(field.name, value, main, sub_type=field.types[-1])
            if field.name == "tokenizer.ggml.tokens":
                vocab = len(value)
        else:
            w.add_key_value(field.name, value, main)
    if vocab == 0:
        sys.exit("the tokenizer file has no tokenizer.ggml.tokens")
    return vocab


def bf16(rows: int, cols: int, gen) -> np.ndarray:
    if TINY:
        f = gen.normal(0.0, 0.02, size=(rows, cols)).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16)  # truncation: fine for random weights
    import torch

    t = torch.empty(rows, cols, dtype=torch.bfloat16, device="cuda").normal_(0.0, 0.02, generator=gen)
    return t.view(torch.int16).cpu().numpy().view(np.uint16)


def main() -> None:
    src, out = sys.argv[1], sys.argv[2]
    w = gguf.GGUFWriter(out, "llama")
    vocab = copy_tokenizer(gguf.GGUFReader(src), w)
    w.add_name("llama-3-8b-shape-random" if not TINY else "tiny-llama-random")
    w.add_context_length(8192)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    if TINY:
        gen = np.random.default_rng(7)
    else:
        import torch

        gen = torch.Generator(device="cuda").manual_seed(7)
    bt = gguf.GGMLQuantizationType.BF16
    ones = np.ones(HIDDEN, dtype=np.float32)
    w.add_tensor("token_embd.weight", bf16(vocab, HIDDEN, gen), raw_dtype=bt)
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones)
        w.add_tensor(p + "attn_q.weight", bf16(HEADS * HEAD_DIM, HIDDEN, gen), raw_dtype=bt)
        w.add_tensor(p + "attn_k.weight", bf16(KV_HEADS * HEAD_DIM, HIDDEN, gen), raw_dtype=bt)
        w.add_tensor(p + "attn_v.weight", bf16(KV_HEADS * HEAD_DIM, HIDDEN, gen), raw_dtype=bt)
        w.add_tensor(p + "attn_output.weight", bf16(HIDDEN, HEADS * HEAD_DIM, gen), raw_dtype=bt)
        w.add_tensor(p + "ffn_norm.weight", ones)
        w.add_tensor(p + "ffn_gate.weight", bf16(FFN, HIDDEN, gen), raw_dtype=bt)
        w.add_tensor(p + "ffn_up.weight", bf16(FFN, HIDDEN, gen), raw_dtype=bt)
        w.add_tensor(p + "ffn_down.weight", bf16(HIDDEN, FFN, gen), raw_dtype=bt)
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", bf16(vocab, HIDDEN, gen), raw_dtype=bt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {out}: hidden {HIDDEN}, {LAYERS} layers, FFN {FFN}, heads {HEADS}/{KV_HEADS}, vocab {vocab}, bf16")


if __name__ == "__main__":
    main()
