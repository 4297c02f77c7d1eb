//! The one-shot subcommands of `spillwayd`, one file each.

pub mod inspect;
