//! Generated gRPC types for `sluice.v1`. Only the server layer and the client use these;
//! the engine works on plain Rust types (DESIGN.md "Server and client").

#![allow(clippy::all)]

pub mod v1 {
    tonic::include_proto!("sluice.v1");
}

/// The encoded `FileDescriptorSet` of `sluice.proto`, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/sluice_descriptor.bin"));
