//! The trace and log flags every role takes (`--otlp-endpoint`, `--log-format`,
//! `--log-level`), and their setup at the start of a role's `run`. `tessera serve` hands
//! them to its children through the environment, so a restarted worker gets them too.

use anyhow::{Context, Result};
use clap::Args;
use tessera_telemetry::logs::{self, LogFormat};
use tessera_telemetry::trace::{self, TraceGuard};

const ENDPOINT_ENV: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
const FORMAT_ENV: &str = "TESSERA_LOG_FORMAT";
const LEVEL_ENV: &str = "RUST_LOG";

/// Traces (OpenTelemetry, OTLP/HTTP) and logs (stderr).
#[derive(Debug, Clone, Args)]
pub struct TraceLogFlags {
    /// OTLP/HTTP collector to send traces to (its base URL, e.g. http://127.0.0.1:4318;
    /// spans go to <URL>/v1/traces). Tracing is off when absent. The standard OTEL_BSP_*
    /// and OTEL_TRACES_SAMPLER variables tune batching and sampling.
    #[arg(long, env = ENDPOINT_ENV)]
    pub otlp_endpoint: Option<String>,
    /// Log lines on stderr: `text`, or `json` (one object per line, with `trace_id` and
    /// `span_id` inside a traced request).
    #[arg(long, env = FORMAT_ENV, default_value = "text")]
    pub log_format: LogFormat,
    /// Which log lines to keep, in RUST_LOG syntax (`info`, `warn,tessera_gateway=debug`).
    /// The default leaves out tower-http's per-response lines (the gateway logs one line
    /// per generation request itself; `/ready` polls would flood them).
    #[arg(long, env = LEVEL_ENV, default_value = "info,tower_http=off")]
    pub log_level: String,
}

impl TraceLogFlags {
    /// Installs the logger and, with an endpoint, the trace exporter for `service`
    /// (`tessera-gateway`, ...). Keep the guard until the role exits: dropping it flushes
    /// the spans still queued.
    pub fn init(&self, service: &'static str) -> Result<TraceGuard> {
        logs::init(self.log_format, &self.log_level).context("setting up logs")?;
        trace::init(service, self.otlp_endpoint.as_deref()).context("setting up traces")
    }

    /// Puts these settings in this process's environment, which child processes inherit.
    /// Call before any other thread starts (environment writes are not thread safe).
    pub fn export_to_children(&self) {
        if let Some(e) = &self.otlp_endpoint {
            std::env::set_var(ENDPOINT_ENV, e);
        }
        std::env::set_var(FORMAT_ENV, self.log_format.to_string());
        std::env::set_var(LEVEL_ENV, &self.log_level);
    }
}
