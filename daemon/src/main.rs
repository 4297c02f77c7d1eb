//! `spillwayd`: the Spillway daemon and its one-shot commands.

fn main() -> anyhow::Result<()> {
    Ok(())
}
