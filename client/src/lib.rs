//! Typed client for `sluice.v1.Inference`: connects over TCP (`http://host:port`) or a Unix
//! socket (`unix:/path`).

// Input from outside (files, requests, the disk) never meets an unwrap or expect here: an
// `expect` on a true invariant carries an #[allow] saying why it holds.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

use pb::inference_client::InferenceClient;
pub use sluice_proto::v1 as pb;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint, Uri};

pub const DEFAULT_ADDR: &str = "http://127.0.0.1:50051";

/// The address from `--addr`, else SLUICE_ADDR, else the default.
pub fn resolve_addr(flag: Option<&str>) -> String {
    flag.map(str::to_string)
        .or_else(|| std::env::var("SLUICE_ADDR").ok())
        .unwrap_or_else(|| DEFAULT_ADDR.to_string())
}

/// Where the daemon is and the key to show it.
#[derive(Clone, Debug)]
pub struct Target {
    pub addr: String,
    /// Sent as `authorization: Bearer KEY` on every call.
    pub api_key: Option<String>,
}

/// Adds the key to every call.
#[derive(Clone)]
pub struct Auth(Option<MetadataValue<Ascii>>);

impl tonic::service::Interceptor for Auth {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

pub type Client = InferenceClient<InterceptedService<Channel, Auth>>;

pub async fn connect(target: &Target) -> anyhow::Result<Client> {
    let auth =
        match &target.api_key {
            Some(k) => Some(format!("Bearer {k}").parse().map_err(|_| {
                anyhow::anyhow!("the API key has characters a header cannot carry")
            })?),
            None => None,
        };
    let addr = target.addr.as_str();
    let channel = if let Some(path) = addr.strip_prefix("unix:") {
        let path = std::path::PathBuf::from(path);
        // The URI is a placeholder: the connector dials the socket.
        Endpoint::try_from("http://[::1]:50051")?
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move {
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                        tokio::net::UnixStream::connect(path).await?,
                    ))
                }
            }))
            .await
            .map_err(|e| anyhow::anyhow!("connect to {addr}: {e}"))?
    } else {
        let uri = if addr.contains("://") {
            addr.to_string()
        } else {
            format!("http://{addr}")
        };
        Endpoint::from_shared(uri.clone())?
            .connect()
            .await
            .map_err(|e| {
                anyhow::anyhow!("connect to {uri}: {e}; is sluiced serve running there?")
            })?
    };
    Ok(InferenceClient::with_interceptor(channel, Auth(auth)).max_decoding_message_size(64 << 20))
}

/// The model's reasoning as it streams (gpt-oss's analysis channel): on stderr, dimmed
/// on a terminal, apart from the answer on stdout.
pub fn show_reasoning(r: &str) {
    use std::io::{IsTerminal, Write};
    if r.is_empty() {
        return;
    }
    let mut e = std::io::stderr().lock();
    let _ = if e.is_terminal() {
        write!(e, "\x1b[2m{r}\x1b[0m")
    } else {
        write!(e, "{r}")
    };
    let _ = e.flush();
}
