//! Where the daemon listens: a Unix socket (mode 0600, in a directory only the user can enter)
//! by default, or TCP when asked, on loopback unless clients must present a token.

use std::io;
use std::net::SocketAddr;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tokio::net::{TcpListener, UnixListener};

use super::ServeError;

/// A bound listener.
pub enum Listener {
    Unix {
        listener: UnixListener,
        path: PathBuf,
    },
    Tcp(TcpListener),
}

/// Binds the Unix socket at `path`. The parent directory is created with mode 0700 when
/// missing; a socket file left by a daemon that is gone is replaced, one a live daemon answers
/// on is not.
pub async fn bind_unix(path: &Path) -> Result<Listener, ServeError> {
    let err = |source| ServeError::Bind {
        addr: path.display().to_string(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(err)?;
        }
    }
    if path.exists() {
        if tokio::net::UnixStream::connect(path).await.is_ok() {
            return Err(ServeError::AlreadyRunning(path.to_path_buf()));
        }
        std::fs::remove_file(path).map_err(err)?;
    }
    let listener = UnixListener::bind(path).map_err(err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    Ok(Listener::Unix {
        listener,
        path: path.to_path_buf(),
    })
}

/// Binds TCP at `addr`; a non-loopback address needs `has_token` (clients must authenticate).
pub async fn bind_tcp(addr: SocketAddr, has_token: bool) -> Result<Listener, ServeError> {
    if !addr.ip().is_loopback() && !has_token {
        return Err(ServeError::OpenWithoutToken(addr));
    }
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind {
            addr: addr.to_string(),
            source,
        })?;
    Ok(Listener::Tcp(listener))
}

impl Listener {
    /// Where clients reach it, as `spillway --addr` takes it.
    pub fn describe(&self) -> io::Result<String> {
        Ok(match self {
            Listener::Unix { path, .. } => path.display().to_string(),
            Listener::Tcp(l) => format!("http://{}", l.local_addr()?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_public_address_without_a_token_is_refused() {
        let addr: SocketAddr = "0.0.0.0:0".parse().unwrap();
        assert!(matches!(
            bind_tcp(addr, false).await,
            Err(ServeError::OpenWithoutToken(_))
        ));
        assert!(bind_tcp("127.0.0.1:0".parse().unwrap(), false)
            .await
            .is_ok());
    }

    #[tokio::test]
    async fn the_socket_is_private_and_a_stale_one_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/s.sock");
        let first = bind_unix(&path).await.unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let dir_mode = std::fs::metadata(path.parent().unwrap())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(dir_mode & 0o777, 0o700);
        assert!(matches!(
            bind_unix(&path).await,
            Err(ServeError::AlreadyRunning(_))
        ));
        drop(first);
        assert!(bind_unix(&path).await.is_ok(), "a stale socket is replaced");
    }
}
