//! `spillway-train prepare`: corpus → vocabulary → token files.

use std::path::PathBuf;

use anyhow::{ensure, Context};
use clap::Args;
use spillway_daemon::gguf::writer::GgufWriter;
use spillway_daemon::gguf::{GgufFile, Value};
use spillway_daemon::synth::vocab::learned_byte_level;
use spillway_daemon::tokenizer::Tokenizer;

use crate::corpus::{self, Chapter};

#[derive(Debug, Args)]
pub struct PrepareArgs {
    /// What `bible -l10000 gen1:1-rev22:21` printed.
    #[arg(long)]
    pub bible: PathBuf,
    /// Tokens in the vocabulary, specials included.
    #[arg(long, default_value_t = 4096)]
    pub vocab: u32,
    /// Where `tokenizer.gguf`, `train.u16`, `val.u16` and `val.txt` go.
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(args: &PrepareArgs) -> anyhow::Result<()> {
    let raw = std::fs::read_to_string(&args.bible)
        .with_context(|| format!("reading {}", args.bible.display()))?;
    let chapters = corpus::parse(&raw)?;
    let (mut val, mut train): (Vec<&Chapter>, Vec<&Chapter>) = (Vec::new(), Vec::new());
    for (i, chapter) in chapters.iter().enumerate() {
        if corpus::is_held_out(i) {
            val.push(chapter);
        } else {
            train.push(chapter);
        }
    }
    let train_text: String = train.iter().map(|c| c.text()).collect();
    let val_text: String = val.iter().map(|c| c.text()).collect();

    // The vocabulary is learnt from the training chapters alone.
    let vocab = learned_byte_level(&train_text, args.vocab)?;
    std::fs::create_dir_all(&args.out)?;
    let tok_path = args.out.join("tokenizer.gguf");
    let mut metadata = vec![(
        "general.name".to_string(),
        Value::String("KJV byte-level BPE".into()),
    )];
    metadata.extend(vocab.metadata());
    GgufWriter::create(&tok_path, &metadata, &[])?.finish()?;

    // Tokenized by the engine's own tokenizer, read back from the file, so training sees the
    // ids the engine will produce.
    let file = GgufFile::open_structure_only(&tok_path)?;
    let tokenizer = Tokenizer::from_metadata(file.metadata())?;
    ensure!(
        tokenizer.n_vocab() <= usize::from(u16::MAX),
        "ids must fit u16"
    );
    let mut counts = Vec::new();
    for (name, part) in [("train", &train), ("val", &val)] {
        let mut ids: Vec<u16> = Vec::new();
        for chapter in part.iter() {
            ids.extend(
                tokenizer
                    .encode(&chapter.text(), false)
                    .iter()
                    .map(|&i| i as u16),
            );
        }
        let bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
        std::fs::write(args.out.join(format!("{name}.u16")), bytes)?;
        counts.push(ids.len());
    }
    std::fs::write(args.out.join("val.txt"), &val_text)?;
    std::fs::write(
        args.out.join("vocab.json"),
        serde_json::json!({ "n_vocab": tokenizer.n_vocab() }).to_string(),
    )?;
    println!(
        "{} chapters ({} held out); vocabulary of {} tokens; train {} tokens ({:.2} bytes each), \
         held out {} tokens",
        chapters.len(),
        val.len(),
        tokenizer.n_vocab(),
        counts[0],
        train_text.len() as f64 / counts[0] as f64,
        counts[1],
    );
    Ok(())
}
