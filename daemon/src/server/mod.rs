//! The daemon's wires: gRPC (`sluice.v1.Inference` over tonic, with reflection and
//! grpc.health.v1) and the OpenAI-compatible HTTP API (axum), both on one scheduler, with
//! one request validation (`api.rs`), API keys (`auth.rs`) and Prometheus metrics; config
//! from TOML with flags overriding. Proto types stay in `service.rs` (and the client),
//! OpenAI's JSON in `openai.rs` and `http.rs`.

// Input from outside (files, requests, the disk) never meets an unwrap or expect here: an
// `expect` on a true invariant carries an #[allow] saying why it holds.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod api;
pub mod auth;
pub mod config;
#[cfg(any(test, feature = "fuzz"))]
pub mod fuzz;
pub mod http;
pub mod metrics;
pub mod models;
pub mod openai;
pub mod service;

pub use config::ServeConfig;
