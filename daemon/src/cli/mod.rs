//! The subcommands of `spillwayd`, one file each.

pub mod calibrate;
pub mod devices;
pub mod inspect;
pub mod plan;
pub mod run;
pub mod serve;
pub mod tokenize;
