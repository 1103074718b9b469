//! A small GGUF writer, for tests and tools that need a real file: metadata of any type
//! plus tensors with given bytes, laid out the way llama.cpp's writers do (each tensor's
//! data aligned to `general.alignment`, default 32).
//!
//! Usage: `let mut w = GgufWriter::new(); w.add_meta("general.architecture",
//! MetaValue::String("llama".into())); w.add_tensor("output_norm.weight", GgmlType::F32,
//! &[576], bytes); let file = w.to_bytes()?;`

use std::collections::HashSet;
use std::io::Write;
use std::path::Path;

use tessera_kernels::GgmlType;

use super::parse::{align_up, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS};
use super::{GgufError, MetaValue};

/// Collects metadata and tensors, then writes them as one GGUF file.
#[derive(Debug, Clone)]
pub struct GgufWriter {
    version: u32,
    meta: Vec<(String, MetaValue)>,
    tensors: Vec<PendingTensor>,
}

#[derive(Debug, Clone)]
struct PendingTensor {
    name: String,
    ty: GgmlType,
    /// ne0 first, as in the file.
    dims: Vec<u64>,
    data: Vec<u8>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// An empty version-3 file.
    pub fn new() -> Self {
        GgufWriter { version: 3, meta: Vec::new(), tensors: Vec::new() }
    }

    /// Writes a different format version (2 or 3; they share one layout).
    pub fn set_version(&mut self, version: u32) -> &mut Self {
        self.version = version;
        self
    }

    /// Adds a metadata entry; entries are written in the order added.
    pub fn add_meta(&mut self, key: impl Into<String>, value: MetaValue) -> &mut Self {
        self.meta.push((key.into(), value));
        self
    }

    /// Adds a tensor. `dims` is ne0 first (`[cols, rows]` for a matrix); `data` must be
    /// exactly `ty.bytes_for(product of dims)` bytes (checked by `write`).
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        ty: GgmlType,
        dims: &[u64],
        data: impl Into<Vec<u8>>,
    ) -> &mut Self {
        self.tensors.push(PendingTensor { name: name.into(), ty, dims: dims.to_vec(), data: data.into() });
        self
    }

    /// Adds an F32 tensor from values.
    pub fn add_f32_tensor(&mut self, name: impl Into<String>, dims: &[u64], values: &[f32]) -> &mut Self {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.add_tensor(name, GgmlType::F32, dims, bytes)
    }

    /// The whole file as bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>, GgufError> {
        let mut out = Vec::new();
        self.write(&mut out)?;
        Ok(out)
    }

    /// Writes the file to `path` (created or truncated).
    pub fn write_file(&self, path: &Path) -> Result<(), GgufError> {
        let bytes = self.to_bytes()?;
        std::fs::write(path, bytes).map_err(|source| GgufError::Io { path: path.to_owned(), source })
    }

    /// Writes the file to `out`, after checking that it would read back.
    pub fn write(&self, out: &mut impl Write) -> Result<(), GgufError> {
        let alignment = self.check()?;
        let mut w = Counting { out, written: 0 };
        w.put(MAGIC)?;
        w.put(&self.version.to_le_bytes())?;
        w.put(&(self.tensors.len() as u64).to_le_bytes())?;
        w.put(&(self.meta.len() as u64).to_le_bytes())?;
        for (key, value) in &self.meta {
            put_string(&mut w, key)?;
            w.put(&value.type_id().to_le_bytes())?;
            put_value(&mut w, value)?;
        }
        let mut rel = 0u64;
        for t in &self.tensors {
            put_string(&mut w, &t.name)?;
            w.put(&(t.dims.len() as u32).to_le_bytes())?;
            for d in &t.dims {
                w.put(&d.to_le_bytes())?;
            }
            w.put(&(t.ty as u32).to_le_bytes())?;
            w.put(&rel.to_le_bytes())?;
            rel = aligned(rel + t.data.len() as u64, alignment)?;
        }
        w.pad_to(alignment)?;
        for t in &self.tensors {
            w.put(&t.data)?;
            w.pad_to(alignment)?;
        }
        Ok(())
    }

    /// Validates everything the reader would reject; returns the alignment.
    fn check(&self) -> Result<u64, GgufError> {
        let bad = |msg: String| Err(GgufError::Write(msg));
        if !matches!(self.version, 2 | 3) {
            return bad(format!("version {} (only 2 and 3 are written)", self.version));
        }
        let mut keys = HashSet::new();
        for (key, value) in &self.meta {
            if !keys.insert(key.as_str()) {
                return bad(format!("metadata key `{key}` added twice"));
            }
            check_value(key, value, 0)?;
        }
        let alignment = match self.meta.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
            None => DEFAULT_ALIGNMENT,
            Some((_, MetaValue::U32(a))) if a.is_power_of_two() => u64::from(*a),
            Some((_, v)) => return bad(format!("{ALIGNMENT_KEY} must be a u32 power of two, got {v:?}")),
        };
        let mut names = HashSet::new();
        for t in &self.tensors {
            if !names.insert(t.name.as_str()) {
                return bad(format!("tensor `{}` added twice", t.name));
            }
            if t.dims.is_empty() || t.dims.len() > MAX_DIMS || t.dims.contains(&0) {
                return bad(format!("tensor `{}`: dims {:?} (1 to {MAX_DIMS} nonzero dims)", t.name, t.dims));
            }
            let n = t.dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).and_then(|n| usize::try_from(n).ok());
            let row_ok = t.dims.first().is_some_and(|&ne0| ne0 % t.ty.block_elems() as u64 == 0);
            let need = n.and_then(|n| t.ty.bytes_for(n)).filter(|_| row_ok);
            if need != Some(t.data.len()) {
                return bad(format!(
                    "tensor `{}`: {} bytes given for {} dims {:?} (needs {need:?}, rows of whole blocks)",
                    t.name,
                    t.data.len(),
                    t.ty,
                    t.dims
                ));
            }
        }
        Ok(alignment)
    }
}

