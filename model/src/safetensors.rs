//! Safetensors checkpoints, single-file or sharded (`model.safetensors.index.json`), read
//! from memory maps.
//!
//! A file is `u64 header_len | JSON header | data`; the header maps each tensor name to
//! `{dtype, shape, data_offsets: [start, end]}` relative to the data section. We parse the
//! header ourselves (serde_json into loose values) so every offset, size and product is
//! checked here with errors naming the tensor; the `safetensors` crate is the independent
//! writer the tests use. Tensors of any safetensors dtype are indexed (a checkpoint may
//! carry an unused I64 buffer); only BF16, F16 and F32 map to a `GgmlType`.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use serde_json::Value;
use tessera_kernels::GgmlType;

/// Headers larger than this are refused before being read (the crate uses the same cap).
const MAX_HEADER_BYTES: u64 = 100 * 1024 * 1024;
pub const INDEX_FILE: &str = "model.safetensors.index.json";
pub const SINGLE_FILE: &str = "model.safetensors";

/// A safetensors file or shard set that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum SafeTensorsError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("safetensors file of {0} bytes is too short to hold the 8-byte header length")]
    TooShort(usize),
    #[error("safetensors header length {len} does not fit in the {file_len}-byte file")]
    HeaderLength { len: u64, file_len: usize },
    #[error("safetensors header: {0}")]
    Header(String),
    #[error("safetensors tensor `{name}`: {reason}")]
    Tensor { name: String, reason: String },
    #[error("safetensors tensor `{name}` has dtype {dtype}; only BF16, F16 and F32 are supported")]
    UnsupportedDtype { name: String, dtype: String },
    #[error("{path}: {reason}")]
    Index { path: PathBuf, reason: String },
    #[error("safetensors tensor `{0}` appears in more than one shard")]
    DuplicateTensor(String),
    #[error("{0}: no {INDEX_FILE} or {SINGLE_FILE}")]
    NoWeights(PathBuf),
}

/// One tensor of a safetensors file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StTensorInfo {
    /// The dtype string of the header ("BF16", "I64", ...).
    pub dtype: String,
    /// Row-major: `[rows, cols]` for a matrix.
    pub shape: Vec<usize>,
    /// Absolute offset of the first byte in the file.
    pub offset: usize,
    pub n_bytes: usize,
}

impl StTensorInfo {
    /// The dtype as a `GgmlType`, for the three float types Tessera reads.
    pub fn ggml_type(&self) -> Option<GgmlType> {
        match self.dtype.as_str() {
            "F32" => Some(GgmlType::F32),
            "F16" => Some(GgmlType::F16),
            "BF16" => Some(GgmlType::BF16),
            _ => None,
        }
    }
}

/// Bits per element of each safetensors dtype (the format's full list).
fn dtype_bits(dtype: &str) -> Option<usize> {
    Some(match dtype {
        "F4" => 4,
        "F6_E2M3" | "F6_E3M2" => 6,
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" | "F8_E4M3FNUZ" | "F8_E5M2FNUZ" => 8,
        "I16" | "U16" | "F16" | "BF16" => 16,
        "I32" | "U32" | "F32" => 32,
        "I64" | "U64" | "F64" | "C64" => 64,
        _ => return None,
    })
}

enum Backing {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mapped(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// One parsed safetensors file.
pub struct SafeTensorsFile {
    backing: Backing,
    tensors: BTreeMap<String, StTensorInfo>,
    metadata: BTreeMap<String, String>,
}

impl std::fmt::Debug for SafeTensorsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafeTensorsFile").field("tensors", &self.tensors.len()).finish()
    }
}

impl SafeTensorsFile {
    /// Memory-maps and parses `path` (the file must not change while open).
    pub fn open(path: &Path) -> Result<Self, SafeTensorsError> {
        let io = |source| SafeTensorsError::Io { path: path.to_owned(), source };
        let file = File::open(path).map_err(io)?;
        // SAFETY: read-only map; model files are not rewritten while served.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::from_backing(Backing::Mapped(map))
    }

