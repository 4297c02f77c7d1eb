//! Generates the tonic/prost code for `spillway.v1` with the protoc shipped by the
//! `protoc-bin-vendored` crate, so no system protoc is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; prost-build reads PROTOC from the environment.
    unsafe { std::env::set_var("PROTOC", protoc) };
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("spillway_descriptor.bin"))
        .compile_protos(&["proto/spillway/v1/spillway.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
