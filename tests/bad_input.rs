//! Bad input against real server processes: each case gets a clear error and
//! the server goes on serving a well-behaved client afterwards.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use distmind_common::handshake::{self, ClusterKey, HandshakeError};
use distmind_common::proto::{
    ControllerReply, ControllerRequest, ErrorCode, MemserverReply, MemserverRequest,
};
use distmind_common::wire::{self, FrameKind, Role};
use distmind_controller::ControllerClient;
use distmind_memserver::MemserverClient;
use support::*;

fn connect(addr: &str, role: Role) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    handshake::client_sync(&mut s, &cluster_key(), role).unwrap();
    s
}

/// Proof that the controller still serves: a fresh, correct client works.
fn controller_still_serves(addr: &str) {
    let mut c = ControllerClient::connect(addr, &cluster_key(), Duration::from_secs(5)).unwrap();
    c.list_models()
        .expect("controller serves a good client after bad input");
}

fn memserver_still_serves(addr: &str) {
    let mut c = MemserverClient::connect(addr, &cluster_key(), Duration::from_secs(5)).unwrap();
    let off = c
        .alloc(4096, "probe")
        .expect("memserver serves a good client after bad input");
    c.free(off, "probe").unwrap();
}

/// Reads whatever the server says before it closes (or times out).
fn drain(s: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    out
}

#[test]
fn controller_survives_malformed_truncated_oversized_and_garbage_frames() {
    let controller = spawn_controller();
    let addr = controller.addr.as_str();

    // Unknown frame kind in the header.
    let mut s = connect(addr, Role::Control);
    s.write_all(&[4, 0, 0, 0, 0x77, 0x77, 0, 0, b'a', b'b', b'c', b'd'])
        .unwrap();
    drain(&mut s);
    controller_still_serves(addr);

    // Length over the bound: refused before anything is allocated.
    let mut s = connect(addr, Role::Control);
    s.write_all(&(u32::MAX).to_le_bytes()).unwrap();
    s.write_all(&[1, 0, 0, 0]).unwrap();
    drain(&mut s);
    controller_still_serves(addr);

    // Truncated frame: the client promises 100 bytes, sends 10 and hangs up.
    let mut s = connect(addr, Role::Control);
    s.write_all(&100u32.to_le_bytes()).unwrap();
    s.write_all(&[1, 0, 0, 0]).unwrap();
    s.write_all(b"{\"op\":\"li").unwrap();
    drop(s);
    controller_still_serves(addr);

    // A well-framed message that is not a request: an error reply, and the
    // same connection keeps working.
    let mut s = connect(addr, Role::Control);
    wire::write_frame_sync(
        &mut s,
        FrameKind::Message,
        &[b"{\"op\":\"launch_missiles\"}"],
    )
    .unwrap();
    let reply: ControllerReply = wire::recv_message_sync(&mut s, 1 << 20).unwrap();
    match reply {
        ControllerReply::Error(e) => assert_eq!(e.code, ErrorCode::BadRequest, "{e:?}"),
        other => panic!("expected an error, got {other:?}"),
    }
    wire::send_message_sync(&mut s, &ControllerRequest::ListModels).unwrap();
    let reply: ControllerReply = wire::recv_message_sync(&mut s, 1 << 20).unwrap();
    assert!(matches!(reply, ControllerReply::Models { .. }), "{reply:?}");

    // Unknown model: a clear error naming it.
    let mut c = ControllerClient::connect(addr, &cluster_key(), Duration::from_secs(5)).unwrap();
    let err = c.get_model("no-such-model-00000000").unwrap_err();
    assert!(err.to_string().contains("no-such-model-00000000"), "{err}");
    assert_eq!(err.code(), Some(ErrorCode::UnknownModel));
    controller_still_serves(addr);
}

#[test]
fn wrong_cluster_key_is_refused_and_others_are_served() {
    let controller = spawn_controller();
    let ms = spawn_memserver(&controller.addr, "16MiB");
    for addr in [controller.addr.as_str(), ms.addr.as_str()] {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let wrong = ClusterKey::from_secret(b"not-the-cluster-key-at-all");
        let err = handshake::client_sync(&mut s, &wrong, Role::Control).unwrap_err();
        assert!(
            matches!(err, HandshakeError::ServerNotInCluster),
            "{addr}: {err:?}"
        );
        // The error explains itself.
        assert!(err.to_string().contains("cluster key"), "{err}");
    }
    controller_still_serves(&controller.addr);
    memserver_still_serves(&ms.addr);
}

