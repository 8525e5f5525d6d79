//! The controller over its real protocol: catalog, registry, bad input,
//! wrong keys, heartbeat expiry, connection limits and shutdown.

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use common::{key, model, wait_until, TestServer, TIMEOUT};
use distmind_common::handshake::{ClusterKey, HandshakeError};
use distmind_common::limits::CONTROL_FRAME_BYTES_MAX;
use distmind_common::proto::{ControllerReply, ControllerRequest, ErrorCode, ModelEntry};
use distmind_common::wire;
use distmind_controller::{ClientError, ControllerClient};

fn register_two(c: &mut ControllerClient) -> Vec<distmind_common::proto::MemserverInfo> {
    let (a, interval) = c
        .register_memserver("127.0.0.1:17001", 1 << 30, 11)
        .unwrap();
    assert_eq!(interval, Duration::from_millis(1000));
    let (b, _) = c
        .register_memserver("127.0.0.1:17002", 2 << 30, 22)
        .unwrap();
    assert_ne!(a, b);
    let list = c.list_memservers().unwrap();
    assert_eq!(list.len(), 2);
    assert!(list.iter().all(|m| m.alive));
    assert_eq!(
        list.iter().find(|m| m.id == b).unwrap().capacity_bytes,
        2 << 30
    );
    list
}

#[test]
fn catalog_put_get_replace_remove() {
    let server = TestServer::start(|_| {});
    let mut c = server.client();
    let ms = register_two(&mut c);
    // Re-registering with the same address and boot id keeps the id.
    assert_eq!(
        c.register_memserver("127.0.0.1:17001", 1 << 30, 11)
            .unwrap()
            .0,
        ms[0].id
    );

    // The catalog gives every stored entry its version: compare the rest.
    let versioned = |mut e: ModelEntry, version: u64| {
        e.version = version;
        e
    };
    let v1 = model("bert-a", 3, &ms);
    assert_eq!(c.put_model(v1.clone()).unwrap(), None);
    let got = c.get_model("bert-a").unwrap();
    assert!(got.version >= 1);
    let v1 = versioned(v1, got.version);
    assert_eq!(got, v1);
    c.put_model(model("alpha", 1, &ms)).unwrap();
    let v2 = model("bert-a", 5, &ms);
    assert_eq!(
        c.put_model(v2.clone()).unwrap(),
        Some(v1.clone()),
        "put returns the replaced entry"
    );
    let got = c.get_model("bert-a").unwrap();
    assert!(got.version > v1.version, "a redeploy gets a newer version");
    let v2 = versioned(v2, got.version);
    let names: Vec<(String, u32)> = c
        .list_models()
        .unwrap()
        .into_iter()
        .map(|m| (m.name, m.groups))
        .collect();
    assert_eq!(names, vec![("alpha".into(), 1), ("bert-a".into(), 5)]);

    assert_eq!(c.remove_model("bert-a").unwrap(), v2);
    let e = c.get_model("bert-a").unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::UnknownModel), "{e}");
    let msg = &e.error_reply().unwrap().message;
    assert!(
        msg.contains("bert-a") && msg.contains("holds 1 models"),
        "{msg}"
    );
    assert!(
        e.to_string().contains(&server.addr.to_string()),
        "the error names the controller: {e}"
    );
    assert_eq!(
        c.remove_model("bert-a").unwrap_err().code(),
        Some(ErrorCode::UnknownModel)
    );

    // An invalid entry is refused with a reason; the connection goes on.
    let mut bad = model("broken", 2, &ms);
    bad.groups[1].slices[1].group_offset = 1000;
    let e = c.put_model(bad).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::BadRequest));
    assert!(e.to_string().contains("group 1 slice 1"), "{e}");
    assert_eq!(c.list_models().unwrap().len(), 1);
}

#[test]
fn a_restarted_memserver_loses_its_replicas() {
    let server = TestServer::start(|_| {});
    let mut c = server.client();
    let ms = register_two(&mut c);
    c.put_model(model("m", 2, &ms)).unwrap();
    // Server 1 comes back with a new boot id: its arena is gone.
    let (id, _) = c.register_memserver(&ms[1].addr, 1 << 30, 99).unwrap();
    assert_eq!(id, ms[1].id);
    let m = c.get_model("m").unwrap();
    for s in m.groups.iter().flat_map(|g| &g.slices) {
        assert_eq!(s.replicas.len(), 1);
        assert_eq!(s.replicas[0].memserver, ms[0].id);
    }
    // Its old boot id is refused.
    let e = c.heartbeat(ms[1].id, 22, 0).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::BadRequest));
    c.heartbeat(ms[1].id, 99, 0).unwrap();
}

