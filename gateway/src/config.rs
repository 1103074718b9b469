//! `GatewayConfig`: what the binary's flags resolve to, validated once before serving.

use std::net::SocketAddr;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Where `serve` listens.
    pub listen: SocketAddr,
    /// The name clients put in `model`; `None` = the codec's model name.
    pub served_model_name: Option<String>,
    /// Accepted `Authorization: Bearer` keys; empty = no authentication.
    pub api_keys: Vec<String>,
    /// Request bodies over this many bytes get 413.
    pub max_body_bytes: usize,
    /// The model's context: prompt tokens + max_tokens must fit.
    pub max_model_len: u32,
    /// Prompts longer than this get 400 (at most `max_model_len - 1`).
    pub max_prompt_tokens: u32,
    /// The default `max_tokens` cap; `None` = whatever fits in the context (vLLM's default).
    pub default_max_tokens: Option<u32>,
    /// Sequences one request may start (`n` times the number of prompts).
    pub max_choices: u32,
    /// Interval of SSE keep-alive comments on quiet streams.
    pub keep_alive: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("max_model_len must be at least 2, got {0}")]
    ModelLen(u32),
    #[error("max_prompt_tokens must be between 1 and max_model_len - 1 ({max}), got {got}")]
    PromptTokens { got: u32, max: u32 },
    #[error("default_max_tokens must be at least 1")]
    DefaultMaxTokens,
    #[error("max_choices must be at least 1")]
    MaxChoices,
    #[error("max_body_bytes must be at least 1024, got {0}")]
    BodyBytes(usize),
    #[error("API keys must not be empty or contain whitespace")]
    ApiKey,
}

impl GatewayConfig {
    /// Defaults for a model with a context of `max_model_len` tokens.
    pub fn new(max_model_len: u32) -> Self {
        GatewayConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8000)),
            served_model_name: None,
            api_keys: Vec::new(),
            max_body_bytes: 8 << 20,
            max_model_len,
            max_prompt_tokens: max_model_len.saturating_sub(1),
            default_max_tokens: None,
            max_choices: 16,
            keep_alive: Duration::from_secs(15),
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_model_len < 2 {
            return Err(ConfigError::ModelLen(self.max_model_len));
        }
        let max = self.max_model_len - 1;
        if self.max_prompt_tokens == 0 || self.max_prompt_tokens > max {
            return Err(ConfigError::PromptTokens { got: self.max_prompt_tokens, max });
        }
        if self.default_max_tokens == Some(0) {
            return Err(ConfigError::DefaultMaxTokens);
        }
        if self.max_choices == 0 {
            return Err(ConfigError::MaxChoices);
        }
        if self.max_body_bytes < 1024 {
            return Err(ConfigError::BodyBytes(self.max_body_bytes));
        }
        if self.api_keys.iter().any(|k| k.is_empty() || k.chars().any(char::is_whitespace)) {
            return Err(ConfigError::ApiKey);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_each_bad_field_is_named() {
        assert_eq!(GatewayConfig::new(4096).validate(), Ok(()));
        assert_eq!(GatewayConfig::new(1).validate(), Err(ConfigError::ModelLen(1)));
        let bad = |f: fn(&mut GatewayConfig)| {
            let mut c = GatewayConfig::new(4096);
            f(&mut c);
            c.validate()
        };
        assert_eq!(bad(|c| c.max_prompt_tokens = 4096), Err(ConfigError::PromptTokens { got: 4096, max: 4095 }));
        assert_eq!(bad(|c| c.max_prompt_tokens = 0), Err(ConfigError::PromptTokens { got: 0, max: 4095 }));
        assert_eq!(bad(|c| c.default_max_tokens = Some(0)), Err(ConfigError::DefaultMaxTokens));
        assert_eq!(bad(|c| c.max_choices = 0), Err(ConfigError::MaxChoices));
        assert_eq!(bad(|c| c.max_body_bytes = 10), Err(ConfigError::BodyBytes(10)));
        assert_eq!(bad(|c| c.api_keys = vec!["a b".into()]), Err(ConfigError::ApiKey));
        assert_eq!(bad(|c| c.api_keys = vec![String::new()]), Err(ConfigError::ApiKey));
    }
}
