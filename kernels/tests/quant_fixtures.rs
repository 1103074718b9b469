//! Dequantisation against the `gguf` Python package: `fixtures/gen_quant.py` quantised
//! random rows (or, for the K types, made random blocks) and dequantised them with
//! gguf-py; our `dequantize_row` must produce the same f32 values from the same bytes,
//! bit for bit (gguf-py does the same f32 operations in the same order).
//! `real_*` fixtures are rows of the default SmolLM2 model file.

use std::path::PathBuf;

use tessera_kernels::quant::{dequantize_row, GgmlType};

struct Fixture {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    blocks: Vec<u8>,
    expected: Vec<f32>,
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

fn load(name: &str) -> Fixture {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant").join(format!("{name}.bin"));
    let b =
        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e} (run tests/fixtures/gen_quant.py)", path.display()));
    assert_eq!(&b[..4], b"TQF1", "{name}: bad magic");
    let ty = GgmlType::from_id(u32_at(&b, 4)).expect("known type id");
    let (rows, cols) = (u32_at(&b, 8) as usize, u32_at(&b, 12) as usize);
    let nbytes = rows * ty.bytes_for(cols).expect("whole blocks");
    let blocks = b[16..16 + nbytes].to_vec();
    let expected: Vec<f32> =
        b[16 + nbytes..].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    assert_eq!(expected.len(), rows * cols, "{name}: truncated");
    Fixture { ty, rows, cols, blocks, expected }
}

fn check(name: &str, ty: GgmlType) {
    let f = load(name);
    assert_eq!(f.ty, ty, "{name}: fixture holds another type");
    let row_bytes = f.blocks.len() / f.rows;
    let mut nonzero = 0;
    for r in 0..f.rows {
        let mut out = vec![f32::NAN; f.cols];
        dequantize_row(f.ty, &f.blocks[r * row_bytes..(r + 1) * row_bytes], &mut out).unwrap();
        for (c, (&got, &want)) in out.iter().zip(&f.expected[r * f.cols..(r + 1) * f.cols]).enumerate() {
            assert!(
                got == want || (got.is_nan() && want.is_nan()),
                "{name} row {r} col {c}: got {got:e}, gguf-py {want:e}"
            );
            nonzero += usize::from(want != 0.0);
        }
    }
    // The fixture must exercise real values, not a block of zeros.
    assert!(nonzero > f.rows * f.cols / 2, "{name}: too few non-zero values");
}

#[test]
fn f32_matches_gguf_py() {
    check("f32", GgmlType::F32);
}

#[test]
fn f16_matches_gguf_py() {
    check("f16", GgmlType::F16);
}

#[test]
fn bf16_matches_gguf_py() {
    check("bf16", GgmlType::BF16);
}

#[test]
fn q4_0_matches_gguf_py() {
    check("q4_0", GgmlType::Q4_0);
}

#[test]
fn q4_1_matches_gguf_py() {
    check("q4_1", GgmlType::Q4_1);
}

#[test]
fn q8_0_matches_gguf_py() {
    check("q8_0", GgmlType::Q8_0);
}

#[test]
fn q4_k_matches_gguf_py() {
    check("q4_k", GgmlType::Q4K);
}

#[test]
fn q5_k_matches_gguf_py() {
    check("q5_k", GgmlType::Q5K);
}

#[test]
fn q6_k_matches_gguf_py() {
    check("q6_k", GgmlType::Q6K);
}

#[test]
fn real_model_rows_match_gguf_py() {
    check("real_q4_1", GgmlType::Q4_1);
    check("real_q8_0", GgmlType::Q8_0);
}

#[test]
fn bad_lengths_are_errors() {
    let f = load("q4_1");
    let mut out = vec![0.0f32; 64];
    // 64 Q4_1 values need 40 bytes.
    assert!(dequantize_row(GgmlType::Q4_1, &f.blocks[..39], &mut out).is_err());
    assert!(dequantize_row(GgmlType::Q4_1, &f.blocks[..41], &mut out).is_err());
    let mut odd = vec![0.0f32; 48]; // not a whole number of 32-blocks
    assert!(dequantize_row(GgmlType::Q4_1, &f.blocks[..40], &mut odd).is_err());
    assert!(dequantize_row(GgmlType::Q4_1, &f.blocks[..40], &mut out).is_ok());
}
