//! GGUF metadata values: the thirteen value types of the format and lenient accessors.
//!
//! Writers disagree on integer widths (one converter stores `block_count` as u32, another
//! as u64), so readers ask for "a non-negative integer" (`as_u64`) rather than a width.

/// One metadata value. Variants follow GGUF's value types; arrays may nest.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// GGUF's value type ids (`gguf_metadata_value_type`).
pub(crate) mod type_id {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

impl MetaValue {
    /// The string, for `String` values.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    /// Any integer value that is >= 0. Floats and bools are not integers here.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer value that fits an i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => i64::try_from(v).ok(),
            Self::I8(v) => Some(v.into()),
            Self::I16(v) => Some(v.into()),
            Self::I32(v) => Some(v.into()),
            Self::I64(v) => Some(v),
            _ => None,
        }
    }

    /// Any integer or float value, as f64 (64-bit integers may round).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            Self::U64(v) => Some(v as f64),
            Self::I64(v) => Some(v as f64),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// The flag, for `Bool` values.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The elements, for `Array` values.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            Self::Array(v) => Some(v),
            _ => None,
        }
    }

    /// GGUF's type id for this value.
    pub fn type_id(&self) -> u32 {
        match self {
            Self::U8(_) => type_id::U8,
            Self::I8(_) => type_id::I8,
            Self::U16(_) => type_id::U16,
            Self::I16(_) => type_id::I16,
            Self::U32(_) => type_id::U32,
            Self::I32(_) => type_id::I32,
            Self::F32(_) => type_id::F32,
            Self::Bool(_) => type_id::BOOL,
            Self::String(_) => type_id::STRING,
            Self::Array(_) => type_id::ARRAY,
            Self::U64(_) => type_id::U64,
            Self::I64(_) => type_id::I64,
            Self::F64(_) => type_id::F64,
        }
    }

    /// A short name for error messages ("u32", "array", ...).
    pub fn type_name(&self) -> &'static str {
        type_name(self.type_id())
    }
}

/// A short name for a value type id ("u32", "array", ...; "unknown" otherwise).
pub(crate) fn type_name(id: u32) -> &'static str {
    match id {
        type_id::U8 => "u8",
        type_id::I8 => "i8",
        type_id::U16 => "u16",
        type_id::I16 => "i16",
        type_id::U32 => "u32",
        type_id::I32 => "i32",
        type_id::F32 => "f32",
        type_id::BOOL => "bool",
        type_id::STRING => "string",
        type_id::ARRAY => "array",
        type_id::U64 => "u64",
        type_id::I64 => "i64",
        type_id::F64 => "f64",
        _ => "unknown",
    }
}

/// Encoded size of one value of a fixed-size type; `None` for string and array, whose
/// size depends on their contents, and for unknown ids.
pub(crate) fn fixed_size(id: u32) -> Option<usize> {
    match id {
        type_id::U8 | type_id::I8 | type_id::BOOL => Some(1),
        type_id::U16 | type_id::I16 => Some(2),
        type_id::U32 | type_id::I32 | type_id::F32 => Some(4),
        type_id::U64 | type_id::I64 | type_id::F64 => Some(8),
        _ => None,
    }
}

/// The fewest bytes one element of type `id` can take: what a claimed element count is
/// checked against before anything is allocated. A string is at least its u64 length;
/// an array at least its element type and count.
pub(crate) fn min_encoded_size(id: u32) -> Option<usize> {
    match id {
        type_id::STRING => Some(8),
        type_id::ARRAY => Some(12),
        _ => fixed_size(id),
    }
}
