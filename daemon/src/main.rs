//! `spillwayd`: the Spillway daemon and its one-shot commands.

mod cli;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(version, about = "The Spillway daemon and its one-shot commands")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon: serve models over gRPC until SIGTERM.
    Serve(Box<cli::serve::ServeArgs>),
    /// Summarise a GGUF file: architecture, hyper-parameters, tokenizer, tensors.
    Inspect(cli::inspect::InspectArgs),
    /// Run one generation on the CPU engine or a Vulkan GPU, without a server.
    Run(Box<cli::run::RunArgs>),
    /// Print the token ids of a text under a model's tokenizer.
    Tokenize(cli::tokenize::TokenizeArgs),
    /// List the Vulkan devices.
    Devices(cli::devices::DevicesArgs),
    /// Print where each tensor would go under memory budgets, and the predicted decode speed.
    Plan(cli::plan::PlanArgs),
    /// Measure this machine's GPU, CPU, memory and disk into a hardware profile for `plan`.
    Calibrate(cli::calibrate::CalibrateArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Serve(args) => cli::serve::run(*args),
        Command::Inspect(args) => cli::inspect::run(&args),
        Command::Run(args) => cli::run::run(*args),
        Command::Tokenize(args) => cli::tokenize::run(args),
        Command::Devices(args) => cli::devices::run(&args),
        Command::Plan(args) => cli::plan::run(&args),
        Command::Calibrate(args) => cli::calibrate::run(&args),
    }
}
