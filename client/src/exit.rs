//! Exit codes, one per kind of failure a person or a script acts on differently. `spillway
//! --help` lists them.

use tonic::Code;

pub const OK: i32 = 0;
/// Anything not listed below (an internal error of the daemon, a broken stream).
pub const FAILED: i32 = 1;
/// Bad command line (clap's own code), unreadable token file.
pub const USAGE: i32 = 2;
/// No daemon could be reached or started.
pub const UNREACHABLE: i32 = 3;
/// The daemon refused the request as given: invalid argument, unknown model, name taken.
pub const REFUSED: i32 = 4;
/// The daemon is busy (queue full) or shutting down: retry later.
pub const BUSY: i32 = 5;
/// Authentication failed: wrong or missing token.
pub const UNAUTHENTICATED: i32 = 6;
/// The request ran out of time (`--timeout`).
pub const TIMED_OUT: i32 = 7;

/// Text for `spillway --help`.
pub const HELP: &str = "Exit codes:
  0  success
  1  other failure (internal error of the daemon, broken stream)
  2  bad command line or token file
  3  no daemon could be reached or started
  4  the daemon refused the request (invalid argument, unknown model, name taken)
  5  the daemon is busy (queue full) or shutting down: retry later
  6  authentication failed (wrong or missing --token-file)
  7  the request ran out of time (--timeout)";

/// A failure with the message to print and the exit code.
#[derive(Debug)]
pub struct Failure {
    pub code: i32,
    pub message: String,
}

impl Failure {
    pub fn new(code: i32, message: impl Into<String>) -> Failure {
        Failure {
            code,
            message: message.into(),
        }
    }

    pub fn usage(message: impl Into<String>) -> Failure {
        Failure::new(USAGE, message)
    }

    pub fn unreachable(message: impl Into<String>) -> Failure {
        Failure::new(UNREACHABLE, message)
    }
}

impl From<tonic::Status> for Failure {
    fn from(s: tonic::Status) -> Failure {
        let code = match s.code() {
            Code::InvalidArgument
            | Code::NotFound
            | Code::AlreadyExists
            | Code::FailedPrecondition
            | Code::OutOfRange
            | Code::Unimplemented => REFUSED,
            Code::ResourceExhausted | Code::Unavailable | Code::Aborted => BUSY,
            Code::Unauthenticated | Code::PermissionDenied => UNAUTHENTICATED,
            Code::DeadlineExceeded => TIMED_OUT,
            _ => FAILED,
        };
        let message = if s.message().is_empty() {
            format!("the daemon answered {:?}", s.code())
        } else {
            s.message().to_string()
        };
        Failure::new(code, message)
    }
}

impl From<std::io::Error> for Failure {
    fn from(e: std::io::Error) -> Failure {
        Failure::new(FAILED, e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_distinct_documented_codes() {
        let code = |c| Failure::from(tonic::Status::new(c, "x")).code;
        assert_eq!(code(Code::InvalidArgument), REFUSED);
        assert_eq!(code(Code::ResourceExhausted), BUSY);
        assert_eq!(code(Code::Unauthenticated), UNAUTHENTICATED);
        assert_eq!(code(Code::DeadlineExceeded), TIMED_OUT);
        assert_eq!(code(Code::Internal), FAILED);
        for c in [
            OK,
            FAILED,
            USAGE,
            UNREACHABLE,
            REFUSED,
            BUSY,
            UNAUTHENTICATED,
            TIMED_OUT,
        ] {
            assert!(
                HELP.contains(&format!("  {c}  ")),
                "exit code {c} is documented"
            );
        }
    }
}
