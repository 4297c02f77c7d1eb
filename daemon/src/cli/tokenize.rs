//! `spillwayd tokenize --model PATH --text S [--json]`: the token ids of a text, with BOS when
//! the model's tokenizer adds one, as llama.cpp's `llama-tokenize` prints them.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use spillway_daemon::gguf::GgufFile;
use spillway_daemon::tokenizer::{EncodeOptions, Tokenizer};

#[derive(Debug, Args)]
pub struct TokenizeArgs {
    /// The GGUF model file (a vocab-only file works too).
    #[arg(long)]
    pub model: PathBuf,
    /// The text to tokenize.
    #[arg(long)]
    pub text: String,
    /// Match special tokens such as `<|im_start|>` in the text.
    #[arg(long)]
    pub parse_special: bool,
    /// Print JSON (ids and the piece of each token) instead of one `id 'piece'` line per token.
    #[arg(long)]
    pub json: bool,
}

#[derive(serde::Serialize)]
struct Token<'a> {
    id: u32,
    piece: std::borrow::Cow<'a, str>,
}

pub fn run(args: TokenizeArgs) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    match write_tokens(&args, &mut stdout) {
        // `spillwayd tokenize .. | head` closing the pipe is not an error.
        Err(e)
            if e.downcast_ref::<std::io::Error>()
                .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe) =>
        {
            Ok(())
        }
        other => other,
    }
}

/// Tokenizes as `run` does, writing the report to `out`.
pub fn write_tokens(args: &TokenizeArgs, out: &mut impl Write) -> anyhow::Result<()> {
    // Structure only: the tokenizer needs metadata, not tensors, so vocab-only files work.
    let file = GgufFile::open_structure_only(&args.model)
        .with_context(|| format!("reading {}", args.model.display()))?;
    let tokenizer = Tokenizer::from_metadata(file.metadata())
        .with_context(|| format!("loading the tokenizer of {}", args.model.display()))?;
    let ids = tokenizer.encode_with(
        &args.text,
        EncodeOptions {
            add_special: true,
            parse_special: args.parse_special,
        },
    );
    let tokens: Vec<Token> = ids
        .iter()
        .map(|&id| Token {
            id,
            piece: String::from_utf8_lossy(tokenizer.token_to_piece(id, true)),
        })
        .collect();

    let mut text = String::new();
    if args.json {
        text = serde_json::to_string_pretty(&serde_json::json!({
            "ids": ids,
            "tokens": tokens,
        }))?;
        text.push('\n');
    } else {
        for t in &tokens {
            text.push_str(&format!("{:6} -> {:?}\n", t.id, t.piece));
        }
    }
    out.write_all(text.as_bytes())?;
    Ok(())
}
