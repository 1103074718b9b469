//! `tessera gateway`: the OpenAI-compatible HTTP server in front of a coordinator. It
//! owns the tokenizer and chat template (text never goes further). With the mTLS flags
//! (tls.rs) its gRPC link to the coordinator is mutual TLS; its HTTP API stays plain HTTP.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

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
    /// On SIGTERM: seconds the requests in flight may take to finish (new ones get 503
    /// with Retry-After meanwhile) before the gateway exits anyway.
    #[arg(long, env = "TESSERA_DRAIN_TIMEOUT_S", default_value_t = 30)]
    pub drain_timeout_s: u64,
    /// etcd mode (see etcd_cmd.rs): follow the coordinator leader instead of `--coordinator`.
    #[command(flatten)]
    pub etcd: crate::etcd_cmd::EtcdFlags,
    /// Traces and logs.
    #[command(flatten)]
    pub trace_log: crate::trace_logs::TraceLogFlags,
    /// mTLS on the gRPC link to the coordinator (see tls.rs).
    #[command(flatten)]
    pub tls: crate::tls::TlsFlags,
}

pub fn run(args: GatewayArgs) -> Result<()> {
    let _trace = args.trace_log.init("tessera-gateway")?;
    let client_tls = args.tls.load()?.as_ref().map(crate::tls::Tls::client);
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
        // etcd mode: a client of whichever coordinator leads; `_leader` keeps it following.
        let (engine, _leader): (Arc<dyn tessera_gateway::Engine>, _) = if args.etcd.enabled() {
            let (engine, watch) = crate::etcd_cmd::leader_engine(&args.etcd, client_tls).await?;
            (Arc::new(engine), Some(watch))
        } else {
            let engine = GrpcEngine::with_tls(&args.coordinator, client_tls).map_err(|e| anyhow::anyhow!("{e}"))?;
            (Arc::new(engine), None)
        };
        let listener =
            tokio::net::TcpListener::bind(gw.listen).await.with_context(|| format!("binding {}", gw.listen))?;
        println!("tessera gateway listening on {}", listener.local_addr()?);
        let state = tessera_gateway::app::AppState::new(gw, engine, Arc::new(codec))?;
        // SIGTERM: /ready 503 and new requests 503 at once; the server stops when the
        // requests in flight have ended (or the drain timeout passed).
        let shutdown = tessera_gateway::drain::on_signal(
            state.drain(),
            tessera_gateway::serve::shutdown_signal(),
            Duration::from_secs(args.drain_timeout_s),
        );
        tessera_gateway::serve::serve_on(listener, state, shutdown).await?;
        Ok(())
    })
}
