//! Finds the system libfabric with pkg-config, compiles the C shim over its
//! `static inline` calls and generates the bindings with bindgen. All of it
//! only with the `bind` feature; without it there is nothing to build.

#[cfg(not(feature = "bind"))]
fn main() {}

#[cfg(feature = "bind")]
use bind::main;

#[cfg(feature = "bind")]
mod bind {

    use std::env;
    use std::path::PathBuf;

    const MISSING: &str = "libfabric headers not found: install libfabric-dev (Debian/Ubuntu) or \
                       libfabric-devel (RHEL); the `fabric` feature needs them";

    const HEADERS: &[&str] = &[
        "rdma/fabric.h",
        "rdma/fi_domain.h",
        "rdma/fi_endpoint.h",
        "rdma/fi_rma.h",
        "rdma/fi_cm.h",
        "rdma/fi_errno.h",
        "rdma/fi_eq.h",
    ];

    /// Flag macros (`FI_RMA`, `FI_MR_LOCAL`, ...) become `u64` like the `caps`,
    /// `flags` and `access` fields they go into; error numbers (`FI_EAGAIN`, ...)
    /// become `i32` like the negative returns they are compared with.
    #[derive(Debug)]
    struct MacroTypes;

    impl bindgen::callbacks::ParseCallbacks for MacroTypes {
        fn int_macro(&self, name: &str, value: i64) -> Option<bindgen::callbacks::IntKind> {
            use bindgen::callbacks::IntKind;
            if !name.starts_with("FI_") {
                return None;
            }
            let errno =
                name.starts_with("FI_E") && name != "FI_EVENT" && (0..1024).contains(&value);
            Some(if errno { IntKind::I32 } else { IntKind::U64 })
        }

        fn header_file(&self, filename: &str) {
            println!("cargo:rerun-if-changed={filename}");
        }
    }

    pub fn main() {
        println!("cargo:rerun-if-changed=build.rs");
        println!("cargo:rerun-if-changed=shim.c");
        println!("cargo:rerun-if-changed=shim.h");

        let lib = match pkg_config::Config::new()
            .atleast_version("1.5")
            .probe("libfabric")
        {
            Ok(lib) => lib,
            Err(e) => panic!("{MISSING}\n(pkg-config: {e})"),
        };
        let include_paths: Vec<PathBuf> = if lib.include_paths.is_empty() {
            vec![PathBuf::from("/usr/include")]
        } else {
            lib.include_paths.clone()
        };
        for h in HEADERS {
            if !include_paths.iter().any(|dir| dir.join(h).exists()) {
                panic!(
                    "{MISSING}\n(<{h}> is not under {:?}; libfabric {} was found by pkg-config)",
                    include_paths, lib.version
                );
            }
        }

        let mut build = cc::Build::new();
        build.file("shim.c").warnings(true);
        for dir in &lib.include_paths {
            build.include(dir);
        }
        build.compile("dm_fi_shim");

        let mut bindings = bindgen::Builder::default()
            .header("shim.h")
            .parse_callbacks(Box::new(MacroTypes))
            .allowlist_function("dm_fi_.*")
            .allowlist_type("fi_.*")
            .allowlist_type("fid_.*")
            .allowlist_type("fid")
            .allowlist_var("FI_.*")
            .default_enum_style(bindgen::EnumVariation::Consts)
            .prepend_enum_name(false)
            .derive_default(true)
            .layout_tests(false)
            .generate_comments(false);
        for dir in &lib.include_paths {
            bindings = bindings.clang_arg(format!("-I{}", dir.display()));
        }
        let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
        bindings
            .generate()
            .unwrap_or_else(|e| {
                panic!(
                    "bindgen over the libfabric headers failed: {e} (is libclang-dev installed?)"
                )
            })
            .write_to_file(out.join("bindings.rs"))
            .expect("writing bindings.rs");
    }
}
