//! GgufWriter -> GgufFile round trips on random metadata and tensors: every value, type,
//! shape and byte must come back, from an owned buffer and from a memory-mapped file,
//! and the writer must refuse what the reader would refuse.

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use tessera_kernels::GgmlType;
use tessera_model::gguf::{GgufError, GgufFile, GgufWriter, MetaValue};

const TYPES: [GgmlType; 9] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

fn below(rng: &mut ChaCha8Rng, n: u32) -> u32 {
    rng.next_u32() % n
}

fn random_string(rng: &mut ChaCha8Rng) -> String {
    const PIECES: [&str; 8] = ["a", "Ġ", "✓", "<|im_end|>", "\n", "\u{0}", "日本", "🙂"];
    (0..below(rng, 12)).map(|_| PIECES[below(rng, 8) as usize]).collect()
}

fn random_f32(rng: &mut ChaCha8Rng) -> f32 {
    loop {
        let v = f32::from_bits(rng.next_u32());
        if !v.is_nan() {
            return v;
        }
    }
}

/// A random scalar of type `kind` (0..=12 except 9, the array id).
fn random_scalar(rng: &mut ChaCha8Rng, kind: u32) -> MetaValue {
    let x = rng.next_u64();
    match kind {
        0 => MetaValue::U8(x as u8),
        1 => MetaValue::I8(x as i8),
        2 => MetaValue::U16(x as u16),
        3 => MetaValue::I16(x as i16),
        4 => MetaValue::U32(x as u32),
        5 => MetaValue::I32(x as i32),
        6 => MetaValue::F32(random_f32(rng)),
        7 => MetaValue::Bool(x & 1 == 1),
        8 => MetaValue::String(random_string(rng)),
        10 => MetaValue::U64(x),
        11 => MetaValue::I64(x as i64),
        _ => loop {
            let v = f64::from_bits(rng.next_u64());
            if !v.is_nan() {
                break MetaValue::F64(v);
            }
        },
    }
}

fn random_value(rng: &mut ChaCha8Rng, depth: usize) -> MetaValue {
    let kind = below(rng, 13);
    if kind != 9 {
        return random_scalar(rng, kind);
    }
    let n = below(rng, 20) as usize;
    if depth < 2 && below(rng, 4) == 0 {
        return MetaValue::Array(
            (0..n.min(4)).map(|_| random_value(rng, depth + 1)).map(|v| MetaValue::Array(vec![v])).collect(),
        );
    }
    let elem = loop {
        let k = below(rng, 13);
        if k != 9 {
            break k;
        }
    };
    MetaValue::Array((0..n).map(|_| random_scalar(rng, elem)).collect())
}

struct Tensor {
    name: String,
    ty: GgmlType,
    dims: Vec<u64>,
    data: Vec<u8>,
}

fn random_tensor(rng: &mut ChaCha8Rng, i: usize) -> Tensor {
    let ty = TYPES[below(rng, TYPES.len() as u32) as usize];
    let n_dims = 1 + below(rng, 4) as usize;
    let mut dims = vec![ty.block_elems() as u64 * u64::from(1 + below(rng, 3))];
    dims.extend((1..n_dims).map(|_| u64::from(1 + below(rng, 3))));
    let n: u64 = dims.iter().product();
    let mut data = vec![0u8; ty.bytes_for(n as usize).unwrap()];
    rng.fill_bytes(&mut data);
    Tensor { name: format!("blk.{i}.t{}", random_string(rng)), ty, dims, data }
}

