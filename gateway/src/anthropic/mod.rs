//! Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`): wire types, the
//! translation of a request onto the chat path (template, sampling, stop strings), the error
//! shape and the SSE event sequence. Generation itself is the chat path's (`generate.rs`).
//! Tool calling (`tools`, `tool_choice`, `tool_use` / `tool_result` blocks, `tool_use` stop
//! reason and streamed `input_json_delta`) lives in `tools/`; images are refused with a 400.

pub mod convert;
pub mod errors;
pub mod stream;
pub mod types;
