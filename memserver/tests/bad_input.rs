//! Bad input, one case per test: the offending client gets a clear error and
//! every other client is still served.
mod common;

use std::io::{Read, Write};
use std::net::TcpStream;

use common::*;
use distmind_common::checksum::checksum;
use distmind_common::handshake::{self, ClusterKey, HandshakeError};
use distmind_common::limits::{CONTROL_FRAME_BYTES_MAX, READ_CHUNK_BYTES_MAX};
use distmind_common::proto::{ErrorCode, MemserverReply, MemserverRequest};
use distmind_common::wire::{self, FrameKind, ReadRequest, ReadStatus, Role};

fn expect_error(reply: MemserverReply, code: ErrorCode, needle: &str) {
    match reply {
        MemserverReply::Error(e) => {
            assert_eq!(e.code, code, "{e}");
            assert!(
                e.message.contains(needle),
                "{:?} does not mention {needle:?}",
                e.message
            );
        }
        r => panic!("expected an error, got {r:?}"),
    }
}

fn recv(s: &mut TcpStream) -> MemserverReply {
    wire::recv_message_sync(s, CONTROL_FRAME_BYTES_MAX).unwrap()
}

fn assert_closed(s: &mut TcpStream) {
    let mut b = [0u8; 1];
    assert_eq!(
        s.read(&mut b).unwrap(),
        0,
        "the server should close this connection"
    );
}

#[test]
fn malformed_frame_header() {
    let server = start(1 << 20);
    let mut s = raw(server.addr, Role::Control);
    // Unknown frame kind 99.
    s.write_all(&[4, 0, 0, 0, 99, 0, 0, 0, b'a', b'b', b'c', b'd'])
        .unwrap();
    expect_error(recv(&mut s), ErrorCode::BadRequest, "unknown frame kind 99");
    assert_closed(&mut s);
    assert_still_serving(&server);
}

#[test]
fn truncated_frame() {
    let server = start(1 << 20);
    let mut s = raw(server.addr, Role::Control);
    s.write_all(&[100, 0, 0, 0, 1, 0, 0, 0]).unwrap();
    s.write_all(b"{\"op\":").unwrap();
    drop(s); // hangs up mid-frame
    eventually("the truncated connection to close", || {
        server.stats.snapshot().connections == 0
    });
    assert_still_serving(&server);
}

#[test]
fn length_over_the_bound() {
    let server = start(1 << 20);
    let mut s = raw(server.addr, Role::Control);
    let len = CONTROL_FRAME_BYTES_MAX + 1;
    let mut h = len.to_le_bytes().to_vec();
    h.extend_from_slice(&[1, 0, 0, 0]);
    s.write_all(&h).unwrap();
    expect_error(recv(&mut s), ErrorCode::BadRequest, "exceeds the bound");
    assert_closed(&mut s);
    assert_still_serving(&server);
}

#[test]
fn json_garbage_gets_an_error_and_the_connection_stays_usable() {
    let server = start(1 << 20);
    let mut s = raw(server.addr, Role::Control);
    for garbage in [
        &b"not json at all"[..],
        br#"{"op":"explode"}"#,
        br#"{"op":"alloc"}"#,
    ] {
        wire::write_frame_sync(&mut s, FrameKind::Message, &[garbage]).unwrap();
        expect_error(
            recv(&mut s),
            ErrorCode::BadRequest,
            "not a memory server request",
        );
    }
    // Write chunk too short to hold its offset: reported at the next commit.
    wire::write_frame_sync(&mut s, FrameKind::WriteChunk, &[b"abc"]).unwrap();
    let commit = MemserverRequest::Commit {
        offset: 0,
        checksum: "0".repeat(16),
    };
    expect_error(
        control_request(&mut s, &commit),
        ErrorCode::BadRequest,
        "no 8-byte offset",
    );
    let bad_sum = MemserverRequest::Commit {
        offset: 0,
        checksum: "xyz".into(),
    };
    expect_error(
        control_request(&mut s, &bad_sum),
        ErrorCode::BadRequest,
        "16 hex digits",
    );
    assert!(matches!(
        control_request(&mut s, &MemserverRequest::Stats),
        MemserverReply::Stats(_)
    ));
    assert_still_serving(&server);
}

#[test]
fn write_outside_the_extent_is_reported_at_commit() {
    let server = start(1 << 20);
    let mut c = server.client();
    let data = pattern(1024, 3);
    let off = c.alloc(1024, "m").unwrap();
    c.write(off + 1000, &data).unwrap(); // 1000 bytes past the end
    let e = c.commit(off, checksum(&data)).unwrap_err();
    let reply = e.server_error().expect("a server error");
    assert_eq!(reply.code, ErrorCode::BadRequest);
    assert!(
        reply.message.contains("rejected") && reply.message.contains("not inside"),
        "{reply}"
    );
    assert!(e.to_string().contains(&server.addr.to_string()), "{e}");
    // The extent is still writable: a correct write commits.
    c.write(off, &data).unwrap();
    c.commit(off, checksum(&data)).unwrap();
    // Writes into a committed extent are refused too.
    c.write(off, &data).unwrap();
    let e = c.commit(off, checksum(&data)).unwrap_err();
    assert!(e.to_string().contains("already committed"), "{e}");
    assert_still_serving(&server);
}

