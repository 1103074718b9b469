//! One module per route group; each handler parses, validates, and hands off to
//! `generate.rs` / `sse.rs`. Errors leave as `ApiError`.

pub mod chat;
pub mod completions;
pub mod messages;
pub mod meta;
pub mod tokenize;
