//! Compiles the address-steering BPF program (`bpf/steer.bpf.c`) with
//! clang; the parent embeds the object and loads it at start.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let source = "bpf/steer.bpf.c";
    println!("cargo:rerun-if-changed={source}");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let object = out.join("steer.bpf.o");
    // <linux/bpf.h> includes <asm/types.h>, which Debian keeps per architecture.
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").expect("cargo sets the target arch");
    let status = Command::new("clang")
        .arg(format!("-I/usr/include/{arch}-linux-gnu"))
        .args([
            "-O2", "-g", "-target", "bpf", "-Wall", "-Werror", "-c", source, "-o",
        ])
        .arg(&object)
        .status()
        .unwrap_or_else(|e| panic!("clang (the BPF compiler; `make deps` installs it): {e}"));
    assert!(status.success(), "clang failed to compile {source}");
}
