//! The one-sided data-path offers on the control connection, and the
//! free grace that protects reads the server cannot see.
mod common;

use common::*;
use distmind_memserver::{Memserver, MemserverConfig, MemserverError, OneSidedConfig};

#[test]
fn a_tcp_only_server_offers_nothing_one_sided_and_refuses_verbs_clearly() {
    let s = start(1 << 20);
    let mut c = s.client();
    let paths = c.data_paths().unwrap();
    assert_eq!(paths, Default::default(), "tcp only");
    let e = c.verbs_connect(&"00".repeat(56)).unwrap_err();
    let r = e.server_error().expect("a server error");
    assert_eq!(r.code, distmind_common::proto::ErrorCode::Unsupported);
    assert!(
        r.message.contains("does not serve the verbs data path"),
        "{r:?}"
    );
    // The connection keeps serving.
    assert_eq!(c.stats().unwrap().capacity_bytes, 1 << 20);
}

fn bind_err(one_sided: OneSidedConfig) -> String {
    let mut config = MemserverConfig::new("127.0.0.1:0".parse().unwrap(), 1 << 20, key());
    config.one_sided = one_sided;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    match rt.block_on(Memserver::bind(config)) {
        Ok(_) => panic!("bind should fail"),
        Err(e @ MemserverError::OneSided(_)) => e.to_string(),
        Err(e) => panic!("unexpected error: {e}"),
    }
}

#[test]
fn a_path_that_cannot_start_fails_bind_naming_it() {
    let e = bind_err(OneSidedConfig {
        verbs_device: Some("distmind_absent_0".into()),
        ..Default::default()
    });
    if cfg!(feature = "verbs") {
        assert!(e.contains("\"distmind_absent_0\""), "{e}");
    } else {
        assert!(e.contains("--features verbs"), "{e}");
    }
    let e = bind_err(OneSidedConfig {
        fabric_provider: Some("no_such_provider".into()),
        ..Default::default()
    });
    if cfg!(feature = "fabric") {
        assert!(e.contains("\"no_such_provider\""), "{e}");
    } else {
        assert!(e.contains("--features fabric"), "{e}");
    }
}

#[cfg(feature = "fabric")]
#[test]
fn a_fabric_server_offers_its_arena_and_holds_freed_extents_for_the_grace() {
    let s = start_with(4 << 20, |c| {
        c.one_sided.fabric_provider = Some("tcp;ofi_rxm".into());
        c.one_sided.fabric_source = Some("127.0.0.1".into());
    });
    use std::time::{Duration, Instant};
    let mut c = s.client();
    let offer = c.data_paths().unwrap().fabric.expect("a fabric offer");
    assert_eq!(offer.provider, "tcp;ofi_rxm");
    assert_eq!(offer.len, 4 << 20);
    assert!(!offer.name.is_empty());
    // A freed committed extent stays allocated for the grace, then goes.
    let off = deploy(&mut c, &[7u8; 1 << 20], "m");
    let used = c.stats().unwrap().used_bytes;
    c.free(off, "m").unwrap();
    assert_eq!(
        c.stats().unwrap().used_bytes,
        used,
        "held for one-sided readers"
    );
    let deadline = Instant::now() + distmind_memserver::onesided::FREE_GRACE * 3;
    while c.stats().unwrap().used_bytes == used {
        assert!(Instant::now() < deadline, "the grace never ended");
        std::thread::sleep(Duration::from_millis(100));
    }
}
