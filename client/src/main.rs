//! `spillway`: the command-line client of the Spillway daemon.
//!
//! It will talk to `spillwayd` over gRPC (`spillway.v1`): generate, chat, models, load/unload,
//! ps and profile. The daemon's server does not exist yet, so every command says so and exits
//! with status 2 instead of pretending.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "spillway", version, about = "Client of the Spillway daemon")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt.
    Generate { prompt: String },
    /// List the daemon's models.
    Models,
    /// Show what runs where.
    Ps,
}

fn main() {
    let cli = Cli::parse();
    let what = match cli.command {
        Command::Generate { .. } => "generate",
        Command::Models => "models",
        Command::Ps => "ps",
    };
    eprintln!(
        "spillway {what}: the daemon's gRPC service is not implemented yet; \
         inspect model files with `spillwayd inspect MODEL`"
    );
    std::process::exit(2);
}
