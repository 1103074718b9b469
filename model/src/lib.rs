//! The model family Tessera serves (Llama 3, Qwen2, Qwen3, SmolLM2): configuration, the
//! GGUF and safetensors readers, the tokenizer and the chat template.

pub mod bundle;
pub mod chat_template;
pub mod config;
pub mod error;
pub mod gguf;
pub mod hf;
pub mod safetensors;
pub mod tokenizer;
pub mod weights;
