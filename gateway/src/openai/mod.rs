//! OpenAI's wire types (and vLLM's extensions), as plain serde structs: requests keep numbers
//! wide (`i64`, `f64`) and polymorphic fields as `serde_json::Value` so `validate.rs` can name
//! the offending field in its errors; responses serialize exactly to OpenAI's shapes.

pub mod chat;
pub mod common;
pub mod completions;
pub mod extra;
