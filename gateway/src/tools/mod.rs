//! Tool calling for both APIs (issue 10): the request side (tool definitions and
//! `tool_choice`, validated), rendering tools and tool turns into the prompt (the model's own
//! chat template when it handles tools, else the documented fallback format of
//! docs/tools.md), the grammars that hold calls to their schemas (a forced call, or `auto`
//! with strict tools), and the incremental parser that finds calls in the model's output
//! while it streams.

pub mod anthropic;
pub mod grammar;
pub mod json_scan;
pub mod openai;
pub mod parser;
#[cfg(test)]
#[path = "parser_tests.rs"]
mod parser_tests;
pub mod render;
pub mod spec;
pub mod stream;

pub use parser::{ToolCallParser, ToolEvent, ToolSyntax};