#[test]
fn wrong_cluster_key_is_refused_and_others_are_served() {
    let server = TestServer::start(|_| {});
    let wrong = ClusterKey::from_secret(b"not-the-cluster-key");
    let e = ControllerClient::connect(&server.addr.to_string(), &wrong, TIMEOUT).unwrap_err();
    assert!(
        matches!(
            e,
            ClientError::Handshake {
                source: HandshakeError::ServerNotInCluster,
                ..
            }
        ),
        "{e:?}"
    );
    // Garbage instead of a handshake.
    let mut s = std::net::TcpStream::connect(server.addr).unwrap();
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: controller\r\n\r\n0123")
        .unwrap();
    let mut sink = Vec::new();
    let _ = s.read_to_end(&mut sink);
    // A good client is still served.
    assert!(server.client().list_models().unwrap().is_empty());
}

fn send_raw(s: &mut std::net::TcpStream, kind: u16, len: u32, payload: &[u8]) {
    let mut h = [0u8; 8];
    h[0..4].copy_from_slice(&len.to_le_bytes());
    h[4..6].copy_from_slice(&kind.to_le_bytes());
    s.write_all(&h).unwrap();
    s.write_all(payload).unwrap();
}

/// The server's answer to a broken frame: maybe an error, then end of stream.
fn read_until_closed(s: &mut std::net::TcpStream) -> Option<ControllerReply> {
    let reply = wire::recv_message_sync::<_, ControllerReply>(s, CONTROL_FRAME_BYTES_MAX).ok();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(
        rest.is_empty(),
        "the server kept talking on a broken connection"
    );
    reply
}

fn assert_bad_request(reply: Option<ControllerReply>, needle: &str) {
    match reply {
        Some(ControllerReply::Error(e)) => {
            assert_eq!(e.code, ErrorCode::BadRequest);
            assert!(e.message.contains(needle), "{e}");
        }
        r => panic!("expected a BadRequest mentioning {needle:?}, got {r:?}"),
    }
}

#[test]
fn bad_frames_get_errors_and_the_server_keeps_serving() {
    let server = TestServer::start(|_| {});
    // A client stuck in the middle of a frame does not block anyone.
    let mut stuck = server.raw();
    send_raw(&mut stuck, 1, 100, b"{\"op\":");

    let good = |what: &str| {
        let mut c = server.client();
        assert!(
            c.list_models().unwrap().is_empty(),
            "good request after {what}"
        );
    };

    // JSON garbage in an intact frame: an error, and the same connection goes on.
    let mut s = server.raw();
    send_raw(&mut s, 1, 9, b"not json{");
    let r: ControllerReply = wire::recv_message_sync(&mut s, CONTROL_FRAME_BYTES_MAX).unwrap();
    assert_bad_request(Some(r), "not a controller request");
    let valid_json_wrong_shape = br#"{"op":"launch_rockets"}"#;
    send_raw(
        &mut s,
        1,
        valid_json_wrong_shape.len() as u32,
        valid_json_wrong_shape,
    );
    let r: ControllerReply = wire::recv_message_sync(&mut s, CONTROL_FRAME_BYTES_MAX).unwrap();
    assert_bad_request(Some(r), "launch_rockets");
    send_raw(&mut s, 2, 3, b"abc");
    let r: ControllerReply = wire::recv_message_sync(&mut s, CONTROL_FRAME_BYTES_MAX).unwrap();
    assert_bad_request(Some(r), "WriteChunk");
    wire::send_message_sync(&mut s, &ControllerRequest::ListModels).unwrap();
    let r: ControllerReply = wire::recv_message_sync(&mut s, CONTROL_FRAME_BYTES_MAX).unwrap();
    assert_eq!(r, ControllerReply::Models { models: vec![] });
    good("JSON garbage");

    // A malformed header (unknown frame kind): an error, then the server closes.
    let mut s = server.raw();
    send_raw(&mut s, 7, 2, b"{}");
    assert_bad_request(read_until_closed(&mut s), "unknown frame kind 7");
    good("a malformed header");

    // A length over the bound: refused before anything is allocated.
    let mut s = server.raw();
    send_raw(&mut s, 1, CONTROL_FRAME_BYTES_MAX + 1, b"");
    assert_bad_request(read_until_closed(&mut s), "exceeds the bound");
    let mut s = server.raw();
    send_raw(&mut s, 1, u32::MAX, b"");
    assert_bad_request(read_until_closed(&mut s), "exceeds the bound");
    good("an over-bound length");

    // A truncated frame: the client goes away in the middle of a payload.
    let mut s = server.raw();
    send_raw(&mut s, 1, 64, b"{\"op\":\"list_mo");
    s.shutdown(std::net::Shutdown::Write).unwrap();
    assert_eq!(read_until_closed(&mut s), None);
    // And in the middle of a header.
    let mut s = server.raw();
    s.write_all(&[5, 0, 0]).unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    assert_eq!(read_until_closed(&mut s), None);
    good("a truncated frame");

    // The stuck client can still finish its frame and be answered.
    let tail = br#""list_models"}"#;
    let mut rest = tail.to_vec();
    rest.resize(100 - 6, b' '); // JSON allows trailing spaces
    stuck.write_all(&rest).unwrap();
    let r: ControllerReply = wire::recv_message_sync(&mut stuck, CONTROL_FRAME_BYTES_MAX).unwrap();
    assert_eq!(r, ControllerReply::Models { models: vec![] });
}

