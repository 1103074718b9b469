//! Compiles the .proto contracts into Rust with tonic-prost-build (needs `protoc`).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=worker.proto");
    println!("cargo:rerun-if-changed=coordinator.proto");
    tonic_prost_build::configure().compile_protos(&["worker.proto", "coordinator.proto"], &["."])?;
    Ok(())
}
