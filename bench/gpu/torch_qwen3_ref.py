"""Reference logits from PyTorch/transformers for a random-weight Qwen3 checkpoint.

Writes OUT/model (an HF directory: config.json + model.safetensors, bf16), OUT/tokens.json
(token ids) and OUT/logits.f32 ([tokens, vocab] little-endian f32: transformers' forward
in float32 over the bf16 weights), plus OUT/logits_bf16.f32 (the same forward run in bf16).
worker/tests/cuda_model.rs (random_qwen3_matches_pytorch) compares Tessera's CUDA backend
with them. Runs on the device machine (torch + transformers there); seconds.

    python3 bench/gpu/torch_qwen3_ref.py OUT
"""
import json
import os
import sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
torch.manual_seed(1234)
cfg = Qwen3Config(
    vocab_size=8192,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=4096,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
model = Qwen3ForCausalLM(cfg)
with torch.no_grad():
    for name, p in model.named_parameters():
        if "norm" in name:
            p.uniform_(0.8, 1.2)
        else:
            p.normal_(0.0, 0.02)
model = model.to(torch.bfloat16)
model.save_pretrained(os.path.join(out, "model"), safe_serialization=True)

g = torch.Generator().manual_seed(7)
tokens = torch.randint(0, cfg.vocab_size, (200,), generator=g)
with open(os.path.join(out, "tokens.json"), "w") as f:
    json.dump(tokens.tolist(), f)

dev = "cuda"
with torch.no_grad():
    ids = tokens.unsqueeze(0).to(dev)
    m32 = Qwen3ForCausalLM.from_pretrained(os.path.join(out, "model"), dtype=torch.float32).to(dev).eval()
    logits = m32(ids).logits[0].float().cpu().numpy()
    logits.astype("<f4").tofile(os.path.join(out, "logits.f32"))
    m16 = Qwen3ForCausalLM.from_pretrained(os.path.join(out, "model"), dtype=torch.bfloat16).to(dev).eval()
    l16 = m16(ids).logits[0].float().cpu().numpy()
    l16.astype("<f4").tofile(os.path.join(out, "logits_bf16.f32"))
num = ((l16 - logits) ** 2).sum(-1) ** 0.5
den = (logits ** 2).sum(-1) ** 0.5
print(f"TORCH qwen3 ref: {len(tokens)} tokens, vocab {cfg.vocab_size}; torch bf16 vs f32 worst row rel L2 {float((num / den).max()):.3e}")
