//! The Prometheus endpoint of a real server: the counters move with alloc,
//! write, commit, reads and errors; the gauges follow the arena; shutdown
//! stops the endpoint.
mod common;

use common::*;
use distmind_common::metrics::{sample_value, scrape};
use distmind_common::proto::MemserverRequest;
use distmind_common::wire::{ReadStatus, Role};

fn metrics(server: &TestServer) -> String {
    let addr = server.metrics.expect("metrics endpoint").to_string();
    let (code, body) = scrape(&addr, "/metrics", TIMEOUT).expect("scrape");
    assert_eq!(code, 200, "{body}");
    body
}

fn value(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    sample_value(text, name, labels).unwrap_or_else(|| panic!("no {name}{labels:?} in:\n{text}"))
}

fn requests(text: &str, op: &str, status: &str) -> f64 {
    value(
        text,
        "memserver_requests_total",
        &[("op", op), ("status", status)],
    )
}

#[test]
fn counters_and_gauges_move_with_traffic() {
    let mut server = start_with(1 << 20, |c| {
        c.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    });
    let maddr = server.metrics.unwrap();
    assert_ne!(maddr.port(), 0);
    assert_eq!(
        scrape(&maddr.to_string(), "/health", TIMEOUT).unwrap(),
        (200, "ok".into())
    );

    let before = metrics(&server);
    assert_eq!(
        value(&before, "memserver_capacity_bytes", &[]),
        (1 << 20) as f64
    );
    assert_eq!(value(&before, "memserver_used_bytes", &[]), 0.0);
    assert_eq!(requests(&before, "read", "ok"), 0.0);

    let mut c = server.client();
    let data = pattern(100_000, 3);
    let off = deploy(&mut c, &data, "resnet152");
    let mut d = raw(server.addr, Role::Data);
    for id in 0..3 {
        let (r, got) = read(&mut d, id, off, data.len() as u64);
        assert_eq!(r.status, ReadStatus::Ok);
        assert_eq!(got, data);
    }
    let (r, _) = read(&mut d, 9, off + 200_000, 10);
    assert_eq!(r.status, ReadStatus::OutOfRange);
    assert!(c.alloc(2 << 20, "too-big").is_err());
    assert!(c.free(12345, "nobody").is_err());
    c.stats().unwrap();

    let text = metrics(&server);
    let v = |name| value(&text, name, &[]);
    assert_eq!(requests(&text, "alloc", "ok"), 1.0);
    assert_eq!(requests(&text, "alloc", "full"), 1.0);
    assert!(requests(&text, "write", "ok") >= 1.0);
    assert_eq!(requests(&text, "commit", "ok"), 1.0);
    assert_eq!(requests(&text, "free", "unknown_extent"), 1.0);
    assert_eq!(requests(&text, "stats", "ok"), 1.0);
    assert_eq!(requests(&text, "read", "ok"), 3.0);
    assert_eq!(requests(&text, "read", "out_of_range"), 1.0);
    assert_eq!(v("memserver_reads_served_total"), 3.0);
    assert_eq!(v("memserver_bytes_served_total"), 300_000.0);
    assert_eq!(v("memserver_bytes_committed_total"), 100_000.0); // the bytes verified
    assert_eq!(v("memserver_alloc_failures_total"), 1.0);
    assert_eq!(v("memserver_used_bytes"), 100_352.0); // rounded up to 512
    assert_eq!(v("memserver_extents"), 1.0);
    assert_eq!(v("memserver_connections"), 2.0);
    assert_eq!(v("memserver_read_bytes_in_flight"), 0.0);
    assert!(text.ends_with("# EOF\n"));
    // The in-process rendering is the same exposition.
    let local = server.stats.render_metrics();
    assert_eq!(
        sample_value(&local, "memserver_bytes_served_total", &[]),
        Some(300_000.0)
    );

    // Control errors by code, and the gauges follow frees and closes.
    let mut ctl = raw(server.addr, Role::Control);
    let reply = control_request(
        &mut ctl,
        &MemserverRequest::Commit {
            offset: off,
            checksum: "nothex".into(),
        },
    );
    assert!(format!("{reply:?}").contains("BadRequest"), "{reply:?}");
    c.free(off, "resnet152").unwrap();
    drop((d, ctl));
    eventually("the closed connections to leave the gauge", || {
        sample_value(&metrics(&server), "memserver_connections", &[]) == Some(1.0)
    });
    let text = metrics(&server);
    assert_eq!(requests(&text, "commit", "bad_request"), 1.0);
    assert_eq!(requests(&text, "free", "ok"), 1.0);
    assert_eq!(value(&text, "memserver_used_bytes", &[]), 0.0);
    assert_eq!(value(&text, "memserver_extents", &[]), 0.0);

    server.shutdown();
    assert!(
        scrape(&maddr.to_string(), "/metrics", TIMEOUT).is_err(),
        "the metrics endpoint stops with the server"
    );
}

#[test]
fn no_metrics_endpoint_by_default_and_a_taken_port_is_a_clear_error() {
    let server = start(1 << 20);
    assert_eq!(server.metrics, None);
    // The counters exist without an endpoint too.
    let text = server.stats.render_metrics();
    assert_eq!(
        sample_value(&text, "memserver_capacity_bytes", &[]),
        Some((1 << 20) as f64)
    );

    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let mut config =
        distmind_memserver::MemserverConfig::new("127.0.0.1:0".parse().unwrap(), 1 << 20, key());
    config.huge_pages = false;
    config.metrics_listen = Some(addr);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let err = match rt.block_on(distmind_memserver::Memserver::bind(config)) {
        Ok(_) => panic!("binding a taken metrics port must fail"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("cannot serve metrics on") && err.contains(&addr.to_string()),
        "{err}"
    );
}
