//! A model ready for text: its files, its tokenizer and its chat template, found the same
//! way whatever the format (GGUF metadata, or a Hugging Face directory's tokenizer.json
//! and tokenizer_config.json). What the CLI and the gateway open.

use std::path::Path;
use std::sync::Arc;

use crate::chat_template::{gguf_chat_template, ChatTemplate, ChatTemplateError};
use crate::error::ModelError;
use crate::tokenizer::{Tokenizer, TokenizerError};
use crate::weights::ModelFiles;

/// What can fail when opening a model for text.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] TokenizerError),
    #[error("chat template: {0}")]
    ChatTemplate(#[from] ChatTemplateError),
    #[error("{0}")]
    Missing(String),
}

/// A model's files with its tokenizer.
pub struct ModelBundle {
    pub files: Arc<ModelFiles>,
    pub tokenizer: Tokenizer,
    /// The model's own chat template source, if it has one.
    pub chat_template_source: Option<String>,
}

impl ModelBundle {
    /// Opens a GGUF file or a Hugging Face directory.
    pub fn open(path: &Path) -> Result<Self, BundleError> {
        let files = Arc::new(ModelFiles::open(path)?);
        Self::from_files(files)
    }

    /// Builds the tokenizer and finds the chat template of already opened files.
    pub fn from_files(files: Arc<ModelFiles>) -> Result<Self, BundleError> {
        let (tokenizer, source) = match files.as_ref() {
            ModelFiles::Gguf(g) => (Tokenizer::from_gguf(g)?, gguf_chat_template(g).map(str::to_string)),
            ModelFiles::SafeTensors(hf) => {
                let path =
                    hf.dir.tokenizer_json.as_ref().ok_or_else(|| {
                        BundleError::Missing(format!("{} has no tokenizer.json", hf.dir.dir.display()))
                    })?;
                (Tokenizer::from_hf_file(path)?, hf.dir.tokenizer_config.chat_template.clone())
            }
        };
        Ok(ModelBundle { files, tokenizer, chat_template_source: source })
    }

    /// The compiled chat template, with the model's BOS/EOS texts.
    pub fn chat_template(&self) -> Result<ChatTemplate, BundleError> {
        let source = self
            .chat_template_source
            .as_deref()
            .ok_or_else(|| BundleError::Missing("the model has no chat template".into()))?;
        let text = |id: Option<u32>| id.and_then(|i| self.tokenizer.token_text(i)).unwrap_or("").to_string();
        let bos = text(self.tokenizer.bos_token_id());
        let eos = text(self.tokenizer.eos_token_id());
        Ok(ChatTemplate::new(source, &bos, &eos)?.with_tokenizer_adding_bos(self.tokenizer.add_bos_token()))
    }
}