    /// Parses a file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, SafeTensorsError> {
        Self::from_backing(Backing::Owned(bytes))
    }

    fn from_backing(backing: Backing) -> Result<Self, SafeTensorsError> {
        let (tensors, metadata) = parse(backing.bytes())?;
        Ok(SafeTensorsFile { backing, tensors, metadata })
    }

    /// All tensors, by name.
    pub fn tensors(&self) -> &BTreeMap<String, StTensorInfo> {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&StTensorInfo> {
        self.tensors.get(name)
    }

    /// The `__metadata__` string map (empty if absent).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// A tensor's bytes; empty for an info that does not belong to this file.
    pub fn tensor_data(&self, t: &StTensorInfo) -> &[u8] {
        t.offset.checked_add(t.n_bytes).and_then(|end| self.backing.bytes().get(t.offset..end)).unwrap_or(&[])
    }
}

type Parsed = (BTreeMap<String, StTensorInfo>, BTreeMap<String, String>);

fn parse(buf: &[u8]) -> Result<Parsed, SafeTensorsError> {
    let len_bytes: [u8; 8] =
        buf.get(..8).and_then(|s| s.try_into().ok()).ok_or(SafeTensorsError::TooShort(buf.len()))?;
    let header_len = u64::from_le_bytes(len_bytes);
    let header = usize::try_from(header_len)
        .ok()
        .filter(|_| header_len <= MAX_HEADER_BYTES)
        .and_then(|n| buf.get(8..8 + n))
        .ok_or(SafeTensorsError::HeaderLength { len: header_len, file_len: buf.len() })?;
    let data_start = 8 + header.len();
    let data_len = buf.len() - data_start;

    let header: BTreeMap<String, Value> =
        serde_json::from_slice(header).map_err(|e| SafeTensorsError::Header(format!("not a JSON object: {e}")))?;
    let mut tensors = BTreeMap::new();
    let mut metadata = BTreeMap::new();
    for (name, entry) in header {
        if name == "__metadata__" {
            metadata = parse_metadata(entry)?;
            continue;
        }
        let mut info = tensor_entry(&name, &entry, data_len)?;
        info.offset += data_start;
        tensors.insert(name, info);
    }
    check_overlaps(&tensors)?;
    Ok((tensors, metadata))
}

fn parse_metadata(entry: Value) -> Result<BTreeMap<String, String>, SafeTensorsError> {
    let bad = || SafeTensorsError::Header("__metadata__ must map strings to strings".into());
    let Value::Object(map) = entry else { return Err(bad()) };
    map.into_iter()
        .map(|(k, v)| match v {
            Value::String(s) => Ok((k, s)),
            _ => Err(bad()),
        })
        .collect()
}

/// Checks one header entry; the returned offset is relative to the data section.
fn tensor_entry(name: &str, entry: &Value, data_len: usize) -> Result<StTensorInfo, SafeTensorsError> {
    let bad = |reason: String| SafeTensorsError::Tensor { name: name.to_owned(), reason };
    let dtype = entry.get("dtype").and_then(Value::as_str).ok_or_else(|| bad("missing string field `dtype`".into()))?;
    let bits = dtype_bits(dtype).ok_or_else(|| bad(format!("unknown dtype `{dtype}`")))?;
    let shape = entry
        .get("shape")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("missing array field `shape`".into()))?
        .iter()
        .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
        .collect::<Option<Vec<usize>>>()
        .ok_or_else(|| bad("`shape` must hold non-negative integers".into()))?;
    let offsets = entry
        .get("data_offsets")
        .and_then(Value::as_array)
        .and_then(|a| match a.as_slice() {
            [s, e] => Some((s.as_u64()?, e.as_u64()?)),
            _ => None,
        })
        .ok_or_else(|| bad("`data_offsets` must be two non-negative integers".into()))?;
    let (start, end) = offsets;
    if start > end || end > data_len as u64 {
        return Err(bad(format!("data_offsets [{start}, {end}] outside the {data_len}-byte data section")));
    }
    let n_bits = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .and_then(|n| n.checked_mul(bits))
        .ok_or_else(|| bad(format!("size of shape {shape:?} overflows")))?;
    let n_bytes = n_bits.div_ceil(8);
    if n_bits % 8 != 0 || (end - start) != n_bytes as u64 {
        return Err(bad(format!(
            "data_offsets [{start}, {end}] hold {} bytes, but shape {shape:?} of {dtype} needs {n_bits} bits",
            end - start
        )));
    }
    Ok(StTensorInfo { dtype: dtype.to_owned(), shape, offset: start as usize, n_bytes })
}

