//! The GGUF reader proper: walks a byte buffer (a memory map or an owned copy) and
//! returns the metadata and tensor table, with every tensor's bytes proven to lie inside
//! the buffer.
//!
//! Layout (little-endian; GGUF v2/v3 as specified in ggml's `docs/gguf.md`):
//! `"GGUF" | u32 version | u64 tensor_count | u64 kv_count | kv* | tensor_info* | pad |
//! data`, where a string is `u64 len + bytes`, a kv is `string key | u32 type | value`, an
//! array value is `u32 elem_type | u64 n | value*`, and a tensor info is `string name |
//! u32 n_dims | u64 ne[n_dims] | u32 ggml_type | u64 offset` (offset relative to the
//! aligned start of the data section).
//!
//! Nothing here trusts a number from the file: reads go through `Cursor::take`, which
//! fails on a short buffer; claimed counts are checked against the bytes left before
//! anything is allocated; sizes use checked arithmetic.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use tessera_kernels::GgmlType;

use super::value::{min_encoded_size, type_id};
use super::{GgufError, MetaValue, TensorInfo};

pub(crate) const MAGIC: &[u8; 4] = b"GGUF";
pub(crate) const DEFAULT_ALIGNMENT: u64 = 32;
pub(crate) const ALIGNMENT_KEY: &str = "general.alignment";
/// ggml's `GGML_MAX_DIMS`.
pub(crate) const MAX_DIMS: usize = 4;
/// Real files use flat arrays; the format allows nesting, so allow a little without
/// letting a crafted file recurse until the stack overflows.
const MAX_ARRAY_DEPTH: usize = 4;
/// Smallest encoded kv: empty key (u64 length), type id, one-byte value.
const MIN_KV_BYTES: usize = 8 + 4 + 1;
/// Smallest encoded tensor info: empty name, n_dims, one dim, type, offset.
const MIN_TENSOR_INFO_BYTES: usize = 8 + 4 + 8 + 4 + 8;

/// What `parse` found.
pub(crate) struct Parsed {
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    pub tensors: Vec<TensorInfo>,
    pub index: HashMap<String, usize>,
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
}

/// Where the reader is, for error messages; rendered only when an error is built.
#[derive(Clone, Copy)]
enum Ctx<'a> {
    Header(&'static str),
    KeyName(usize),
    Value(&'a str),
    TensorName(usize),
    TensorField(&'a str, &'static str),
}

impl fmt::Display for Ctx<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Ctx::Header(field) => write!(f, "the header's {field}"),
            Ctx::KeyName(i) => write!(f, "the key of metadata entry #{i}"),
            Ctx::Value(key) => write!(f, "the value of `{key}`"),
            Ctx::TensorName(i) => write!(f, "the name of tensor #{i}"),
            Ctx::TensorField(name, field) => write!(f, "the {field} of tensor `{name}`"),
        }
    }
}

/// A read position in the buffer. Invariant: `pos <= buf.len()`.
struct Cursor<'b> {
    buf: &'b [u8],
    pos: usize,
}

impl<'b> Cursor<'b> {
    fn left(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn take(&mut self, n: usize, ctx: Ctx) -> Result<&'b [u8], GgufError> {
        let slice = self.pos.checked_add(n).and_then(|end| self.buf.get(self.pos..end));
        match slice {
            Some(s) => {
                self.pos += n;
                Ok(s)
            }
            None => Err(GgufError::Truncated {
                what: ctx.to_string(),
                offset: self.pos as u64,
                need: n as u64,
                left: self.left() as u64,
            }),
        }
    }

