//! Raw bindings to the system libfabric (1.x, found with pkg-config).
//!
//! Types and constants come from bindgen over `fabric.h`, `fi_domain.h`,
//! `fi_endpoint.h`, `fi_rma.h`, `fi_cm.h`, `fi_errno.h` and `fi_eq.h`. Most
//! `fi_*` calls are `static inline` in those headers, so they are reached
//! through the `dm_fi_*` wrappers of the C shim (`shim.c`), which has the same
//! arguments as the call it wraps; `fi_getinfo`, `fi_freeinfo`, `fi_fabric` and
//! `fi_strerror` go through it too, so that every entry point has one spelling.
//!
//! Safe wrappers live in `distmind-transport` (feature `fabric`).
//!
//! Everything here exists only with the `bind` feature (which needs
//! libfabric-dev and libclang-dev); without it the crate is empty.

#![allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code
)]
#![allow(clippy::all)]

#[cfg(feature = "bind")]
include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

/// `FI_VERSION(major, minor)`.
#[cfg(feature = "bind")]
pub const fn fi_version(major: u32, minor: u32) -> u32 {
    (major << 16) | minor
}
