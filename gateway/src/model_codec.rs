//! The real `Codec`: a thin adapter over tessera-model's `Tokenizer` and `ChatTemplate`.
//!
//! Prompts follow llama.cpp's server: a rendered chat is encoded with `add_special = true`
//! and the template's own leading BOS is stripped when the tokenizer adds one
//! (`ChatTemplate::with_tokenizer_adding_bos`), so a prompt gets exactly one BOS either way.
//!
//! `DecodeStream` borrows its tokenizer, and a stream decoder must outlive any one request,
//! so the codec holds a `&'static Tokenizer`: the tokenizer is loaded once per process and
//! lives as long as it (`ModelCodec::load_gguf` leaks it on purpose).

use std::path::Path;

use tessera_model::chat_template::{self, ChatMessage as TemplateMessage, ChatTemplate, ChatTemplateError};
use tessera_model::gguf::GgufFile;
use tessera_model::tokenizer::{DecodeStream, Tokenizer};

use crate::codec::{ChatMessage, Codec, CodecError, StreamDecoder};
use crate::tools::ToolSyntax;

pub struct ModelCodec {
    name: String,
    tokenizer: &'static Tokenizer,
    /// `None` when the model ships no chat template: chat requests then get 400.
    template: Option<ChatTemplate>,
    /// Whether (and in which syntax) the template renders tool calling itself.
    tool_syntax: Option<ToolSyntax>,
}

#[derive(Debug, thiserror::Error)]
pub enum ModelCodecError {
    #[error("{path}: {reason}")]
    Load { path: String, reason: String },
}

impl ModelCodec {
    /// `template` should be built `with_tokenizer_adding_bos(tokenizer.add_bos_token())`.
    pub fn new(name: &str, tokenizer: &'static Tokenizer, template: Option<ChatTemplate>) -> Self {
        let tool_syntax = template.as_ref().and_then(|t| t.tool_probe()).and_then(|probe| tool_syntax_of(&probe));
        ModelCodec { name: name.to_owned(), tokenizer, template, tool_syntax }
    }

    /// The tokenizer and chat template stored in a GGUF file.
    pub fn load_gguf(path: &Path, name: &str) -> Result<Self, ModelCodecError> {
        let load = |reason: String| ModelCodecError::Load { path: path.display().to_string(), reason };
        let file = GgufFile::open(path).map_err(|e| load(e.to_string()))?;
        let tokenizer: &'static Tokenizer =
            Box::leak(Box::new(Tokenizer::from_gguf(&file).map_err(|e| load(e.to_string()))?));
        let text_of = |id: Option<u32>| id.and_then(|id| tokenizer.token_text(id)).unwrap_or_default().to_owned();
        let template = match chat_template::gguf_chat_template(&file) {
            Some(source) => Some(
                ChatTemplate::new(source, &text_of(tokenizer.bos_token_id()), &text_of(tokenizer.eos_token_id()))
                    .map_err(|e| load(e.to_string()))?
                    .with_tokenizer_adding_bos(tokenizer.add_bos_token()),
            ),
            None => None,
        };
        Ok(ModelCodec::new(name, tokenizer, template))
    }
}

/// The call syntax a tool-rendering template shows in its probe prompt
/// (`ChatTemplate::tool_probe`): the probe's assistant call written as `<tool_call>` JSON
/// (Qwen, Hermes) or as a bare `{"name": ..., "parameters": ...}` object (Llama 3.1/3.2).
/// `None` for any other syntax: the gateway then uses its own fallback format.
pub fn tool_syntax_of(probe: &str) -> Option<ToolSyntax> {
    let call = probe.find("tessera_probe_call")?;
    let before = &probe[..call];
    if before.rfind("<tool_call>").is_some_and(|open| !before[open..].contains("</tool_call>")) {
        return Some(ToolSyntax::Hermes);
    }
    let after = &probe[call..];
    let object = before.rfind('{').is_some_and(|b| before[b..].contains("\"name\""));
    (object && after.contains("\"parameters\"")).then_some(ToolSyntax::Llama3Json)
}

fn template_error(e: ChatTemplateError) -> CodecError {
    match e {
        // The model file's fault, not the request's.
        ChatTemplateError::Syntax(_) => CodecError::Internal(e.to_string()),
        // A template that raises (bad role order) or runs out of fuel on this conversation.
        other => CodecError::Template(other.to_string()),
    }
}

impl Codec for ModelCodec {
    fn model_name(&self) -> &str {
        &self.name
    }

    fn vocab_size(&self) -> u32 {
        u32::try_from(self.tokenizer.vocab_size()).unwrap_or(u32::MAX)
    }

    fn eos_token_ids(&self) -> Vec<u32> {
        self.tokenizer.stop_token_ids().to_vec()
    }

    fn encode_prompt(&self, text: &str, add_special: bool) -> Result<Vec<u32>, CodecError> {
        self.tokenizer.encode(text, add_special, true).map_err(|e| CodecError::Encode(e.to_string()))
    }

    fn render_chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, CodecError> {
        let template =
            self.template.as_ref().ok_or_else(|| CodecError::Template("this model has no chat template".into()))?;
        let messages: Vec<TemplateMessage> =
            messages.iter().map(|m| TemplateMessage::new(m.role.as_str(), m.content.as_str())).collect();
        template.render(&messages, add_generation_prompt).map_err(template_error)
    }

    fn tool_syntax(&self) -> Option<ToolSyntax> {
        self.tool_syntax
    }

    fn render_chat_tools(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, CodecError> {
        let template =
            self.template.as_ref().ok_or_else(|| CodecError::Template("this model has no chat template".into()))?;
        template.render_json(messages, tools, add_generation_prompt).map_err(template_error)
    }

    fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, CodecError> {
        self.tokenizer.decode(ids, skip_special).map_err(|e| CodecError::Decode(e.to_string()))
    }

    fn new_stream_decoder(&self) -> Box<dyn StreamDecoder> {
        Box::new(ModelStreamDecoder(self.tokenizer.decode_stream(true)))
    }

    fn token_bytes(&self, id: u32) -> Result<Vec<u8>, CodecError> {
        self.tokenizer.token_to_piece(id).map_err(|e| CodecError::Decode(e.to_string()))
    }
}

struct ModelStreamDecoder(DecodeStream<'static>);

impl StreamDecoder for ModelStreamDecoder {
    fn push(&mut self, id: u32) -> Result<String, CodecError> {
        self.0.step(id).map_err(|e| CodecError::Decode(e.to_string()))
    }

    fn finish(&mut self) -> String {
        // Flushing only re-decodes ids that were already accepted; a failure here leaves
        // nothing worth reporting over the text already sent.
        self.0.finish().unwrap_or_default()
    }
}
