"""PyTorch (cuBLAS) bf16 `x @ W.T` at the Llama-3.1-8B layer shapes that
kernels/tests/cuda_ops.rs::bench_gemm_llama8b times, as the peer for Tessera's cuBLASLt
path: same shapes, random data, several weight copies (> L2), CUDA-event timing, median."""
import torch

torch.manual_seed(0)
shapes = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
for name, rows, cols in shapes:
    copies = max(1, min(8, -(-300_000_000 // (rows * cols * 2))))
    ws = [torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    for m in (1, 16, 512):
        x = torch.randn(m, cols, device="cuda", dtype=torch.bfloat16)
        reps = 20 if m == 512 else 100
        for i in range(3):
            x @ ws[i % copies].T
        times = []
        for _ in range(7):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for i in range(reps):
                x @ ws[i % copies].T
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / reps)
        ms = sorted(times)[len(times) // 2]
        flops = 2 * m * rows * cols
        nbytes = (rows * cols + m * cols + m * rows) * 2
        print(f"TORCH | gemm {name} | M={m} N={rows} K={cols} | {ms*1e3:.1f} us | {flops/ms/1e9:.1f} TFLOP/s | {nbytes/ms/1e6:.0f} GB/s")