#[test]
fn checksum_mismatch_and_unknown_extents() {
    let server = start(1 << 20);
    let mut c = server.client();
    let data = pattern(5000, 4);
    let off = c.alloc(5000, "m").unwrap();
    c.write(off, &data).unwrap();
    let e = c.commit(off, checksum(&data) ^ 1).unwrap_err();
    assert_eq!(
        e.server_error().unwrap().code,
        ErrorCode::ChecksumMismatch,
        "{e}"
    );
    let mut d = raw(server.addr, Role::Data);
    assert_eq!(
        read(&mut d, 1, off, 10).0.status,
        ReadStatus::OutOfRange,
        "not readable"
    );
    c.commit(off, checksum(&data)).unwrap();
    assert_eq!(read(&mut d, 2, off, 10).0.status, ReadStatus::Ok);
    for e in [
        c.commit(off + 512, 0).unwrap_err(),
        c.free(123_456, "m").unwrap_err(),
    ] {
        assert_eq!(
            e.server_error().unwrap().code,
            ErrorCode::UnknownExtent,
            "{e}"
        );
    }
    assert_still_serving(&server);
}

#[test]
fn a_free_naming_another_owner_frees_nothing() {
    let server = start(1 << 20);
    let mut c = server.client();
    let data = pattern(4096, 7);
    let off = c.alloc(4096, "resnet152").unwrap();
    c.write(off, &data).unwrap();
    c.commit(off, checksum(&data)).unwrap();
    let e = c.free(off, "gpt2").unwrap_err();
    let reply = e.server_error().unwrap();
    assert_eq!(reply.code, ErrorCode::UnknownExtent, "{e}");
    assert!(
        reply.message.contains("belongs to resnet152, not gpt2"),
        "{}",
        reply.message
    );
    // Nothing was freed: the bytes are still served.
    let mut d = raw(server.addr, Role::Data);
    let (r, got) = read(&mut d, 1, off, 4096);
    assert_eq!((r.status, got), (ReadStatus::Ok, data));
    // A free that names no owner (as older clients send it) frees any.
    let mut ctl = raw(server.addr, Role::Control);
    let old_free = format!(r#"{{"op":"free","offset":{off}}}"#);
    wire::write_frame_sync(&mut ctl, FrameKind::Message, &[old_free.as_bytes()]).unwrap();
    assert_eq!(recv(&mut ctl), MemserverReply::Freed { offset: off });
    assert_eq!(c.stats().unwrap().extents, 0);
    assert_still_serving(&server);
}

#[test]
fn wrong_cluster_key_is_refused() {
    let server = start(1 << 20);
    let mut s = TcpStream::connect(server.addr).unwrap();
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    let wrong = ClusterKey::from_secret(b"not-the-cluster-key");
    let r = handshake::client_sync(&mut s, &wrong, Role::Control);
    assert!(
        matches!(r, Err(HandshakeError::ServerNotInCluster)),
        "{r:?}"
    );
    drop(s);
    eventually("the server to log the refusal", || {
        server.stats.handshakes_refused() == 1
    });
    // Garbage instead of a handshake is refused the same way.
    let mut g = TcpStream::connect(server.addr).unwrap();
    g.write_all(&[0xAB; 40]).unwrap();
    eventually("the garbage handshake refused", || {
        server.stats.handshakes_refused() == 2
    });
    assert_still_serving(&server);
}

#[test]
fn reads_outside_committed_extents() {
    let server = start(1 << 20);
    let mut c = server.client();
    let a = deploy(&mut c, &pattern(1024, 5), "a");
    let b = deploy(&mut c, &pattern(1024, 6), "b");
    assert_eq!(b, a + 1024);
    let writing = c.alloc(1024, "w").unwrap();
    let mut d = raw(server.addr, Role::Data);
    for (i, (o, l)) in [
        (writing, 10),
        (a + 1000, 100),
        (1 << 19, 1),
        (u64::MAX - 4, 8),
    ]
    .into_iter()
    .enumerate()
    {
        let (r, _) = read(&mut d, i as u64, o, l);
        assert_eq!(
            (r.wr_id, r.status),
            (i as u64, ReadStatus::OutOfRange),
            "{o}+{l}"
        );
    }
    // The connection survives out-of-range reads...
    assert_eq!(read(&mut d, 9, a, 1024).1, pattern(1024, 5));
    // ...but not a read over the bound, nor a malformed request.
    let (r, _) = read(&mut d, 10, a, READ_CHUNK_BYTES_MAX + 1);
    assert_eq!((r.wr_id, r.status), (10, ReadStatus::BadRequest));
    assert_closed(&mut d);
    let mut d = raw(server.addr, Role::Data);
    let mut bad = ReadRequest {
        wr_id: 11,
        offset: a,
        len: 1,
    }
    .encode();
    bad[0] = b'X';
    d.write_all(&bad).unwrap();
    assert_eq!(read_reply(&mut d).0.status, ReadStatus::BadRequest);
    assert_closed(&mut d);
    assert_still_serving(&server);
}

#[test]
fn full_memory_server_says_how_full() {
    let server = start(1 << 20);
    let mut c = server.client();
    let a = c.alloc(512 << 10, "a").unwrap();
    c.alloc(256 << 10, "b").unwrap();
    c.free(a, "a").unwrap();
    // 768 KiB free in total, the largest run is 512 KiB.
    let e = c.alloc(32_768_000, "huge").unwrap_err();
    let reply = e.server_error().unwrap();
    assert_eq!(reply.code, ErrorCode::Full);
    assert!(
        reply
            .message
            .contains("memory server full: asked 32768000 bytes, 786432 free (largest run 524288)"),
        "{reply}"
    );
    let e = c.alloc(0, "empty").unwrap_err();
    assert_eq!(e.server_error().unwrap().code, ErrorCode::BadRequest);
    let e = c.alloc(1, &"x".repeat(1000)).unwrap_err();
    assert_eq!(e.server_error().unwrap().code, ErrorCode::BadRequest);
    assert_still_serving(&server);
}
