//! Compiles Ferry's internal gRPC interface (`proto/`) with protox, a protobuf compiler in
//! Rust, so a fresh machine needs no `protoc`. The encoded descriptors are kept for server
//! reflection.

use prost::Message;
use std::path::PathBuf;

const PROTOS: [&str; 2] = [
    "ferry/provisioning/v1/provisioning.proto",
    "ferry/delivery/v1/promotions.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../proto");
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={}", root.join(proto).display());
    }
    let descriptors = protox::compile(PROTOS, [&root])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("ferry_descriptors.bin"),
        descriptors.encode_to_vec(),
    )?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