fn check_value(key: &str, value: &MetaValue, depth: usize) -> Result<(), GgufError> {
    if let MetaValue::Array(items) = value {
        if depth >= 3 {
            return Err(GgufError::Write(format!("`{key}`: arrays nested too deep")));
        }
        if let Some(first) = items.first() {
            if items.iter().any(|v| v.type_id() != first.type_id()) {
                return Err(GgufError::Write(format!("`{key}`: array elements must share one type")));
            }
        }
        for item in items {
            check_value(key, item, depth + 1)?;
        }
    }
    Ok(())
}

fn aligned(x: u64, alignment: u64) -> Result<u64, GgufError> {
    align_up(x, alignment).ok_or_else(|| GgufError::Write("offset overflows".into()))
}

/// A writer that knows how much it has written, for padding.
struct Counting<'w, W: Write> {
    out: &'w mut W,
    written: u64,
}

impl<W: Write> Counting<'_, W> {
    fn put(&mut self, bytes: &[u8]) -> Result<(), GgufError> {
        self.out.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn pad_to(&mut self, alignment: u64) -> Result<(), GgufError> {
        let target = aligned(self.written, alignment)?;
        let zeros = vec![0u8; (target - self.written) as usize];
        self.put(&zeros)
    }
}

fn put_string<W: Write>(w: &mut Counting<W>, s: &str) -> Result<(), GgufError> {
    w.put(&(s.len() as u64).to_le_bytes())?;
    w.put(s.as_bytes())
}

fn put_value<W: Write>(w: &mut Counting<W>, v: &MetaValue) -> Result<(), GgufError> {
    match v {
        MetaValue::U8(x) => w.put(&x.to_le_bytes()),
        MetaValue::I8(x) => w.put(&x.to_le_bytes()),
        MetaValue::U16(x) => w.put(&x.to_le_bytes()),
        MetaValue::I16(x) => w.put(&x.to_le_bytes()),
        MetaValue::U32(x) => w.put(&x.to_le_bytes()),
        MetaValue::I32(x) => w.put(&x.to_le_bytes()),
        MetaValue::F32(x) => w.put(&x.to_le_bytes()),
        MetaValue::U64(x) => w.put(&x.to_le_bytes()),
        MetaValue::I64(x) => w.put(&x.to_le_bytes()),
        MetaValue::F64(x) => w.put(&x.to_le_bytes()),
        MetaValue::Bool(b) => w.put(&[u8::from(*b)]),
        MetaValue::String(s) => put_string(w, s),
        MetaValue::Array(items) => {
            // An empty array has no element to take a type from; any type reads back empty.
            let elem = items.first().map_or(super::value::type_id::U8, MetaValue::type_id);
            w.put(&elem.to_le_bytes())?;
            w.put(&(items.len() as u64).to_le_bytes())?;
            items.iter().try_for_each(|item| put_value(w, item))
        }
    }
}
