//! Build script of the `distmind` binary.
//!
//! 1. Stamps the git revision into `distmind --version`, so a result can be
//!    traced to the code that produced it.
//! 2. Probes the optional system libraries of the data-path features
//!    (`fabric`: libfabric, `verbs`: libibverbs) when such a feature is
//!    enabled, and fails with the package to install instead of a linker error
//!    a page long. No feature needs them by default.

use std::path::Path;
use std::process::Command;

struct Probe {
    feature_env: &'static str,
    header: &'static str,
    debian_packages: &'static str,
}

const PROBES: &[Probe] = &[
    Probe {
        feature_env: "CARGO_FEATURE_FABRIC",
        header: "rdma/fabric.h",
        debian_packages: "libfabric-dev libclang-dev",
    },
    Probe {
        feature_env: "CARGO_FEATURE_VERBS",
        header: "infiniband/verbs.h",
        debian_packages: "libibverbs-dev librdmacm-dev libclang-dev",
    },
];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=.git/HEAD");
    let rev = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=DISTMIND_GIT_REV={rev}");

    for p in PROBES {
        if std::env::var_os(p.feature_env).is_none() {
            continue;
        }
        let found = [
            "/usr/include",
            "/usr/local/include",
            "/opt/amazon/efa/include",
        ]
        .iter()
        .any(|dir| Path::new(dir).join(p.header).exists());
        if !found {
            panic!(
                "feature {} needs the header <{}>, which is not installed.\n\
                 On Debian/Ubuntu: sudo apt-get install {}\n\
                 (or build without the feature: the tcp transport works everywhere)",
                p.feature_env
                    .trim_start_matches("CARGO_FEATURE_")
                    .to_lowercase(),
                p.header,
                p.debian_packages
            );
        }
    }
}