    fn bytes<const N: usize>(&mut self, ctx: Ctx) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, ctx)?);
        Ok(out)
    }

    fn u32(&mut self, ctx: Ctx) -> Result<u32, GgufError> {
        self.bytes(ctx).map(u32::from_le_bytes)
    }

    fn u64(&mut self, ctx: Ctx) -> Result<u64, GgufError> {
        self.bytes(ctx).map(u64::from_le_bytes)
    }

    /// A u64 element count, checked against what `min_elem` bytes per element allows.
    fn count(&mut self, min_elem: usize, ctx: Ctx) -> Result<usize, GgufError> {
        let offset = self.pos as u64;
        let count = self.u64(ctx)?;
        let max = self.left() / min_elem.max(1);
        match usize::try_from(count) {
            Ok(n) if n <= max => Ok(n),
            _ => Err(GgufError::CountTooLarge {
                what: ctx.to_string(),
                offset,
                count,
                left: self.left() as u64,
                max: max as u64,
            }),
        }
    }

    fn string(&mut self, ctx: Ctx) -> Result<String, GgufError> {
        let len = self.count(1, ctx)?;
        let offset = self.pos as u64;
        let bytes = self.take(len, ctx)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(GgufError::InvalidUtf8 { what: ctx.to_string(), offset }),
        }
    }

    /// A value type id, rejected here if unknown so `value` sees only valid ids.
    fn value_type(&mut self, ctx: Ctx) -> Result<u32, GgufError> {
        let offset = self.pos as u64;
        let id = self.u32(ctx)?;
        if id > type_id::F64 {
            return Err(GgufError::BadValueType { what: ctx.to_string(), offset, id });
        }
        Ok(id)
    }

    fn value(&mut self, ty: u32, ctx: Ctx, depth: usize) -> Result<MetaValue, GgufError> {
        Ok(match ty {
            type_id::U8 => MetaValue::U8(u8::from_le_bytes(self.bytes(ctx)?)),
            type_id::I8 => MetaValue::I8(i8::from_le_bytes(self.bytes(ctx)?)),
            type_id::U16 => MetaValue::U16(u16::from_le_bytes(self.bytes(ctx)?)),
            type_id::I16 => MetaValue::I16(i16::from_le_bytes(self.bytes(ctx)?)),
            type_id::U32 => MetaValue::U32(u32::from_le_bytes(self.bytes(ctx)?)),
            type_id::I32 => MetaValue::I32(i32::from_le_bytes(self.bytes(ctx)?)),
            type_id::F32 => MetaValue::F32(f32::from_le_bytes(self.bytes(ctx)?)),
            type_id::U64 => MetaValue::U64(u64::from_le_bytes(self.bytes(ctx)?)),
            type_id::I64 => MetaValue::I64(i64::from_le_bytes(self.bytes(ctx)?)),
            type_id::F64 => MetaValue::F64(f64::from_le_bytes(self.bytes(ctx)?)),
            type_id::BOOL => {
                let offset = self.pos as u64;
                match self.bytes::<1>(ctx)? {
                    [0] => MetaValue::Bool(false),
                    [1] => MetaValue::Bool(true),
                    [byte] => return Err(GgufError::BadBool { what: ctx.to_string(), offset, byte }),
                }
            }
            type_id::STRING => MetaValue::String(self.string(ctx)?),
            type_id::ARRAY => {
                let offset = self.pos as u64;
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::TooDeep { what: ctx.to_string(), offset, max: MAX_ARRAY_DEPTH });
                }
                let elem = self.value_type(ctx)?;
                let min = min_encoded_size(elem).unwrap_or(1);
                let n = self.count(min, ctx)?;
                // `n` is bounded by the bytes left; still, grow rather than reserve, since
                // a MetaValue is larger than the smallest encoded element.
                let mut items = Vec::with_capacity(n.min(1 << 16));
                for _ in 0..n {
                    items.push(self.value(elem, ctx, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            // `value_type` admits only the ids above.
            _ => {
                return Err(GgufError::BadValueType { what: ctx.to_string(), offset: self.pos as u64, id: ty });
            }
        })
    }
}

/// `x` rounded up to a multiple of `align` (a power of two), or `None` on overflow.
pub(crate) fn align_up(x: u64, align: u64) -> Option<u64> {
    x.checked_add(align - 1).map(|v| v & !(align - 1))
}

/// Parses a whole GGUF file held in `buf`.
pub(crate) fn parse(buf: &[u8]) -> Result<Parsed, GgufError> {
    let mut c = Cursor { buf, pos: 0 };
    let magic = c.take(4, Ctx::Header("magic"))?;
    if magic != MAGIC {
        return Err(GgufError::BadMagic { found: format!("\"{}\"", magic.escape_ascii()) });
    }
    let version = c.u32(Ctx::Header("version"))?;
    match version {
        2 | 3 => {}
        v if matches!(v.swap_bytes(), 2 | 3) => return Err(GgufError::BigEndian(v.swap_bytes())),
        v => return Err(GgufError::UnsupportedVersion(v)),
    }
    let tensor_count = c.count(MIN_TENSOR_INFO_BYTES, Ctx::Header("tensor count"))?;
    let kv_count = c.count(MIN_KV_BYTES, Ctx::Header("metadata entry count"))?;

    let mut metadata = BTreeMap::new();
    for i in 0..kv_count {
        let key = c.string(Ctx::KeyName(i))?;
        let ty = c.value_type(Ctx::Value(&key))?;
        let value = c.value(ty, Ctx::Value(&key), 0)?;
        if metadata.contains_key(&key) {
            return Err(GgufError::DuplicateKey(key));
        }
        metadata.insert(key, value);
    }
    let alignment = alignment(&metadata)?;

    let mut tensors = Vec::with_capacity(tensor_count);
    let mut index = HashMap::with_capacity(tensor_count);
    for i in 0..tensor_count {
        let (name, ty, dims, rel_offset, n_bytes) = tensor_info(&mut c, i)?;
        if index.insert(name.clone(), tensors.len()).is_some() {
            return Err(GgufError::DuplicateTensor(name));
        }
        // Absolute offsets are filled in once the data section's start is known.
        tensors.push(TensorInfo { name, ty, dims, offset: rel_offset, n_bytes });
    }

    let data_offset = align_up(c.pos as u64, alignment).ok_or_else(|| GgufError::BadMeta {
        key: ALIGNMENT_KEY.into(),
        reason: format!("aligning the data section start {} to {alignment} overflows", c.pos),
    })?;
    for t in &mut tensors {
        t.offset = place_tensor(t, data_offset, alignment, buf.len())?;
    }
    check_overlaps(&tensors)?;
    Ok(Parsed { version, metadata, tensors, index, alignment, data_offset })
}

/// `general.alignment`, defaulting to 32; must be a power of two.
fn alignment(metadata: &BTreeMap<String, MetaValue>) -> Result<u64, GgufError> {
    let Some(v) = metadata.get(ALIGNMENT_KEY) else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    let bad = |reason: String| GgufError::BadMeta { key: ALIGNMENT_KEY.into(), reason };
    let a = v.as_u64().ok_or_else(|| bad(format!("expected an unsigned integer, found {}", v.type_name())))?;
    if !a.is_power_of_two() {
        return Err(bad(format!("{a} is not a power of two")));
    }
    Ok(a)
}

/// Reads one tensor info: (name, type, dims, relative offset, byte size).
fn tensor_info(c: &mut Cursor, i: usize) -> Result<(String, GgmlType, Vec<u64>, u64, usize), GgufError> {
    let name = c.string(Ctx::TensorName(i))?;
    let bad = |reason: String| GgufError::BadTensor { name: name.clone(), reason };
    let n_dims = c.u32(Ctx::TensorField(&name, "dimension count"))?;
    if n_dims == 0 || n_dims as usize > MAX_DIMS {
        return Err(bad(format!("has {n_dims} dimensions; 1 to {MAX_DIMS} are supported")));
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for _ in 0..n_dims {
        dims.push(c.u64(Ctx::TensorField(&name, "dimensions"))?);
    }
    let type_id = c.u32(Ctx::TensorField(&name, "type"))?;
    let rel_offset = c.u64(Ctx::TensorField(&name, "data offset"))?;

    let ty = GgmlType::from_id(type_id).ok_or_else(|| bad(unknown_type_message(type_id)))?;
    if dims.contains(&0) {
        return Err(bad(format!("has a zero dimension in {dims:?}")));
    }
    let n_elems = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| bad(format!("element count of dimensions {dims:?} overflows")))?;
    // A row (ne0 values) must be whole blocks: kernels address rows by block.
    let block = ty.block_elems() as u64;
    if let Some(&ne0) = dims.first() {
        if ne0 % block != 0 {
            return Err(bad(format!("row length {ne0} is not a multiple of the {ty} block size {block}")));
        }
    }
    let n_bytes = ty.bytes_for(n_elems).ok_or_else(|| bad(format!("byte size of {n_elems} {ty} values overflows")))?;
    Ok((name, ty, dims, rel_offset, n_bytes))
}

/// Checks a tensor's relative offset and returns its absolute one.
fn place_tensor(t: &TensorInfo, data_offset: u64, alignment: u64, file_len: usize) -> Result<u64, GgufError> {
    let bad = |reason: String| GgufError::BadTensor { name: t.name.clone(), reason };
    let rel = t.offset;
    if !rel.is_multiple_of(alignment) {
        return Err(bad(format!("data offset {rel} is not a multiple of the alignment {alignment}")));
    }
    let start = data_offset.checked_add(rel);
    let end = start.and_then(|s| s.checked_add(t.n_bytes as u64));
    match (start, end) {
        (Some(start), Some(end)) if end <= file_len as u64 => Ok(start),
        _ => Err(bad(format!(
            "data ({} bytes at relative offset {rel}, data section at {data_offset}) ends past the end of the {file_len}-byte file",
            t.n_bytes
        ))),
    }
}

/// Rejects tensors whose byte ranges overlap: a writer never produces them, so they mean
/// a corrupt or crafted table.
fn check_overlaps(tensors: &[TensorInfo]) -> Result<(), GgufError> {
    let mut spans: Vec<(u64, u64, &str)> =
        tensors.iter().map(|t| (t.offset, t.offset + t.n_bytes as u64, t.name.as_str())).collect();
    spans.sort_unstable();
    for pair in spans.windows(2) {
        if let [(_, end_a, a), (start_b, _, b)] = pair {
            if start_b < end_a {
                return Err(GgufError::BadTensor {
                    name: (*b).to_owned(),
                    reason: format!("data at offset {start_b} overlaps tensor `{a}`, which ends at {end_a}"),
                });
            }
        }
    }
    Ok(())
}

fn unknown_type_message(id: u32) -> String {
    let known = match id {
        6 => "Q5_0",
        7 => "Q5_1",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        40 => "NVFP4",
        _ => "",
    };
    let supported = "F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K";
    if known.is_empty() {
        format!("unknown tensor type id {id} (supported: {supported})")
    } else {
        format!("tensor type {known} (id {id}) is not supported (supported: {supported})")
    }
}
