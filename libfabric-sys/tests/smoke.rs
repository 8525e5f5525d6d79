//! fi_getinfo finds `tcp;ofi_rxm` for RDM endpoints with RMA.
#![cfg(feature = "bind")]

use libfabric_sys::*;
use std::ffi::{CStr, CString};

#[test]
fn getinfo_tcp_rxm_rdm_rma() {
    // SAFETY: plain FFI calls; the hints come from fi_allocinfo and every
    // pointer we dereference was checked for null first; both infos are freed
    // exactly once.
    unsafe {
        let hints = dm_fi_allocinfo();
        assert!(!hints.is_null(), "fi_allocinfo returned null");
        (*hints).caps = FI_RMA | FI_READ | FI_REMOTE_READ;
        (*(*hints).ep_attr).type_ = FI_EP_RDM;
        let prov = CString::new("tcp;ofi_rxm").unwrap();
        assert_eq!(dm_fi_info_set_prov_name(hints, prov.as_ptr()), 0);
        let mut info: *mut fi_info = std::ptr::null_mut();
        let rc = dm_fi_getinfo(
            dm_fi_version(),
            std::ptr::null(),
            std::ptr::null(),
            0,
            hints,
            &mut info,
        );
        let msg = CStr::from_ptr(dm_fi_strerror(-rc))
            .to_string_lossy()
            .into_owned();
        assert_eq!(rc, 0, "fi_getinfo: {msg}");
        assert!(!info.is_null());
        let name = CStr::from_ptr((*(*info).fabric_attr).prov_name);
        assert!(name.to_string_lossy().contains("ofi_rxm"), "{name:?}");
        dm_fi_freeinfo(info);
        dm_fi_freeinfo(hints);
    }
    // SAFETY: returns a constant.
    assert!(unsafe { dm_fi_version() } >= fi_version(1, 5));
}
