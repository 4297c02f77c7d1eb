//! `spillway-train`: the Rust half of making the embedded default model.
//!
//! - `prepare` turns the King James Bible (as Debian's `bible-kjv` prints it) into a clean
//!   corpus, learns a byte-level BPE vocabulary from it, and tokenizes it with the engine's own
//!   tokenizer into training and held-out token files for `train.py`.
//! - `export` reads the weights `train.py` wrote (safetensors, f32) and writes a quantized
//!   `qwen3moe` GGUF with the vocabulary, through the project's GGUF writer.

mod corpus;
mod export;
mod prepare;
mod safetensors;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "spillway-train",
    about = "Prepare data for and export the default model"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Clean the corpus, learn the vocabulary, write token files.
    Prepare(prepare::PrepareArgs),
    /// Write the trained weights as a GGUF model.
    Export(export::ExportArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Prepare(args) => prepare::run(&args),
        Command::Export(args) => export::run(&args),
    }
}
