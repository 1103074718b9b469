//! The safetensors reader against the `safetensors` crate (the format's reference
//! implementation): files the crate writes must read back identically, in one file or as
//! an indexed shard set; malformed headers must be errors naming the tensor.

use std::collections::HashMap;
use std::path::PathBuf;

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use safetensors::tensor::TensorView as RefView;
use safetensors::Dtype;
use tessera_kernels::GgmlType;
use tessera_model::safetensors::{SafeTensorsError, SafeTensorsFile, SafeTensorsSet};

struct Owned {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn random_tensors(rng: &mut ChaCha8Rng, n: usize) -> Vec<Owned> {
    let dtypes = [(Dtype::F32, 4), (Dtype::F16, 2), (Dtype::BF16, 2), (Dtype::I64, 8), (Dtype::U8, 1)];
    (0..n)
        .map(|i| {
            let (dtype, size) = dtypes[(rng.next_u32() % 5) as usize];
            let shape: Vec<usize> = (0..rng.next_u32() % 4).map(|_| 1 + (rng.next_u32() % 5) as usize).collect();
            let mut data = vec![0u8; shape.iter().product::<usize>() * size];
            rng.fill_bytes(&mut data);
            Owned { name: format!("model.layers.{i}.w"), dtype, shape, data }
        })
        .collect()
}

fn serialize(tensors: &[Owned], meta: Option<HashMap<String, String>>) -> Vec<u8> {
    let views: Vec<(String, RefView)> =
        tensors.iter().map(|t| (t.name.clone(), RefView::new(t.dtype, t.shape.clone(), &t.data).unwrap())).collect();
    safetensors::serialize(views, meta).unwrap()
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tessera-st-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn crate_written_files_read_back() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for case in 0..40 {
        let tensors = random_tensors(&mut rng, 1 + case % 7);
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        let bytes = serialize(&tensors, Some(meta));
        let reference = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let f = SafeTensorsFile::from_bytes(bytes.clone()).unwrap();
        assert_eq!(f.tensors().len(), tensors.len());
        assert_eq!(f.metadata().get("format").map(String::as_str), Some("pt"));
        for t in &tensors {
            let info = f.tensor(&t.name).unwrap();
            assert_eq!(info.dtype, format!("{:?}", t.dtype));
            assert_eq!(info.shape, t.shape);
            assert_eq!(f.tensor_data(info), &t.data[..]);
            assert_eq!(f.tensor_data(info), reference.tensor(&t.name).unwrap().data());
            let want = match t.dtype {
                Dtype::F32 => Some(GgmlType::F32),
                Dtype::F16 => Some(GgmlType::F16),
                Dtype::BF16 => Some(GgmlType::BF16),
                _ => None,
            };
            assert_eq!(info.ggml_type(), want);
        }
    }
}

#[test]
fn sharded_directory() {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let tensors = random_tensors(&mut rng, 6);
    let dir = temp_dir("sharded");
    let (a, b) = tensors.split_at(4);
    std::fs::write(dir.join("model-00001-of-00002.safetensors"), serialize(a, None)).unwrap();
    std::fs::write(dir.join("model-00002-of-00002.safetensors"), serialize(b, None)).unwrap();
    let mut map = serde_json::Map::new();
    for t in a {
        map.insert(t.name.clone(), "model-00001-of-00002.safetensors".into());
    }
    for t in b {
        map.insert(t.name.clone(), "model-00002-of-00002.safetensors".into());
    }
    let index = serde_json::json!({"metadata": {"total_size": 1}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();

    let set = SafeTensorsSet::open_dir(&dir).unwrap();
    assert_eq!(set.len(), 6);
    for t in &tensors {
        let (info, data) = set.get(&t.name).unwrap();
        assert_eq!((&info.shape, data), (&t.shape, &t.data[..]));
    }
    assert!(set.get("nope").is_none());

    // The index points a tensor at a shard that lacks it.
    let mut bad = map.clone();
    bad.insert(tensors[5].name.clone(), "model-00001-of-00002.safetensors".into());
    let write_index = |m: &serde_json::Map<String, serde_json::Value>| {
        std::fs::write(dir.join("model.safetensors.index.json"), serde_json::json!({ "weight_map": m }).to_string())
            .unwrap()
    };
    write_index(&bad);
    let msg = SafeTensorsSet::open_dir(&dir).unwrap_err().to_string();
    assert!(msg.contains(&tensors[5].name) && msg.contains("does not contain"), "{msg}");
    // A shard name that escapes the directory.
    let mut bad = map.clone();
    bad.insert(tensors[0].name.clone(), "../model-00001-of-00002.safetensors".into());
    write_index(&bad);
    assert!(SafeTensorsSet::open_dir(&dir).unwrap_err().to_string().contains("plain file name"));
    // A shard that does not exist.
    let mut bad = map.clone();
    bad.insert(tensors[0].name.clone(), "model-00009-of-00002.safetensors".into());
    write_index(&bad);
    assert!(matches!(SafeTensorsSet::open_dir(&dir), Err(SafeTensorsError::Io { .. })));
    // The same tensor in two shards.
    std::fs::write(dir.join("model-00002-of-00002.safetensors"), serialize(&tensors[3..], None)).unwrap();
    write_index(&map);
    assert!(SafeTensorsSet::open_dir(&dir).unwrap_err().to_string().contains("more than one shard"));
    std::fs::remove_dir_all(&dir).unwrap();

    let empty = temp_dir("empty");
    assert!(matches!(SafeTensorsSet::open_dir(&empty), Err(SafeTensorsError::NoWeights(_))));
    std::fs::write(empty.join("model.safetensors"), serialize(&tensors, None)).unwrap();
    assert_eq!(SafeTensorsSet::open_dir(&empty).unwrap().len(), 6);
    std::fs::remove_dir_all(&empty).unwrap();
}

/// `u64 len | header` followed by `data_len` bytes of data.
fn with_header(header: &str, data_len: usize) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.resize(out.len() + data_len, 0x33);
    out
}

fn fails_with(bytes: Vec<u8>, needles: &[&str]) {
    let err = SafeTensorsFile::from_bytes(bytes).expect_err("malformed file parsed");
    let msg = err.to_string();
    for n in needles {
        assert!(msg.contains(n), "error `{msg}` does not mention `{n}`");
    }
}

#[test]
fn malformed_headers() {
    fails_with(vec![1, 2, 3], &["too short"]);
    let mut huge = u64::MAX.to_le_bytes().to_vec();
    huge.extend_from_slice(b"{}");
    fails_with(huge, &["header length"]);
    let mut long = 100u64.to_le_bytes().to_vec();
    long.extend_from_slice(b"{}");
    fails_with(long, &["header length 100", "10-byte file"]);
    fails_with(with_header("{not json", 0), &["JSON"]);
    fails_with(with_header("[1,2]", 0), &["JSON object"]);
    let t = |entry: &str| format!("{{\"w\": {entry}}}");
    fails_with(with_header(&t(r#"{"shape":[2],"data_offsets":[0,8]}"#), 8), &["`w`", "dtype"]);
    fails_with(
        with_header(&t(r#"{"dtype":"F33","shape":[2],"data_offsets":[0,8]}"#), 8),
        &["`w`", "unknown dtype `F33`"],
    );
    fails_with(with_header(&t(r#"{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}"#), 8), &["`w`", "shape"]);
    fails_with(with_header(&t(r#"{"dtype":"F32","shape":[2],"data_offsets":[0]}"#), 8), &["`w`", "data_offsets"]);
    fails_with(
        with_header(&t(r#"{"dtype":"F32","shape":[2],"data_offsets":[0,16]}"#), 8),
        &["`w`", "outside the 8-byte data"],
    );
    fails_with(with_header(&t(r#"{"dtype":"F32","shape":[2],"data_offsets":[8,0]}"#), 8), &["`w`", "outside"]);
    fails_with(with_header(&t(r#"{"dtype":"F32","shape":[3],"data_offsets":[0,8]}"#), 8), &["`w`", "needs 96 bits"]);
    fails_with(
        with_header(
            &t(r#"{"dtype":"F32","shape":[1099511627776,1099511627776,1099511627776],"data_offsets":[0,8]}"#),
            8,
        ),
        &["`w`", "overflows"],
    );
    fails_with(
        with_header(&t(r#"{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551615]}"#), 8),
        &["`w`", "outside"],
    );
    fails_with(
        with_header(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F16","shape":[2],"data_offsets":[4,8]}}"#,
            8,
        ),
        &["overlaps"],
    );
    fails_with(with_header(r#"{"__metadata__":{"k":1}}"#, 0), &["__metadata__"]);
    // Unsupported dtypes parse (a checkpoint may carry unused buffers) but have no GgmlType.
    let f =
        SafeTensorsFile::from_bytes(with_header(&t(r#"{"dtype":"I64","shape":[1],"data_offsets":[0,8]}"#), 8)).unwrap();
    assert_eq!(f.tensor("w").unwrap().ggml_type(), None);
}

#[test]
fn every_prefix_fails_and_mutations_never_panic() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let tensors = random_tensors(&mut rng, 5);
    let full = serialize(&tensors, None);
    let ok = SafeTensorsFile::from_bytes(full.clone()).unwrap();
    let needed = ok.tensors().values().map(|t| t.offset + t.n_bytes).max().unwrap();
    for len in 0..full.len() {
        assert_eq!(SafeTensorsFile::from_bytes(full[..len].to_vec()).is_ok(), len >= needed, "prefix {len}");
    }
    let mut parsed = 0;
    for _ in 0..20_000 {
        let mut b = full.clone();
        for _ in 0..1 + rng.next_u32() % 3 {
            let pos = rng.next_u32() as usize % b.len();
            match rng.next_u32() % 4 {
                0 => b[pos] = b"0123456789[]{},:\"-"[rng.next_u32() as usize % 18],
                1 => b[pos] ^= 1 << (rng.next_u32() % 8),
                2 => b.truncate(pos.max(1)),
                _ => b.insert(pos, rng.next_u32() as u8),
            }
        }
        if let Ok(f) = SafeTensorsFile::from_bytes(b.clone()) {
            parsed += 1;
            for t in f.tensors().values() {
                assert_eq!(f.tensor_data(t).len(), t.n_bytes);
                assert!(t.offset + t.n_bytes <= b.len());
            }
        }
    }
    assert!(parsed > 0, "no mutation left a valid file");
}
