//! GGUF, llama.cpp's model file: metadata key/values plus a table of tensors whose bytes
//! follow in an aligned data section. `GgufFile` reads versions 2 and 3 from a memory map
//! (or an owned buffer, for tests and fuzzing); `GgufWriter` builds small files for tests.
//!
//! The whole table is validated when the file is opened, so later accessors cannot fail:
//! `tensor_data` returns a slice already proven to lie inside the file.

mod error;
mod parse;
mod value;
mod write;

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::Path;

use memmap2::Mmap;
use tessera_kernels::GgmlType;

pub use error::GgufError;
pub use value::MetaValue;
pub use write::GgufWriter;

/// One entry of the tensor table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub ty: GgmlType,
    /// ne0 first, as in the file: a matrix with `rows` rows of `cols` values is `[cols, rows]`.
    pub dims: Vec<u64>,
    /// Absolute offset of the first byte in the file.
    pub offset: u64,
    /// `ty.bytes_for(product of dims)`.
    pub n_bytes: usize,
}

impl TensorInfo {
    /// Product of the dimensions (fits in usize: checked at parse time).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().fold(1u64, |acc, &d| acc.saturating_mul(d))
    }
}

// Files are opened once and shared by every thread of a worker.
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<GgufFile>();
};

/// The bytes a file was parsed from.
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

/// A parsed GGUF file. Holds its bytes (mapped or owned); tensor data is borrowed from it.
pub struct GgufFile {
    backing: Backing,
    version: u32,
    metadata: BTreeMap<String, MetaValue>,
    tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("bytes", &self.backing.bytes().len())
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and parses `path`.
    ///
    /// The map is read-only and private; as with every mmap reader, the file must not be
    /// truncated or rewritten while it is open (model files are written once).
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        let io = |source| GgufError::Io { path: path.to_owned(), source };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the map is read-only; the safety caveat is the one documented above
        // (another process truncating the file under us), which no reader can rule out.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::from_backing(Backing::Mapped(map))
    }

    /// Parses a file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        Self::from_backing(Backing::Owned(bytes))
    }

    fn from_backing(backing: Backing) -> Result<GgufFile, GgufError> {
        let p = parse::parse(backing.bytes())?;
        Ok(GgufFile {
            backing,
            version: p.version,
            metadata: p.metadata,
            tensors: p.tensors,
            index: p.index,
            alignment: p.alignment,
            data_offset: p.data_offset,
        })
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// All metadata, by key.
    pub fn metadata(&self) -> &BTreeMap<String, MetaValue> {
        &self.metadata
    }

    /// One metadata value.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// The tensor table, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// A tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).and_then(|&i| self.tensors.get(i))
    }

    /// The bytes of a tensor of this file (`t.n_bytes` long). A `TensorInfo` that does not
    /// come from this file and points outside it gets an empty slice.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let start = usize::try_from(t.offset).ok();
        let range = start.and_then(|s| Some(s..s.checked_add(t.n_bytes)?));
        range.and_then(|r| self.backing.bytes().get(r)).unwrap_or(&[])
    }

    /// Data-section alignment (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute offset where the data section starts.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Size of the whole file in bytes.
    pub fn file_len(&self) -> usize {
        self.backing.bytes().len()
    }
}
