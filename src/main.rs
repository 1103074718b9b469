//! The `tessera` command: a thin CLI over the crates. Each subcommand's flags are also
//! environment variables.

mod admin;
mod bench;
mod bench_gpu;
mod certs_cmd;
mod coordinator_cmd;
mod default_model;
mod drain;
mod etcd_cmd;
mod gateway_cmd;
mod generate;
#[cfg(test)]
mod readme_commands_tests;
mod serve_cmd;
mod step_split;
mod threads;
mod tls;
#[cfg(test)]
mod tls_link_tests;
mod trace_logs;
mod worker_cmd;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "tessera",
    version,
    about = "An LLM serving cluster for the Llama/Qwen family",
    args_override_self = true
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start a local cluster (gateway, coordinator, workers) serving one model.
    Serve(serve_cmd::ServeArgs),
    /// Run the HTTP gateway (OpenAI API).
    Gateway(gateway_cmd::GatewayArgs),
    /// Run the coordinator.
    Coordinator(coordinator_cmd::CoordinatorArgs),
    /// Generate text from one prompt on the CPU engine.
    Generate(generate::GenerateArgs),
    /// Measure prefill and decode speed (like llama.cpp's llama-bench).
    Bench(bench::BenchArgs),
    /// Run one worker process (gRPC).
    Worker(worker_cmd::WorkerArgs),
    /// Print the path of the default model, fetching it if needed.
    FetchModel,
    /// Make a development CA and certificates for mTLS between the roles.
    Certs(certs_cmd::CertsArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => serve_cmd::run(args),
        Command::Gateway(args) => gateway_cmd::run(args),
        Command::Coordinator(args) => coordinator_cmd::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Worker(args) => worker_cmd::run(args),
        Command::Certs(args) => certs_cmd::run(args),
        Command::FetchModel => {
            println!("{}", default_model::resolve(None)?.display());
            Ok(())
        }
    }
}