#[test]
fn memservers_die_after_missed_heartbeats_and_come_back() {
    let server = TestServer::start(|c| c.heartbeat_interval = Duration::from_millis(20));
    let mut c = server.client();
    let (id, interval) = c.register_memserver("127.0.0.1:17009", 1 << 20, 5).unwrap();
    assert_eq!(interval, Duration::from_millis(20));
    c.heartbeat(id, 5, 1234).unwrap();
    let ms = c.list_memservers().unwrap();
    assert_eq!(ms[0].used_bytes, 1234);
    wait_until("the silent memory server is dead", || {
        !c.list_memservers().unwrap()[0].alive
    });
    assert!(c.list_memservers().unwrap()[0].last_heartbeat_ms_ago >= 60);
    c.heartbeat(id, 5, 0).unwrap();
    // Checked right after a heartbeat, so only a very slow machine could see it dead again.
    wait_until("the memory server is alive again", || {
        c.heartbeat(id, 5, 0).unwrap();
        c.list_memservers().unwrap()[0].alive
    });
    let e = c.heartbeat(id + 1, 5, 0).unwrap_err();
    assert!(e.to_string().contains("register first"), "{e}");
}

#[test]
fn connections_are_capped_and_slots_are_reused() {
    let server = TestServer::start(|c| c.max_connections = 1);
    let mut first = server.client();
    first.list_models().unwrap();
    // The second waits for a slot: its handshake cannot finish in time.
    let e = ControllerClient::connect(&server.addr.to_string(), &key(), Duration::from_millis(300))
        .unwrap_err();
    assert!(matches!(e, ClientError::Handshake { .. }), "{e:?}");
    drop(first);
    wait_until("a slot is free again", || {
        ControllerClient::connect(&server.addr.to_string(), &key(), Duration::from_millis(500))
            .and_then(|mut c| c.list_models())
            .is_ok()
    });
}

#[test]
fn shutdown_closes_open_connections_and_returns() {
    let server = TestServer::start(|_| {});
    let mut c = server.client();
    c.list_models().unwrap();
    let addr = server.addr;
    server.stop().unwrap();
    assert!(c.list_models().is_err(), "the open connection was closed");
    assert!(
        ControllerClient::connect(&addr.to_string(), &key(), Duration::from_millis(500)).is_err()
    );
}

/// The dispatcher answers a client on its own thread and on the
/// controller's pool alike, and stops with the controller.
#[test]
fn the_dispatcher_serves_and_stops_on_its_own_thread_or_the_pool() {
    use distmind_common::proto::{RuntimeReply, RuntimeRequest};
    use distmind_controller::dispatch::{DispatchConfig, DispatchThread};
    use distmind_controller::policy::distmind::DistMindConfig;
    use distmind_controller::policy::PolicyKind;
    for thread in [DispatchThread::Own, DispatchThread::Pool] {
        let server = TestServer::start(move |c| {
            let cfg = DispatchConfig::new(PolicyKind::Slo, DistMindConfig::inference_only(1));
            c.dispatch = Some(("127.0.0.1:0".parse().unwrap(), cfg));
            c.dispatch_thread = thread;
        });
        let client = server.client_addr.expect("a client port");
        let mut s = std::net::TcpStream::connect(client).unwrap();
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        distmind_common::handshake::client_sync(
            &mut s,
            &key(),
            distmind_common::wire::Role::Control,
        )
        .unwrap();
        let req = RuntimeRequest::Infer {
            id: 9,
            model: "no-such-model".into(),
            deadline_ms: None,
            trace: false,
            device: None,
            batch: Vec::new(),
            catalog_version: None,
        };
        let msg = wire::encode_message(&req);
        wire::write_frame_sync(&mut s, wire::FrameKind::Message, &[&msg]).unwrap();
        wire::write_frame_sync(&mut s, wire::FrameKind::WriteChunk, &[&[0u8; 4]]).unwrap();
        let (kind, body) = wire::read_frame_sync(&mut s, CONTROL_FRAME_BYTES_MAX)
            .unwrap()
            .expect("a reply");
        assert_eq!(kind, wire::FrameKind::Message, "{thread}");
        match wire::decode_message::<RuntimeReply>(&body).unwrap() {
            RuntimeReply::Error { id, error } => {
                assert_eq!(id, 9, "{thread}");
                assert_eq!(
                    error.code,
                    ErrorCode::UnknownModel,
                    "{thread}: {}",
                    error.message
                );
                assert!(
                    error.message.contains("no-such-model"),
                    "{thread}: {}",
                    error.message
                );
            }
            other => panic!("{thread}: expected an error, got {other:?}"),
        }
        server.stop().unwrap();
        // The client port closed with the controller.
        let mut buf = [0u8; 1];
        assert!(
            matches!(s.read(&mut buf), Ok(0) | Err(_)),
            "{thread}: the open client connection was closed"
        );
        assert!(
            std::net::TcpStream::connect_timeout(&client, Duration::from_millis(500)).is_err(),
            "{thread}: the client port is closed"
        );
    }
}
