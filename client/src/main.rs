//! `sluice`: the command-line client of the sluice daemon.
//!
//! The gRPC service (`sluice.v1.Inference`) is defined in proto/sluice.proto; the daemon
//! does not serve it yet, so this client has no commands yet: `generate`, `chat`, `batch`,
//! `status`, `models` and `tokenize` arrive with the server (see README "Status").

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "Client for the sluice daemon (commands arrive with the gRPC server; see README)"
)]
struct Cli {}

fn main() {
    let _ = Cli::parse();
    // Referencing the generated types keeps the proto crate linked and checked in builds.
    let _ = sluice_proto::v1::GenerateRequest::default();
    eprintln!("sluice: no commands yet; the daemon's gRPC server is not built yet (see README \"Status\")");
    std::process::exit(2);
}
