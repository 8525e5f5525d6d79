//! Compiles `proto/inference.proto` (the Open Inference Protocol's gRPC API)
//! into prost messages and a tonic server. protox parses it in pure Rust, so
//! building needs no `protoc` binary.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const PROTO: &str = "proto/inference.proto";
    println!("cargo:rerun-if-changed={PROTO}");
    let fds = protox::compile([PROTO], ["proto"])?;
    tonic_prost_build::configure()
        // The dispatcher only serves; clients are Python (tritonclient, kserve).
        .build_client(false)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
