//! Writes a GGUF whose tensors hold exactly the values the CUDA backend computes with when it
//! loads the input file: every matrix dequantised and rounded to bf16 (as
//! worker/src/cuda/weights.rs does at load), every vector rounded to bf16 and stored as F32
//! (the GPU keeps norm weights in bf16; llama.cpp's CPU norms want F32, which holds those
//! values exactly). Metadata is copied, but for `general.file_type`.
//!
//! Why: the GPU's agreement check against llama.cpp (worker/tests/cuda_model.rs) then compares
//! the same weights on both sides, so what it measures is the arithmetic of the forward pass,
//! not the difference between a Q4_1 model with 8-bit activations (llama.cpp's CPU path) and
//! its bf16 dequantisation. The fixture made from this file is
//! tests/fixtures/generation/smollm2_bf16_greedy.jsonl.
//!
//! `cargo run --release -p tessera-model --example gguf_bf16 -- IN.gguf OUT.gguf`

use std::path::Path;

use half::bf16;
use tessera_kernels::GgmlType;
use tessera_model::gguf::{GgufFile, GgufWriter, MetaValue};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, input, output] = args.as_slice() else {
        return Err("usage: gguf_bf16 IN.gguf OUT.gguf".into());
    };
    let file = GgufFile::open(Path::new(input))?;
    let mut w = GgufWriter::new();
    for (key, value) in file.metadata() {
        if key != "general.file_type" {
            w.add_meta(key.clone(), value.clone());
        }
    }
    // llama.cpp's LLAMA_FTYPE_MOSTLY_BF16 (informational: it names the file's type).
    w.add_meta("general.file_type", MetaValue::U32(32));
    for t in file.tensors() {
        let n = usize::try_from(t.n_elements())?;
        let mut values = vec![0f32; n];
        tessera_kernels::quant::dequantize_row(t.ty, file.tensor_data(t), &mut values)?;
        let rounded = values.iter().map(|&v| bf16::from_f32(v));
        if t.dims.len() == 1 {
            let bytes: Vec<u8> = rounded.flat_map(|v| v.to_f32().to_le_bytes()).collect();
            w.add_tensor(t.name.clone(), GgmlType::F32, &t.dims, bytes);
        } else {
            let bytes: Vec<u8> = rounded.flat_map(|v| v.to_bits().to_le_bytes()).collect();
            w.add_tensor(t.name.clone(), GgmlType::BF16, &t.dims, bytes);
        }
        eprintln!(
            "{} {:?} {} -> {}",
            t.name,
            t.dims,
            t.ty,
            if t.dims.len() == 1 { "F32 (bf16 values)" } else { "BF16" }
        );
    }
    w.write_file(Path::new(output))?;
    Ok(())
}
