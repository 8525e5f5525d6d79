//! Registration and heartbeats against a fake controller that speaks the real
//! handshake and frames: the controller is down at first, comes up, drops the
//! connection (a restart), and the memory server registers again with the
//! same boot id.
mod common;

use std::time::Duration;

use common::*;
use distmind_common::handshake;
use distmind_common::limits::CONTROL_FRAME_BYTES_MAX;
use distmind_common::proto::{ControllerReply, ControllerRequest};
use distmind_common::wire;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

const MEMSERVER_ID: u32 = 7;
/// Heartbeats the fake controller takes on one connection before dropping it.
const HEARTBEATS_PER_CONNECTION: usize = 3;

/// Accepts connections and reports every request it receives.
async fn fake_controller(listener: TcpListener, events: mpsc::UnboundedSender<ControllerRequest>) {
    loop {
        let (mut s, _) = listener.accept().await.unwrap();
        handshake::server(&mut s, &key())
            .await
            .expect("memserver proves the key");
        let mut heartbeats = 0;
        loop {
            let req: ControllerRequest =
                match wire::recv_message(&mut s, CONTROL_FRAME_BYTES_MAX).await {
                    Ok(r) => r,
                    Err(_) => break,
                };
            let reply = match &req {
                ControllerRequest::RegisterMemserver { .. } => ControllerReply::Registered {
                    memserver: MEMSERVER_ID,
                    heartbeat_interval_ms: 20,
                },
                ControllerRequest::Heartbeat { .. } => {
                    heartbeats += 1;
                    ControllerReply::HeartbeatOk
                }
                other => panic!("unexpected request {other:?}"),
            };
            events.send(req).unwrap();
            if heartbeats == HEARTBEATS_PER_CONNECTION {
                break; // "restart": drop the connection without replying
            }
            wire::send_message(&mut s, &reply).await.unwrap();
        }
    }
}

async fn next(events: &mut mpsc::UnboundedReceiver<ControllerRequest>) -> ControllerRequest {
    tokio::time::timeout(TIMEOUT, events.recv())
        .await
        .expect("an event in time")
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_heartbeats_and_reregisters_after_a_controller_restart() {
    // A port with no controller on it yet.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let controller = format!("127.0.0.1:{port}");
    let server = tokio::task::spawn_blocking(move || {
        start_with(1 << 20, |c| {
            c.controller = Some(controller);
            c.advertise = Some("memhost-1:7000".into());
        })
    })
    .await
    .unwrap();
    // Let it fail to connect at least once, then bring the controller up.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let listener = TcpListener::bind(("127.0.0.1", port)).await.unwrap();
    let (tx, mut events) = mpsc::unbounded_channel();
    let fake = tokio::spawn(fake_controller(listener, tx));

    let boot_id = match next(&mut events).await {
        ControllerRequest::RegisterMemserver {
            addr,
            capacity_bytes,
            boot_id,
        } => {
            assert_eq!(addr, "memhost-1:7000");
            assert_eq!(capacity_bytes, 1 << 20);
            boot_id
        }
        other => panic!("expected a registration, got {other:?}"),
    };
    for _ in 0..HEARTBEATS_PER_CONNECTION {
        match next(&mut events).await {
            ControllerRequest::Heartbeat {
                memserver,
                boot_id: b,
                used_bytes,
            } => {
                assert_eq!((memserver, b, used_bytes), (MEMSERVER_ID, boot_id, 0));
            }
            other => panic!("expected a heartbeat, got {other:?}"),
        }
    }
    // The controller dropped the connection: the server registers again with
    // the same boot id (its arena is intact), and heartbeats carry used bytes.
    match next(&mut events).await {
        ControllerRequest::RegisterMemserver { boot_id: b, .. } => assert_eq!(b, boot_id),
        other => panic!("expected a re-registration, got {other:?}"),
    }
    let addr = server.addr.to_string();
    tokio::task::spawn_blocking(move || {
        let mut c = distmind_memserver::MemserverClient::connect(&addr, &key(), TIMEOUT).unwrap();
        c.alloc(1000, "m").unwrap();
    })
    .await
    .unwrap();
    loop {
        match next(&mut events).await {
            ControllerRequest::Heartbeat {
                used_bytes: 1024,
                boot_id: b,
                ..
            } => {
                assert_eq!(b, boot_id);
                break;
            }
            ControllerRequest::Heartbeat { used_bytes: 0, .. } => continue,
            ControllerRequest::RegisterMemserver { boot_id: b, .. } => assert_eq!(b, boot_id),
            other => panic!("unexpected {other:?}"),
        }
    }
    fake.abort();
    tokio::task::spawn_blocking(move || drop(server))
        .await
        .unwrap();
}
