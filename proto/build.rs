//! Compiles `sluice.proto` with protox (pure Rust), so building needs no `protoc`.
//! The encoded descriptor set is kept in OUT_DIR for server reflection.

use prost::Message;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=sluice.proto");
    let fds = protox::compile(["sluice.proto"], ["."])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out_dir.join("sluice_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