#[test]
fn memserver_survives_bad_frames_bad_reads_and_being_full() {
    let controller = spawn_controller();
    let ms = spawn_memserver(&controller.addr, "16MiB");
    let addr = ms.addr.as_str();

    // Malformed frame header.
    let mut s = connect(addr, Role::Control);
    s.write_all(&[8, 0, 0, 0, 9, 0, 0, 0]).unwrap();
    drain(&mut s);
    memserver_still_serves(addr);

    // Over-bound length.
    let mut s = connect(addr, Role::Control);
    s.write_all(&[0xff, 0xff, 0xff, 0x7f, 1, 0, 0, 0]).unwrap();
    drain(&mut s);
    memserver_still_serves(addr);

    // Truncated write chunk.
    let mut s = connect(addr, Role::Control);
    s.write_all(&(1u32 << 20).to_le_bytes()).unwrap();
    s.write_all(&[2, 0, 0, 0]).unwrap();
    s.write_all(&[0u8; 1000]).unwrap();
    drop(s);
    memserver_still_serves(addr);

    // JSON that is not a request gets an error reply on a live connection.
    let mut s = connect(addr, Role::Control);
    wire::write_frame_sync(&mut s, FrameKind::Message, &[b"[1,2,3]"]).unwrap();
    let reply: MemserverReply = wire::recv_message_sync(&mut s, 1 << 20).unwrap();
    assert!(
        matches!(reply, MemserverReply::Error(ref e) if e.code == ErrorCode::BadRequest),
        "{reply:?}"
    );
    wire::send_message_sync(&mut s, &MemserverRequest::Stats).unwrap();
    let reply: MemserverReply = wire::recv_message_sync(&mut s, 1 << 20).unwrap();
    assert!(matches!(reply, MemserverReply::Stats(_)), "{reply:?}");

    // A read of bytes that were never committed: refused, nothing leaks.
    let mut s = connect(addr, Role::Data);
    s.write_all(
        &wire::ReadRequest {
            wr_id: 1,
            offset: 0,
            len: 4096,
        }
        .encode(),
    )
    .unwrap();
    let mut hdr = [0u8; wire::READ_REPLY_BYTES];
    s.read_exact(&mut hdr).unwrap();
    let reply = wire::ReadReply::decode(&hdr, 1 << 30).unwrap();
    assert_eq!(reply.status, wire::ReadStatus::OutOfRange);
    assert_eq!(reply.len, 0);

    // A read longer than the bound.
    let mut s = connect(addr, Role::Data);
    s.write_all(
        &wire::ReadRequest {
            wr_id: 2,
            offset: 0,
            len: u64::MAX,
        }
        .encode(),
    )
    .unwrap();
    let mut hdr = [0u8; wire::READ_REPLY_BYTES];
    s.read_exact(&mut hdr).unwrap();
    assert_eq!(
        wire::ReadReply::decode(&hdr, u64::MAX).unwrap().status,
        wire::ReadStatus::BadRequest
    );
    memserver_still_serves(addr);

    // Full: a clear error that says how much was asked and how much is free.
    let mut c = MemserverClient::connect(addr, &cluster_key(), Duration::from_secs(5)).unwrap();
    let err = c.alloc(64 << 20, "too-big").unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("full") && text.contains(&(64u64 << 20).to_string()),
        "{text}"
    );
    memserver_still_serves(addr);
}

#[test]
fn deploy_onto_a_full_memory_server_fails_clearly_and_leaks_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let pkgs = gen_tiny(tmp.path(), "resnet152", 1, 1 << 20);
    let controller = spawn_controller();
    let ms = spawn_memserver(&controller.addr, "1MiB");
    wait_alive(&controller.addr, 1);
    let (ok, _, stderr) = deploy(&controller.addr, &[], &pkgs);
    assert!(!ok, "a 1.5 MB model cannot fit a 1 MiB memory server");
    // The planner refuses before a byte is written, naming the server and the shortfall.
    assert!(
        stderr.contains("resnet152-tiny-00000000") && stderr.contains("1048576 free"),
        "{stderr}"
    );
    let mut c = MemserverClient::connect(&ms.addr, &cluster_key(), Duration::from_secs(5)).unwrap();
    assert_eq!(
        c.stats().unwrap().used_bytes,
        0,
        "a failed deploy frees what it wrote"
    );
}

#[test]
fn a_broken_settings_line_names_file_and_line() {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(settings_dir()).unwrap() {
        let p = entry.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, tmp.path().join(p.file_name().unwrap())).unwrap();
        }
    }
    let list = tmp.path().join("storage_list.txt");
    let mut text = std::fs::read_to_string(&list).unwrap();
    text.push_str("127.0.0.1,   77x9\n");
    std::fs::write(&list, &text).unwrap();
    let bad_line = text.lines().count();
    let (ok, _, stderr) = run(&[
        "deploy",
        "--settings",
        tmp.path().to_str().unwrap(),
        "/nonexistent",
    ]);
    assert!(!ok);
    assert!(
        stderr.contains(&format!("storage_list.txt:{bad_line}")),
        "{stderr}"
    );
    assert!(stderr.contains("77x9"), "{stderr}");
}
