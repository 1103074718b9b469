//! The text side of the gateway behind one small trait: chat template, tokenizer and
//! incremental detokenizer. The real implementation is a thin adapter over tessera-model
//! (`model_codec.rs`); tests use `testing::ByteCodec` so the HTTP layer is tested without a
//! model file.

/// One chat message as the template sees it; roles are already validated
/// (`system`, `user`, `assistant`, `tool`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// The chat template rejected the conversation (bad role order, ...): the client's fault.
    #[error("chat template: {0}")]
    Template(String),
    /// Text could not be tokenized.
    #[error("tokenizer: {0}")]
    Encode(String),
    /// Ids could not be turned back into text (an id outside the vocabulary, ...).
    #[error("detokenizer: {0}")]
    Decode(String),
    /// The model's files are at fault (a template that does not compile, ...).
    #[error("{0}")]
    Internal(String),
}

/// Turns the ids of one sequence into text as they arrive. Holds back bytes that do not yet
/// form whole UTF-8 characters (a character may be split over several byte-level tokens).
pub trait StreamDecoder: Send {
    /// The text that `id` completes (often the token's text; empty while a character is open).
    fn push(&mut self, id: u32) -> Result<String, CodecError>;
    /// The text still held back at the end of the sequence (incomplete bytes become U+FFFD).
    fn finish(&mut self) -> String;
}

/// Everything the gateway needs from a model's tokenizer and chat template.
pub trait Codec: Send + Sync + 'static {
    /// The model's name, the default for `model` in requests and `/v1/models`.
    fn model_name(&self) -> &str;
    /// Ids are valid when `< vocab_size()`.
    fn vocab_size(&self) -> u32;
    /// The ids that end a sequence unless `ignore_eos` (EOS, `<|im_end|>`, `<|eot_id|>`, ...).
    fn eos_token_ids(&self) -> Vec<u32>;
    /// Tokenizes a prompt; special tokens written in the text are parsed as such.
    /// `add_special` adds BOS (and EOS where the model wants it); completions prompts and
    /// rendered chats are both encoded with it (see `render_chat`).
    fn encode_prompt(&self, text: &str, add_special: bool) -> Result<Vec<u32>, CodecError>;
    /// Renders a conversation with the model's chat template, for `encode_prompt(text, true)`:
    /// when the tokenizer adds BOS itself, the text leaves the template's BOS out (as
    /// llama.cpp's server does), so the prompt has exactly one.
    fn render_chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, CodecError>;
    /// Decodes a whole sequence; `skip_special` leaves control tokens out.
    fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, CodecError>;
    /// A fresh incremental decoder (special tokens skipped) for one generated sequence.
    fn new_stream_decoder(&self) -> Box<dyn StreamDecoder>;
    /// The raw bytes of one token (for logprobs' `token` and `bytes`); may be part of a
    /// UTF-8 character.
    fn token_bytes(&self, id: u32) -> Result<Vec<u8>, CodecError>;

    // Tool calling (tools/render.rs): a codec whose chat template renders tools itself says
    // so here, with the syntax its model writes calls in; otherwise the gateway renders tools
    // in its own fallback format (docs/tools.md) through `render_chat`.

    /// `Some` when the chat template renders `tools`, `tool_calls` and `tool` turns itself.
    fn tool_syntax(&self) -> Option<crate::tools::ToolSyntax> {
        None
    }

    /// Renders OpenAI-shaped messages (`role`, `content`, `tool_calls`, `tool_call_id`,
    /// `name`) and `tools` through the chat template (only called when `tool_syntax` is
    /// `Some`).
    fn render_chat_tools(
        &self,
        _messages: &serde_json::Value,
        _tools: Option<&serde_json::Value>,
        _add_generation_prompt: bool,
    ) -> Result<String, CodecError> {
        Err(CodecError::Template("this model's chat template does not render tools".into()))
    }
}
