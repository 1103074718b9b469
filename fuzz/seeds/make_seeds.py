#!/usr/bin/env python3
"""Writes seeds/gguf_parse/model.gguf: a tiny llama-shaped GGUF (all the config keys, a
few tensors) so fuzzing reaches the config and weight readers. Run from fuzz/ with the
`gguf` Python package installed. (seeds/gguf_parse/tiny.gguf is a copy of
model/tests/fixtures/tiny.gguf; seeds/safetensors_parse/small.safetensors is written
below too.)"""
import json, struct

import numpy as np
import gguf

rng = np.random.default_rng(1)
w = gguf.GGUFWriter("seeds/gguf_parse/model.gguf", arch="llama")
w.add_block_count(1)
w.add_context_length(64)
w.add_embedding_length(32)
w.add_feed_forward_length(64)
w.add_head_count(4)
w.add_head_count_kv(2)
w.add_layer_norm_rms_eps(1e-5)
w.add_rope_freq_base(10000.0)
w.add_vocab_size(8)
w.add_token_list([f"t{i}" for i in range(8)])
w.add_tensor("token_embd.weight", rng.integers(0, 256, (8, 34), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
w.add_tensor("output_norm.weight", rng.standard_normal(32).astype(np.float32))
w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((32, 32)).astype(np.float16))
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()

hdr = {"__metadata__": {"format": "pt"},
       "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
       "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]},
       "c": {"dtype": "I64", "shape": [1], "data_offsets": [32, 40]}}
h = json.dumps(hdr, separators=(",", ":")).encode()
h += b" " * (-len(h) % 8)
with open("seeds/safetensors_parse/small.safetensors", "wb") as f:
    f.write(struct.pack("<Q", len(h)) + h + bytes(range(40)))
