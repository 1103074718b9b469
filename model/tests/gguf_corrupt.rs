//! Malformed GGUF files: every one must come back as an error that names the problem,
//! never a panic, an out-of-bounds read or a huge allocation. Files are assembled by hand
//! here (not by GgufWriter) so each field can be made to lie on its own.

use std::time::Instant;

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use tessera_kernels::GgmlType;
use tessera_model::gguf::{GgufError, GgufFile, GgufWriter, MetaValue};

fn string(s: &str) -> Vec<u8> {
    let mut out = (s.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(s.as_bytes());
    out
}

/// One metadata entry: key, value type id, encoded value.
fn kv(key: &str, ty: u32, value: &[u8]) -> Vec<u8> {
    let mut out = string(key);
    out.extend_from_slice(&ty.to_le_bytes());
    out.extend_from_slice(value);
    out
}

/// One tensor info with a relative data offset.
fn info(name: &str, dims: &[u64], ty: u32, offset: u64) -> Vec<u8> {
    let mut out = string(name);
    out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
    for d in dims {
        out.extend_from_slice(&d.to_le_bytes());
    }
    out.extend_from_slice(&ty.to_le_bytes());
    out.extend_from_slice(&offset.to_le_bytes());
    out
}

/// A file assembled from parts; counts default to the number of parts.
struct Raw {
    magic: [u8; 4],
    version: u32,
    n_tensors: Option<u64>,
    n_kv: Option<u64>,
    kvs: Vec<Vec<u8>>,
    infos: Vec<Vec<u8>>,
    /// Padding before the data section.
    align: usize,
    data: Vec<u8>,
}

impl Raw {
    /// A valid file: one string key, an F32 vector `a` [8] at 0 and a Q8_0 matrix `b`
    /// [32, 2] at 32, with random data.
    fn valid() -> Raw {
        let mut data = vec![0u8; 32 + 68];
        ChaCha8Rng::seed_from_u64(1).fill_bytes(&mut data);
        Raw {
            magic: *b"GGUF",
            version: 3,
            n_tensors: None,
            n_kv: None,
            kvs: vec![kv("general.architecture", 8, &string("llama"))],
            infos: vec![info("a", &[8], 0, 0), info("b", &[32, 2], 8, 32)],
            align: 32,
            data,
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut out = self.magic.to_vec();
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&self.n_tensors.unwrap_or(self.infos.len() as u64).to_le_bytes());
        out.extend_from_slice(&self.n_kv.unwrap_or(self.kvs.len() as u64).to_le_bytes());
        self.kvs.iter().chain(&self.infos).for_each(|p| out.extend_from_slice(p));
        out.resize(out.len().next_multiple_of(self.align), 0);
        out.extend_from_slice(&self.data);
        out
    }

    fn parse(&self) -> Result<GgufFile, GgufError> {
        GgufFile::from_bytes(self.bytes())
    }

    /// Parses, expecting an error whose message contains every one of `needles`.
    fn fails_with(&self, needles: &[&str]) -> GgufError {
        let err = self.parse().expect_err("malformed file parsed");
        let msg = err.to_string();
        for n in needles {
            assert!(msg.contains(n), "error `{msg}` does not mention `{n}`");
        }
        err
    }
}

#[test]
fn baseline_is_valid() {
    let g = Raw::valid().parse().unwrap();
    assert_eq!(g.tensors().len(), 2);
    assert_eq!(g.tensor("b").unwrap().ty, GgmlType::Q8_0);
    assert_eq!(g.tensor_data(g.tensor("b").unwrap()).len(), 68);
}

#[test]
fn every_prefix_of_a_valid_file_fails_until_the_data_is_complete() {
    // Two files: the Python-written fixture and one from our writer (with metadata of
    // every kind), so prefixes cut through every kind of field.
    let fixture = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny.gguf")).unwrap();
    let mut w = GgufWriter::new();
    w.add_meta("s", MetaValue::String("hello".into()))
        .add_meta("arr", MetaValue::Array(vec![MetaValue::String("x".into()), MetaValue::String("yz".into())]))
        .add_meta("f", MetaValue::F64(0.5))
        .add_meta("b", MetaValue::Bool(true))
        .add_meta("n", MetaValue::Array(vec![MetaValue::Array(vec![MetaValue::I16(-3)])]))
        .add_f32_tensor("t0", &[5], &[1.0, 2.0, 3.0, 4.0, 5.0])
        .add_tensor("t1", GgmlType::Q4_1, &[32, 3], vec![0x5a; 60]);
    for full in [fixture, w.to_bytes().unwrap()] {
        let g = GgufFile::from_bytes(full.clone()).unwrap();
        // Padding after the last tensor's data is optional.
        let needed = g.tensors().iter().map(|t| t.offset as usize + t.n_bytes).max().unwrap();
        for len in 0..=full.len() {
            let r = GgufFile::from_bytes(full[..len].to_vec());
            assert_eq!(r.is_ok(), len >= needed, "prefix {len} of {}: {:?}", full.len(), r.err());
        }
    }
}

#[test]
fn bad_magic_and_versions() {
    let mut r = Raw::valid();
    r.magic = *b"GGML";
    assert!(matches!(r.fails_with(&["GGML", "GGUF"]), GgufError::BadMagic { .. }));
    for v in [0, 1, 4, 1000] {
        let mut r = Raw::valid();
        r.version = v;
        assert!(matches!(r.fails_with(&[&format!("version {v}")]), GgufError::UnsupportedVersion(x) if x == v));
    }
    let mut r = Raw::valid();
    r.version = 3u32.swap_bytes();
    assert!(matches!(r.fails_with(&["big-endian"]), GgufError::BigEndian(3)));
    let mut r = Raw::valid();
    r.version = 2;
    assert_eq!(r.parse().unwrap().version(), 2);
    assert!(matches!(GgufFile::from_bytes(b"GG".to_vec()), Err(GgufError::Truncated { .. })));
}

#[test]
fn huge_counts_fail_fast() {
    let started = Instant::now();
    let mut r = Raw::valid();
    r.n_kv = Some(u64::MAX);
    assert!(matches!(r.fails_with(&["metadata entry count", "18446744073709551615"]), GgufError::CountTooLarge { .. }));
    let mut r = Raw::valid();
    r.n_tensors = Some(1 << 60);
    r.fails_with(&["tensor count"]);
    // An array claiming 2^60 u32 elements.
    let mut value = 4u32.to_le_bytes().to_vec();
    value.extend_from_slice(&(1u64 << 60).to_le_bytes());
    let mut r = Raw::valid();
    r.kvs.push(kv("tokenizer.ggml.scores", 9, &value));
    assert!(matches!(r.fails_with(&["tokenizer.ggml.scores", "1152921504606846976"]), GgufError::CountTooLarge { .. }));
    // A u8 array claiming more elements than the whole file has bytes.
    let mut r = Raw::valid();
    let total = r.bytes().len() as u64;
    let mut value = 0u32.to_le_bytes().to_vec();
    value.extend_from_slice(&total.to_le_bytes());
    r.kvs.push(kv("short", 9, &value));
    assert!(matches!(r.fails_with(&["short"]), GgufError::CountTooLarge { .. }));
    assert!(started.elapsed().as_millis() < 500, "huge counts took {:?}", started.elapsed());
}

#[test]
fn lying_string_lengths() {
    // Key length far beyond the file.
    let mut r = Raw::valid();
    let mut bad = (1u64 << 40).to_le_bytes().to_vec();
    bad.extend_from_slice(b"key");
    r.kvs = vec![bad];
    assert!(matches!(r.fails_with(&["key of metadata entry #0"]), GgufError::CountTooLarge { .. }));
    // A string value whose length overshoots the file by a little.
    let mut r = Raw::valid();
    let total = r.bytes().len() as u64;
    let mut v = total.to_le_bytes().to_vec();
    v.extend_from_slice(b"abc");
    r.kvs.push(kv("general.name", 8, &v));
    r.fails_with(&["general.name"]);
    // Tensor name length lies.
    let mut r = Raw::valid();
    r.infos[1] = u64::MAX.to_le_bytes().to_vec();
    r.fails_with(&["name of tensor #1"]);
    // Invalid UTF-8.
    let mut r = Raw::valid();
    let mut v = 2u64.to_le_bytes().to_vec();
    v.extend_from_slice(&[0xff, 0xfe]);
    r.kvs.push(kv("general.name", 8, &v));
    assert!(matches!(r.fails_with(&["general.name", "UTF-8"]), GgufError::InvalidUtf8 { .. }));
}

#[test]
fn bad_value_types() {
    let mut r = Raw::valid();
    r.kvs.push(kv("weird", 13, &[0; 8]));
    assert!(matches!(r.fails_with(&["weird", "13"]), GgufError::BadValueType { id: 13, .. }));
    let mut r = Raw::valid();
    let mut v = 99u32.to_le_bytes().to_vec();
    v.extend_from_slice(&1u64.to_le_bytes());
    r.kvs.push(kv("arr", 9, &v));
    assert!(matches!(r.fails_with(&["arr", "99"]), GgufError::BadValueType { id: 99, .. }));
    let mut r = Raw::valid();
    r.kvs.push(kv("flag", 7, &[2]));
    assert!(matches!(r.fails_with(&["flag"]), GgufError::BadBool { byte: 2, .. }));
    // Arrays nested 10 deep.
    let mut v = Vec::new();
    for _ in 0..10 {
        v.extend_from_slice(&9u32.to_le_bytes());
        v.extend_from_slice(&1u64.to_le_bytes());
    }
    v.extend_from_slice(&0u32.to_le_bytes());
    v.extend_from_slice(&0u64.to_le_bytes());
    let mut r = Raw::valid();
    r.kvs.push(kv("deep", 9, &v));
    assert!(matches!(r.fails_with(&["deep", "nests"]), GgufError::TooDeep { .. }));
    let mut r = Raw::valid();
    r.kvs.push(kv("general.architecture", 8, &string("qwen2")));
    assert!(matches!(r.fails_with(&["general.architecture", "twice"]), GgufError::DuplicateKey(_)));
}

#[test]
fn bad_alignment() {
    for (value, ty, needle) in [
        (48u32.to_le_bytes().to_vec(), 4, "power of two"),
        (0u32.to_le_bytes().to_vec(), 4, "power of two"),
        (string("32"), 8, "string"),
    ] {
        let mut r = Raw::valid();
        r.kvs.push(kv("general.alignment", ty, &value));
        assert!(matches!(r.fails_with(&["general.alignment", needle]), GgufError::BadMeta { .. }));
    }
    // A valid non-default alignment moves the data section and tensor offsets.
    let mut r = Raw::valid();
    r.kvs.push(kv("general.alignment", 4, &64u32.to_le_bytes()));
    r.infos[1] = info("b", &[32, 2], 8, 64);
    r.align = 64;
    let b_data = r.data[32..].to_vec();
    r.data.splice(32..32, [0u8; 32]);
    let g = r.parse().unwrap();
    assert_eq!(g.alignment(), 64);
    assert_eq!(g.data_offset() % 64, 0);
    assert_eq!(g.tensor_data(g.tensor("b").unwrap()), &b_data[..]);
    // ... and an offset aligned to 32 but not 64 is now misaligned.
    r.infos[1] = info("b", &[32, 2], 8, 32);
    r.fails_with(&["`b`", "multiple of the alignment 64"]);
}

#[test]
fn bad_tensor_infos() {
    let cases: Vec<(Vec<u8>, Vec<&str>)> = vec![
        (info("b", &[32, 2, 1, 1, 1], 8, 32), vec!["`b`", "5 dimensions"]),
        (info("b", &[], 8, 32), vec!["`b`", "0 dimensions"]),
        (info("b", &[32, 0], 8, 32), vec!["`b`", "zero dimension"]),
        (info("b", &[32, 2], 99, 32), vec!["`b`", "unknown tensor type id 99"]),
        (info("b", &[32, 2], 6, 32), vec!["`b`", "Q5_0"]),
        (info("b", &[1 << 32, 1 << 32, 1 << 32], 0, 32), vec!["`b`", "overflows"]),
        (info("b", &[1 << 62, 2], 0, 32), vec!["`b`", "overflows"]),
        (info("b", &[16, 2], 8, 32), vec!["`b`", "row length 16", "block"]),
        (info("b", &[32, 2], 8, 16), vec!["`b`", "multiple of the alignment 32"]),
        (info("b", &[32, 2], 8, 64), vec!["`b`", "past the end"]),
        (info("b", &[32, 2], 8, u64::MAX - 31), vec!["`b`", "past the end"]),
        (info("b", &[32, 200], 8, 32), vec!["`b`", "past the end"]),
        (info("b", &[32], 8, 0), vec!["`b`", "overlaps tensor `a`"]),
        (info("a", &[32, 2], 8, 32), vec!["`a`", "twice"]),
    ];
    for (bad, needles) in cases {
        let mut r = Raw::valid();
        r.infos[1] = bad;
        let err = r.fails_with(&needles);
        assert!(matches!(err, GgufError::BadTensor { .. } | GgufError::DuplicateTensor(_)), "{err:?}");
    }
}

/// Random damage to valid files: overwrites with interesting numbers, bit flips,
/// truncation, insertions and deletions. Parsing must return (no panic, no abort), and
/// whatever parses must keep the reader's promises.
#[test]
fn mutated_files_never_panic() {
    let mut w = GgufWriter::new();
    w.add_meta("general.architecture", MetaValue::String("llama".into()))
        .add_meta(
            "tokenizer.ggml.tokens",
            MetaValue::Array((0..20).map(|i| MetaValue::String(format!("t{i}"))).collect()),
        )
        .add_meta("scores", MetaValue::Array((0..10).map(|i| MetaValue::F32(i as f32)).collect()))
        .add_meta("nested", MetaValue::Array(vec![MetaValue::Array(vec![MetaValue::U64(1)])]))
        .add_meta("flag", MetaValue::Bool(false))
        .add_f32_tensor("a", &[4, 2], &[0.5; 8])
        .add_tensor("b", GgmlType::Q8_0, &[32, 2], vec![7; 68])
        .add_tensor("c", GgmlType::Q4K, &[256], vec![9; 144]);
    let seeds = [w.to_bytes().unwrap(), Raw::valid().bytes()];
    let interesting: [u64; 9] = [0, 1, 2, 31, 32, 0x7fff_ffff, u32::MAX as u64, 1 << 63, u64::MAX];
    let mut rng = ChaCha8Rng::seed_from_u64(99);
    let iterations = 20_000;
    let mut parsed_ok = 0;
    for i in 0..iterations {
        let mut b = seeds[i % seeds.len()].clone();
        for _ in 0..1 + rng.next_u32() % 4 {
            if b.is_empty() {
                break;
            }
            let pos = (rng.next_u32() as usize) % b.len();
            match rng.next_u32() % 6 {
                0 => {
                    let v = interesting[(rng.next_u32() % 9) as usize].to_le_bytes();
                    let width = [1, 4, 8][(rng.next_u32() % 3) as usize];
                    for (k, byte) in v.iter().take(width).enumerate() {
                        if let Some(slot) = b.get_mut(pos + k) {
                            *slot = *byte;
                        }
                    }
                }
                1 => b[pos] ^= 1 << (rng.next_u32() % 8),
                2 => b[pos] = rng.next_u32() as u8,
                3 => b.truncate(pos),
                4 => b.insert(pos, rng.next_u32() as u8),
                _ => {
                    b.remove(pos);
                }
            }
        }
        if let Ok(g) = GgufFile::from_bytes(b.clone()) {
            parsed_ok += 1;
            for t in g.tensors() {
                assert_eq!(g.tensor_data(t).len(), t.n_bytes);
                assert_eq!(t.n_bytes, t.ty.bytes_for(t.n_elements() as usize).unwrap());
                assert_eq!((t.offset - g.data_offset()) % g.alignment(), 0);
                assert!(t.offset as usize + t.n_bytes <= b.len());
            }
        }
    }
    // Some mutations (inside tensor data, for instance) leave a valid file.
    assert!(parsed_ok > 0 && parsed_ok < iterations, "{parsed_ok} of {iterations} parsed");
}
