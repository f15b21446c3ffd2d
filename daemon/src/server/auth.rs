//! Access control: API keys checked on both wires (HTTP `Authorization: Bearer KEY`, gRPC
//! `authorization` metadata with the same value), compared in constant time; and the rule
//! that a daemon listening beyond loopback without a key refuses to start unless told
//! that is meant.

use super::api::{ApiError, ErrorKind};
use super::metrics::{Api, Metrics};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

/// The keys a request may present; empty: no authentication.
#[derive(Clone, Default)]
pub struct ApiKeys {
    keys: Vec<Vec<u8>>,
}

/// Equal contents in time that depends only on the lengths (a key's length is not the
/// secret; its bytes are).
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y));
    // Keep the compiler from turning the fold into an early exit.
    std::hint::black_box(diff) == 0
}

impl ApiKeys {
    /// `key` (from --api-key or SLUICE_API_KEY) and the keys of `file`, one per line
    /// (blank lines and `#` comments skipped).
    pub fn load(key: Option<&str>, file: Option<&Path>) -> Result<ApiKeys, String> {
        let mut keys = Vec::new();
        if let Some(k) = key {
            keys.push(k.to_string());
        }
        if let Some(f) = file {
            let text = std::fs::read_to_string(f)
                .map_err(|e| format!("api_key_file {}: {e}", f.display()))?;
            keys.extend(
                text.lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(str::to_string),
            );
            if keys.is_empty() {
                return Err(format!("api_key_file {} holds no key", f.display()));
            }
        }
        for k in &keys {
            if k.len() < 16 || k.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(
                    "an API key must be at least 16 characters with no spaces or control characters (e.g. `openssl rand -hex 24`)"
                        .into(),
                );
            }
        }
        Ok(ApiKeys {
            keys: keys.into_iter().map(String::into_bytes).collect(),
        })
    }

    pub fn enabled(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Checks an `Authorization` value: `Bearer KEY` with one of the keys.
    pub fn check(&self, authorization: Option<&[u8]>) -> Result<(), ApiError> {
        if self.keys.is_empty() {
            return Ok(());
        }
        let unauth = |m: &str| Err(ApiError::new(ErrorKind::Unauthenticated, m));
        let Some(v) = authorization else {
            return unauth("no API key: send `Authorization: Bearer KEY` (gRPC: `authorization` metadata; the sluice CLI: --api-key or SLUICE_API_KEY)");
        };
        let token = match v.get(..7) {
            Some(p) if p.eq_ignore_ascii_case(b"bearer ") => v[7..].trim_ascii(),
            _ => return unauth("the authorization header must be `Bearer KEY`"),
        };
        // Every key is compared, so the time does not say which one matched.
        let ok = self.keys.iter().fold(false, |ok, k| ct_eq(k, token) | ok);
        if ok {
            Ok(())
        } else {
            unauth("the API key is not valid")
        }
    }
}

/// Refuses addresses beyond loopback without a key, unless `insecure` says it is meant.
pub fn check_exposure(addrs: &[SocketAddr], keys: &ApiKeys, insecure: bool) -> Result<(), String> {
    if keys.enabled() || insecure {
        return Ok(());
    }
    match addrs.iter().find(|a| !a.ip().is_loopback()) {
        Some(a) => Err(format!(
            "{a} is reachable beyond this machine and no API key is set: pass --api-key KEY (or api_key_file in the config), or --insecure-no-auth if anyone who can reach {a} may use the model"
        )),
        None => Ok(()),
    }
}

/// The gRPC side: an interceptor on the services that need a key.
#[derive(Clone)]
pub struct GrpcAuth {
    pub keys: Arc<ApiKeys>,
    pub metrics: Arc<Metrics>,
}

impl tonic::service::Interceptor for GrpcAuth {
    fn call(&mut self, req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let v = req.metadata().get("authorization").map(|v| v.as_bytes());
        match self.keys.check(v) {
            Ok(()) => Ok(req),
            Err(e) => {
                self.metrics.request(Api::Grpc, e.kind.outcome());
                Err(tonic::Status::unauthenticated(e.message))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked_whole_and_only_as_bearer_tokens() {
        let k = ApiKeys::load(Some("0123456789abcdef-key"), None).expect("a valid key");
        assert!(k.check(Some(b"Bearer 0123456789abcdef-key")).is_ok());
        assert!(k.check(Some(b"bearer 0123456789abcdef-key ")).is_ok());
        for bad in [
            &b"Bearer 0123456789abcdef-ke"[..],
            b"Bearer 0123456789abcdef-key2",
            b"0123456789abcdef-key",
            b"Basic 0123456789abcdef-key",
            b"Bearer",
        ] {
            let e = k.check(Some(bad)).expect_err("a wrong key");
            assert_eq!(e.kind, ErrorKind::Unauthenticated);
        }
        assert!(k.check(None).is_err());
        assert!(ApiKeys::default().check(None).is_ok());
        assert!(ApiKeys::load(Some("short"), None).is_err());
        let lo: SocketAddr = "127.0.0.1:1".parse().expect("addr");
        let any: SocketAddr = "0.0.0.0:1".parse().expect("addr");
        assert!(check_exposure(&[lo], &ApiKeys::default(), false).is_ok());
        assert!(check_exposure(&[lo, any], &ApiKeys::default(), false).is_err());
        assert!(check_exposure(&[any], &ApiKeys::default(), true).is_ok());
        assert!(check_exposure(&[any], &k, false).is_ok());
    }
}
