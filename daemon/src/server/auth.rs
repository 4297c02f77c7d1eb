//! Bearer-token authentication for TCP listeners: every call must carry
//! `authorization: Bearer <token>` with the token from `--token-file`.

use std::sync::Arc;

use tonic::{Request, Status};

/// Checks the `authorization` header of every call against a shared token.
#[derive(Clone)]
pub struct BearerAuth {
    token: Option<Arc<str>>,
}

impl BearerAuth {
    /// `None`: every call is let through (Unix socket, loopback without a token).
    pub fn new(token: Option<String>) -> BearerAuth {
        BearerAuth {
            token: token.map(Arc::from),
        }
    }

    #[allow(clippy::result_large_err)] // tonic's interceptor signature
    pub fn check(&self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(expected) = &self.token else {
            return Ok(request);
        };
        let given = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        match given {
            Some(token) if constant_time_eq(token.as_bytes(), expected.as_bytes()) => Ok(request),
            Some(_) => Err(Status::unauthenticated(
                "the bearer token is wrong; use the token in the daemon's --token-file",
            )),
            None => Err(Status::unauthenticated(
                "this daemon needs `authorization: Bearer <token>`; pass --token-file to spillway",
            )),
        }
    }
}

/// Reads a token file: its first line, trimmed; an empty token is an error.
pub fn read_token_file(path: &std::path::Path) -> std::io::Result<String> {
    let text = std::fs::read_to_string(path)?;
    let token = text.lines().next().unwrap_or("").trim().to_string();
    if token.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "the token file is empty",
        ));
    }
    Ok(token)
}

/// Compares without stopping at the first difference, so timing does not leak the prefix.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(header: Option<&str>) -> Request<()> {
        let mut r = Request::new(());
        if let Some(h) = header {
            r.metadata_mut().insert("authorization", h.parse().unwrap());
        }
        r
    }

    #[test]
    fn only_the_right_bearer_token_passes() {
        let auth = BearerAuth::new(Some("s3cret".into()));
        assert!(auth.check(call(Some("Bearer s3cret"))).is_ok());
        for bad in [
            None,
            Some("Bearer s3cre"),
            Some("Bearer s3cretX"),
            Some("s3cret"),
        ] {
            let e = auth.check(call(bad)).unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unauthenticated, "{bad:?}");
        }
        assert!(BearerAuth::new(None).check(call(None)).is_ok());
    }
}
