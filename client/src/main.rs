//! `spillway`: the command-line client of the Spillway daemon, over gRPC (`spillway.v1`).

mod commands;
mod connect;
mod exit;

use std::path::PathBuf;

use clap::{CommandFactory, Parser, Subcommand};

use commands::{chat, generate, models, profile};
use exit::Failure;

#[derive(Parser)]
#[command(
    name = "spillway",
    version,
    about = "Client of the Spillway daemon (spillwayd)",
    after_help = exit::HELP
)]
struct Cli {
    /// The daemon: a Unix socket path or http://HOST:PORT [default: $XDG_RUNTIME_DIR/spillway.sock,
    /// or /tmp/spillway-$UID/spillway.sock; a daemon is started there when none answers].
    #[arg(long, global = true, env = "SPILLWAY_ADDR")]
    addr: Option<String>,
    /// File whose first line is the daemon's bearer token (TCP daemons started with
    /// --token-file).
    #[arg(long, global = true)]
    token_file: Option<PathBuf>,
    /// Never start a daemon; fail when none answers.
    #[arg(long, global = true)]
    no_autostart: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, streamed as it comes.
    Generate(Box<generate::GenerateArgs>),
    /// Chat interactively; the conversation is kept and sent as chat messages.
    Chat(Box<chat::ChatArgs>),
    /// List the loaded models.
    Models,
    /// Load a GGUF model into the daemon, or with --plan print where its tensors would go and
    /// its predicted speed, loading nothing.
    #[command(after_help = "Examples:
  spillway load M.gguf --name moe --device vulkan --vram-budget 6GiB
  spillway load M.gguf --device vulkan --vram-budget 8GiB --plan   # the plan; nothing loads
  spillway load M.gguf --device vulkan --vram-budget 8GiB --plan --json")]
    Load(models::LoadArgs),
    /// Unload a model.
    Unload {
        /// Its name, as `spillway models` lists it.
        name: String,
    },
    /// Show what runs where: per model, device, where the weights live, queue and speed.
    Ps,
    /// Time every layer's op groups over a prompt and some decode steps; print the table,
    /// the totals and the bottleneck (--json for scripts, --trace for Perfetto).
    Profile(Box<profile::ProfileArgs>),
    /// Print shell completions (bash, zsh, fish, elvish, powershell).
    Completions { shell: clap_complete::Shell },
}

fn main() {
    let cli = Cli::parse();
    let code = match run(cli) {
        Ok(()) => exit::OK,
        Err(f) => {
            eprintln!("spillway: {}", f.message);
            f.code
        }
    };
    std::process::exit(code);
}

fn run(cli: Cli) -> Result<(), Failure> {
    if let Command::Completions { shell } = cli.command {
        clap_complete::generate(
            shell,
            &mut Cli::command(),
            "spillway",
            &mut std::io::stdout(),
        );
        return Ok(());
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure::new(exit::FAILED, format!("starting the runtime: {e}")))?;
    runtime.block_on(async {
        let mut client = connect::connect(
            cli.addr.as_deref(),
            cli.token_file.as_deref(),
            !cli.no_autostart,
        )
        .await?;
        let client = &mut client;
        match &cli.command {
            Command::Generate(args) => generate::run(client, args).await,
            Command::Chat(args) => chat::run(client, args).await,
            Command::Models => models::models(client).await,
            Command::Load(args) => models::load(client, args).await,
            Command::Unload { name } => models::unload(client, name).await,
            Command::Ps => models::ps(client).await,
            Command::Profile(args) => profile::run(client, args).await,
            Command::Completions { .. } => unreachable!("handled above"),
        }
    })
}
