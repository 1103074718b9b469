//! `tessera gateway`: the OpenAI-compatible HTTP server in front of a coordinator. It
//! owns the tokenizer and chat template (text never goes further).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use tessera_gateway::config::GatewayConfig;
use tessera_gateway::grpc_engine::GrpcEngine;
use tessera_gateway::model_codec::ModelCodec;
use tessera_model::bundle::ModelBundle;

/// Run the HTTP gateway.
#[derive(Debug, Args)]
pub struct GatewayArgs {
    /// Address to serve HTTP on.
    #[arg(long, env = "TESSERA_LISTEN", default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,
    /// The coordinator's gRPC address.
    #[arg(long, env = "TESSERA_COORDINATOR", default_value = "127.0.0.1:50050")]
    pub coordinator: String,
    /// Model path (for its tokenizer and chat template); the default model when absent.
    #[arg(long, env = "TESSERA_MODEL")]
    pub model: Option<PathBuf>,
    /// Name clients use in `model` (default: the file name).
    #[arg(long, env = "TESSERA_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// API keys accepted as `Authorization: Bearer KEY`, comma separated; none means open.
    #[arg(long, env = "TESSERA_API_KEY", value_delimiter = ',')]
    pub api_key: Vec<String>,
    /// Largest request body in bytes.
    #[arg(long, env = "TESSERA_MAX_BODY_BYTES", default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
    /// Longest context served (default: the model's).
    #[arg(long, env = "TESSERA_MAX_MODEL_LEN")]
    pub max_model_len: Option<u32>,
}

pub fn run(args: GatewayArgs) -> Result<()> {
    let path = crate::default_model::resolve(args.model.as_deref())?;
    let bundle = ModelBundle::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let config = bundle.files.config()?;
    let template = bundle.chat_template().ok();
    let name = args.served_model_name.clone().unwrap_or_else(|| crate::default_model::served_name(&path));
    // One tokenizer per process, shared by every request for the process's lifetime.
    let tokenizer = Box::leak(Box::new(bundle.tokenizer));
    let codec = ModelCodec::new(&name, tokenizer, template);
    let model_len = config.max_position as u32;
    let mut gw = GatewayConfig::new(args.max_model_len.map_or(model_len, |m| m.min(model_len)));
    gw.listen = args.listen;
    gw.served_model_name = Some(name);
    gw.api_keys = args.api_key.into_iter().filter(|k| !k.is_empty()).collect();
    gw.max_body_bytes = args.max_body_bytes;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let engine = GrpcEngine::new(&args.coordinator).map_err(|e| anyhow::anyhow!("{e}"))?;
        let listener =
            tokio::net::TcpListener::bind(gw.listen).await.with_context(|| format!("binding {}", gw.listen))?;
        println!("tessera gateway listening on {}", listener.local_addr()?);
        let state = tessera_gateway::app::AppState::new(gw, Arc::new(engine), Arc::new(codec))?;
        tessera_gateway::serve::serve_on(listener, state, tessera_gateway::serve::shutdown_signal()).await?;
        Ok(())
    })
}
