//! One module per group of subcommands.

pub mod chat;
pub mod generate;
pub mod models;
pub mod profile;