#[test]
fn random_files_round_trip() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for case in 0..60 {
        let mut w = GgufWriter::new();
        let version = if case % 3 == 0 { 2 } else { 3 };
        w.set_version(version);
        let alignment = [None, Some(1u32), Some(8), Some(64), Some(4096)][case % 5];
        let mut meta = std::collections::BTreeMap::new();
        if let Some(a) = alignment {
            meta.insert("general.alignment".to_string(), MetaValue::U32(a));
        }
        for k in 0..below(&mut rng, 40) {
            meta.insert(format!("k{k}.{}", random_string(&mut rng)), random_value(&mut rng, 0));
        }
        for (k, v) in &meta {
            w.add_meta(k.clone(), v.clone());
        }
        let tensors: Vec<Tensor> = (0..below(&mut rng, 8) as usize).map(|i| random_tensor(&mut rng, i)).collect();
        for t in &tensors {
            w.add_tensor(t.name.clone(), t.ty, &t.dims, t.data.clone());
        }
        let bytes = w.to_bytes().unwrap();

        let g = GgufFile::from_bytes(bytes.clone()).unwrap();
        assert_eq!(g.version(), version);
        assert_eq!(g.metadata(), &meta, "case {case}");
        let align = u64::from(alignment.unwrap_or(32));
        assert_eq!(g.alignment(), align);
        assert_eq!(g.tensors().len(), tensors.len());
        for (got, want) in g.tensors().iter().zip(&tensors) {
            assert_eq!((&got.name, got.ty, &got.dims), (&want.name, want.ty, &want.dims));
            assert_eq!(got.n_bytes, want.data.len());
            assert_eq!((got.offset - g.data_offset()) % align, 0);
            assert_eq!(g.tensor_data(got), &want.data[..], "case {case} {}", want.name);
            assert_eq!(g.tensor(&want.name), Some(got));
        }

        if case % 10 == 0 {
            let path = std::env::temp_dir().join(format!("tessera-roundtrip-{}-{case}.gguf", std::process::id()));
            w.write_file(&path).unwrap();
            let mapped = GgufFile::open(&path).unwrap();
            assert_eq!(mapped.metadata(), g.metadata());
            for (a, b) in mapped.tensors().iter().zip(g.tensors()) {
                assert_eq!(mapped.tensor_data(a), g.tensor_data(b));
            }
            std::fs::remove_file(&path).unwrap();
        }
    }
}

#[test]
fn f32_helper_and_empty_array() {
    let vals = [1.5f32, -2.25, 3.0e-7, 1.0e30];
    let mut w = GgufWriter::new();
    w.add_meta("empty", MetaValue::Array(vec![])).add_f32_tensor("v", &[4], &vals);
    let g = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert_eq!(g.get("empty"), Some(&MetaValue::Array(vec![])));
    let t = g.tensor("v").unwrap();
    let back: Vec<f32> = g.tensor_data(t).chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(back, vals);
}

#[test]
fn writer_refuses_what_the_reader_would() {
    let write = |f: &dyn Fn(&mut GgufWriter)| {
        let mut w = GgufWriter::new();
        f(&mut w);
        match w.to_bytes() {
            Err(GgufError::Write(msg)) => msg,
            other => panic!("expected a write error, got {other:?}"),
        }
    };
    assert!(write(&|w| {
        w.add_tensor("x", GgmlType::Q8_0, &[32], vec![0; 33]);
    })
    .contains("33 bytes"));
    assert!(write(&|w| {
        w.add_tensor("x", GgmlType::Q8_0, &[16], vec![0; 17]);
    })
    .contains("x"));
    assert!(write(&|w| {
        w.add_f32_tensor("x", &[1], &[1.0]).add_f32_tensor("x", &[1], &[2.0]);
    })
    .contains("twice"));
    assert!(write(&|w| {
        w.add_meta("a", MetaValue::Array(vec![MetaValue::U8(1), MetaValue::I8(1)]));
    })
    .contains("one type"));
    assert!(write(&|w| {
        w.add_meta("general.alignment", MetaValue::U32(48));
    })
    .contains("power of two"));
    assert!(write(&|w| {
        w.add_meta("a", MetaValue::U8(1)).add_meta("a", MetaValue::U8(2));
    })
    .contains("twice"));
    assert!(write(&|w| {
        w.set_version(1);
    })
    .contains("version 1"));
    assert!(write(&|w| {
        w.add_tensor("x", GgmlType::F32, &[1, 1, 1, 1, 1], vec![0; 4]);
    })
    .contains("dims"));
}
