//! Where the daemon listens by default, shared by `spillwayd` and its clients.

use std::path::PathBuf;

/// File name of the daemon's socket.
pub const SOCKET_NAME: &str = "spillway.sock";

/// The default Unix socket: `$XDG_RUNTIME_DIR/spillway.sock`, or `/tmp/spillway-$UID/spillway.sock`
/// when that variable is unset or empty.
pub fn default_socket_path() -> PathBuf {
    default_socket_path_from(std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from))
}

/// [`default_socket_path`] with the runtime directory given (tests, explicit configuration).
pub fn default_socket_path_from(runtime_dir: Option<PathBuf>) -> PathBuf {
    match runtime_dir {
        Some(dir) if !dir.as_os_str().is_empty() => dir.join(SOCKET_NAME),
        _ => fallback_dir().join(SOCKET_NAME),
    }
}

/// `/tmp/spillway-$UID`: private to the user (the daemon creates it with mode 0700).
pub fn fallback_dir() -> PathBuf {
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    PathBuf::from(format!("/tmp/spillway-{uid}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runtime_dir_is_preferred_and_an_empty_one_ignored() {
        let p = default_socket_path_from(Some("/run/user/7".into()));
        assert_eq!(p, PathBuf::from("/run/user/7/spillway.sock"));
        let p = default_socket_path_from(Some("".into()));
        assert!(p.starts_with("/tmp/") && p.ends_with(SOCKET_NAME), "{p:?}");
    }
}
