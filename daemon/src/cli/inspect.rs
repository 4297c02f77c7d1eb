//! `spillwayd inspect PATH [--json]`: what a GGUF file holds.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use spillway_daemon::gguf::inspect::Summary;
use spillway_daemon::gguf::GgufFile;

#[derive(Debug, Args)]
pub struct InspectArgs {
    /// The GGUF file.
    pub path: PathBuf,
    /// Print JSON instead of the text report.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &InspectArgs) -> anyhow::Result<()> {
    // Structure only: inspecting a file a model would refuse is how one finds out why.
    let file = GgufFile::open_structure_only(&args.path)
        .with_context(|| format!("reading {}", args.path.display()))?;
    let summary = Summary::new(&args.path.display().to_string(), &file);
    let mut text = String::new();
    if args.json {
        text = serde_json::to_string_pretty(&summary)?;
        text.push('\n');
    } else {
        summary.write_text(&mut text)?;
    }
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(text.as_bytes()) {
        // `spillwayd inspect x | head` closing the pipe is not an error.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other.context("writing to stdout"),
    }
}