fn check_overlaps(tensors: &BTreeMap<String, StTensorInfo>) -> Result<(), SafeTensorsError> {
    let mut spans: Vec<(usize, usize, &str)> = tensors
        .iter()
        .filter(|(_, t)| t.n_bytes > 0)
        .map(|(n, t)| (t.offset, t.offset + t.n_bytes, n.as_str()))
        .collect();
    spans.sort_unstable();
    for pair in spans.windows(2) {
        if let [(_, end_a, a), (start_b, _, b)] = pair {
            if start_b < end_a {
                return Err(SafeTensorsError::Tensor {
                    name: (*b).to_owned(),
                    reason: format!("data overlaps tensor `{a}`"),
                });
            }
        }
    }
    Ok(())
}

/// The safetensors weights of a model directory: one file or the shards an index lists.
#[derive(Debug)]
pub struct SafeTensorsSet {
    shards: Vec<SafeTensorsFile>,
    /// Tensor name -> index into `shards`.
    index: HashMap<String, usize>,
}

impl SafeTensorsSet {
    /// Opens `dir/model.safetensors.index.json` and its shards, or `dir/model.safetensors`.
    pub fn open_dir(dir: &Path) -> Result<Self, SafeTensorsError> {
        let index_path = dir.join(INDEX_FILE);
        if index_path.is_file() {
            return Self::open_index(dir, &index_path);
        }
        let single = dir.join(SINGLE_FILE);
        if single.is_file() {
            return Self::from_files(vec![SafeTensorsFile::open(&single)?]);
        }
        Err(SafeTensorsError::NoWeights(dir.to_owned()))
    }

    /// Builds a set from already-parsed files (each tensor must appear once).
    pub fn from_files(shards: Vec<SafeTensorsFile>) -> Result<Self, SafeTensorsError> {
        let mut index = HashMap::new();
        for (i, shard) in shards.iter().enumerate() {
            for name in shard.tensors().keys() {
                if index.insert(name.clone(), i).is_some() {
                    return Err(SafeTensorsError::DuplicateTensor(name.clone()));
                }
            }
        }
        Ok(SafeTensorsSet { shards, index })
    }

    fn open_index(dir: &Path, index_path: &Path) -> Result<Self, SafeTensorsError> {
        let bad = |reason: String| SafeTensorsError::Index { path: index_path.to_owned(), reason };
        let text = std::fs::read_to_string(index_path)
            .map_err(|source| SafeTensorsError::Io { path: index_path.to_owned(), source })?;
        let json: Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let map =
            json.get("weight_map").and_then(Value::as_object).ok_or_else(|| bad("no `weight_map` object".into()))?;
        // Shard file name -> tensors the index places there.
        let mut by_file: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (tensor, file) in map {
            let file = file.as_str().ok_or_else(|| bad(format!("`{tensor}` maps to a non-string")))?;
            if file.is_empty() || file.contains(['/', '\\']) || file == ".." || file == "." {
                return Err(bad(format!("shard name `{file}` must be a plain file name in the model directory")));
            }
            by_file.entry(file).or_default().push(tensor);
        }
        let mut shards = Vec::with_capacity(by_file.len());
        for (file, names) in &by_file {
            let shard = SafeTensorsFile::open(&dir.join(file))?;
            if let Some(missing) = names.iter().find(|n| shard.tensor(n).is_none()) {
                return Err(bad(format!("`{missing}` is mapped to {file}, which does not contain it")));
            }
            shards.push(shard);
        }
        Self::from_files(shards)
    }

    /// A tensor's info and bytes.
    pub fn get(&self, name: &str) -> Option<(&StTensorInfo, &[u8])> {
        let shard = self.shards.get(*self.index.get(name)?)?;
        let info = shard.tensor(name)?;
        Some((info, shard.tensor_data(info)))
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Every tensor name, unordered.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }
}
