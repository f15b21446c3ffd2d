//! The gRPC server: `sluice.v1.Inference` over tonic, with reflection and grpc.health.v1,
//! on TCP and optionally a Unix socket; config from TOML with flags overriding; systemd
//! readiness; SIGTERM drains. Proto types stay in this module (and the client).

pub mod config;
pub mod service;

pub use config::ServeConfig;
