//! Stage links: the driver's own control connection to each GPU server
//! that hosts stage workers, carrying `TrainStage`, `TrainStageStart` and
//! `TrainStageStop` and routing each answer back to its caller by request
//! id.
//!
//! One task per link owns the socket's write half and the table of calls
//! waiting for an answer; a reader task decodes replies and hands them to
//! it. Bounded: calls queued for the link ([`LINK_CALLS_QUEUED_MAX`]),
//! calls awaiting an answer ([`LINK_IN_FLIGHT_MAX`], the runtime's own
//! per-connection bound), the connect ([`LINK_CONNECT_TIMEOUT`]) and each
//! write ([`LINK_WRITE_TIMEOUT`]). A caller that stops waiting (its
//! timeout) frees its slot. When the link ends, for whatever reason, every
//! call still on it is answered with that reason and the driver hears it
//! ([`LinkDown`]); a link the driver drops ends silently.

use std::collections::HashMap;
use std::time::Duration;

use distmind_common::handshake::{self, ClusterKey};
use distmind_common::limits::CONTROL_FRAME_BYTES_MAX;
use distmind_common::proto::{RuntimeReply, RuntimeRequest};
use distmind_common::wire::{self, FrameKind, Role};
use tokio::io::BufReader;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

use crate::dispatch::net::{read_reply, req_id};

/// Calls waiting for the link task to write them.
pub const LINK_CALLS_QUEUED_MAX: usize = 256;
/// Calls written and not answered yet (a runtime serves 64 requests at
/// once per connection, `REQUESTS_IN_FLIGHT_PER_CONNECTION_MAX`; more
/// would only wait there).
pub const LINK_IN_FLIGHT_MAX: usize = 64;
/// Connecting to a GPU server and the cluster-key handshake.
pub const LINK_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Writing one request.
pub const LINK_WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// The answer to a call, or why there is none.
pub type CallResult = Result<RuntimeReply, String>;

/// A request for the link and where its answer goes.
#[derive(Debug)]
pub struct Call {
    pub request: RuntimeRequest,
    pub reply: oneshot::Sender<CallResult>,
}

/// A link ended by itself: its GPU server is unreachable or closed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkDown {
    pub runtime: u32,
    /// Which link of that runtime (the driver may have made a new one).
    pub instance: u64,
    pub why: String,
}

/// A link to one GPU server; dropping it ends the link's task.
#[derive(Debug)]
pub struct StageLink {
    pub addr: String,
    pub instance: u64,
    calls: mpsc::Sender<Call>,
    task: tokio::task::AbortHandle,
}

impl Drop for StageLink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl StageLink {
    /// Connects (in its own task) to runtime `runtime` at `addr`.
    pub fn open(
        runtime: u32,
        addr: &str,
        key: ClusterKey,
        instance: u64,
        down: mpsc::Sender<LinkDown>,
    ) -> StageLink {
        let (tx, rx) = mpsc::channel(LINK_CALLS_QUEUED_MAX);
        let task = tokio::spawn(run(runtime, addr.to_string(), key, rx, instance, down));
        StageLink {
            addr: addr.to_string(),
            instance,
            calls: tx,
            task: task.abort_handle(),
        }
    }

    /// A handle to queue calls with ([`call`]).
    pub fn caller(&self) -> mpsc::Sender<Call> {
        self.calls.clone()
    }
}

/// Sends `request` over the link and waits for its answer, at most
/// `timeout` (`timeout_name`: the constant, for the error) from now.
pub async fn call(
    calls: mpsc::Sender<Call>,
    request: RuntimeRequest,
    timeout: Duration,
    timeout_name: &str,
) -> CallResult {
    let (tx, rx) = oneshot::channel();
    let wait = async {
        calls
            .send(Call { request, reply: tx })
            .await
            .map_err(|_| "its stage link closed before the request was sent".to_string())?;
        rx.await
            .map_err(|_| "its stage link closed before the answer".to_string())?
    };
    tokio::time::timeout(timeout, wait)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {timeout:?} ({timeout_name})")))
}

async fn run(
    runtime: u32,
    addr: String,
    key: ClusterKey,
    mut calls: mpsc::Receiver<Call>,
    instance: u64,
    down: mpsc::Sender<LinkDown>,
) {
    let mut pending: HashMap<u64, oneshot::Sender<CallResult>> = HashMap::new();
    let why = serve(&addr, &key, &mut calls, &mut pending).await;
    log::warn!("training: the stage link to runtime {runtime} ({addr}) ended: {why}");
    for (_, tx) in pending.drain() {
        let _ = tx.send(Err(why.clone()));
    }
    calls.close();
    while let Ok(c) = calls.try_recv() {
        let _ = c.reply.send(Err(why.clone()));
    }
    let _ = down
        .send(LinkDown {
            runtime,
            instance,
            why,
        })
        .await;
}

/// Runs the link until it fails; returns why.
async fn serve(
    addr: &str,
    key: &ClusterKey,
    calls: &mut mpsc::Receiver<Call>,
    pending: &mut HashMap<u64, oneshot::Sender<CallResult>>,
) -> String {
    let connected = tokio::time::timeout(LINK_CONNECT_TIMEOUT, async {
        let mut s = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        let _ = s.set_nodelay(true);
        handshake::client(&mut s, key, Role::Control)
            .await
            .map_err(|e| e.to_string())?;
        Ok::<_, String>(s)
    })
    .await;
    let stream = match connected {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return format!("cannot connect to {addr}: {e}"),
        Err(_) => return format!("connecting to {addr} took over {LINK_CONNECT_TIMEOUT:?}"),
    };
    let (rd, mut wr) = stream.into_split();
    let (replies_tx, mut replies) = mpsc::channel::<CallResult>(LINK_IN_FLIGHT_MAX);
    let reader = tokio::spawn(async move {
        let mut rd = BufReader::new(rd);
        loop {
            let r = read_reply(&mut rd).await.map(|(reply, _, _)| reply);
            let failed = r.is_err();
            if replies_tx.send(r).await.is_err() || failed {
                return;
            }
        }
    });
    let _reader = AbortOnDrop(reader.abort_handle());
    loop {
        // Callers that gave up (their timeout) free their slot.
        pending.retain(|_, tx| !tx.is_closed());
        tokio::select! {
            c = calls.recv(), if pending.len() < LINK_IN_FLIGHT_MAX => {
                let Some(c) = c else {
                    return "the driver closed it".to_string();
                };
                let id = req_id(&c.request);
                let payload = wire::encode_message(&c.request);
                if payload.len() > CONTROL_FRAME_BYTES_MAX as usize {
                    let _ = c.reply.send(Err(format!(
                        "the request is {} bytes, more than a frame's {CONTROL_FRAME_BYTES_MAX}",
                        payload.len()
                    )));
                    continue;
                }
                let parts: [&[u8]; 1] = [&payload];
                let write = wire::write_frame(&mut wr, FrameKind::Message, &parts);
                match tokio::time::timeout(LINK_WRITE_TIMEOUT, write).await {
                    Ok(Ok(())) => {
                        if let Some(old) = pending.insert(id, c.reply) {
                            let _ = old.send(Err(format!("request id {id} was reused")));
                        }
                    }
                    Ok(Err(e)) => {
                        let why = format!("cannot write to {addr}: {e}");
                        let _ = c.reply.send(Err(why.clone()));
                        return why;
                    }
                    Err(_) => {
                        let why = format!("writing to {addr} took over {LINK_WRITE_TIMEOUT:?}");
                        let _ = c.reply.send(Err(why.clone()));
                        return why;
                    }
                }
            }
            r = replies.recv() => match r {
                Some(Ok(reply)) => match pending.remove(&reply.id()) {
                    Some(tx) => {
                        let _ = tx.send(Ok(reply));
                    }
                    None => log::debug!(
                        "training: a reply from {addr} for no waiting request: {reply:?}"
                    ),
                },
                Some(Err(e)) => return e,
                None => return "its reader ended".to_string(),
            },
        }
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distmind_common::proto::{ErrorCode, ErrorReply};
    use tokio::net::TcpListener;

    fn key() -> ClusterKey {
        ClusterKey::from_secret(b"stage-link-unit-test-key")
    }

    fn stop(id: u64) -> RuntimeRequest {
        RuntimeRequest::TrainStageStop {
            id,
            job: "j-1".into(),
            pipeline: 0,
            stage: id as u32,
            generation: 0,
        }
    }

    /// A GPU server that reads `n` requests, then answers them in reverse
    /// order (an error for odd ids), then closes the connection.
    async fn fake_runtime(listener: TcpListener, n: usize) {
        let (mut s, _) = listener.accept().await.unwrap();
        handshake::server(&mut s, &key()).await.unwrap();
        let mut ids = Vec::new();
        for _ in 0..n {
            let req: RuntimeRequest = wire::recv_message(&mut s, CONTROL_FRAME_BYTES_MAX)
                .await
                .unwrap();
            ids.push(req_id(&req));
        }
        for id in ids.into_iter().rev() {
            let reply = if id % 2 == 1 {
                RuntimeReply::Error {
                    id,
                    error: ErrorReply::new(ErrorCode::Unsupported, format!("no {id}")),
                }
            } else {
                RuntimeReply::Training {
                    id,
                    device: 0,
                    model: None,
                    iterations: id,
                }
            };
            wire::send_message(&mut s, &reply).await.unwrap();
        }
    }

    #[tokio::test]
    async fn answers_reach_their_callers_out_of_order_and_a_closed_link_says_why() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = tokio::spawn(fake_runtime(listener, 3));
        let (down_tx, mut down) = mpsc::channel(4);
        let link = StageLink::open(7, &addr, key(), 1, down_tx);
        let calls: Vec<_> = (1..=3)
            .map(|id| {
                let c = link.caller();
                tokio::spawn(call(c, stop(id), Duration::from_secs(30), "T"))
            })
            .collect();
        for (id, c) in (1..=3u64).zip(calls) {
            match c.await.unwrap() {
                Ok(RuntimeReply::Training { id: got, .. }) => assert_eq!((id % 2, got), (0, id)),
                Ok(RuntimeReply::Error { id: got, error }) => {
                    assert_eq!((id % 2, got), (1, id));
                    assert_eq!(error.message, format!("no {id}"));
                }
                r => panic!("{r:?}"),
            }
        }
        server.await.unwrap();
        // The runtime closed the connection: the driver hears it, and a
        // call on the dead link says why.
        let d = down.recv().await.unwrap();
        assert_eq!((d.runtime, d.instance), (7, 1));
        assert_eq!(d.why, "the runtime closed the connection");
        let e = call(link.caller(), stop(4), Duration::from_secs(30), "T")
            .await
            .unwrap_err();
        assert!(e.starts_with("its stage link closed"), "{e}");
    }

    #[tokio::test]
    async fn an_unreachable_runtime_or_a_silent_one_is_named() {
        // Nothing listens there any more.
        let addr = {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            l.local_addr().unwrap().to_string()
        };
        let (down_tx, mut down) = mpsc::channel(4);
        let link = StageLink::open(3, &addr, key(), 9, down_tx.clone());
        let e = call(link.caller(), stop(2), Duration::from_secs(30), "T")
            .await
            .unwrap_err();
        assert!(e.starts_with(&format!("cannot connect to {addr}")), "{e}");
        assert_eq!(down.recv().await.unwrap().instance, 9);

        // A runtime that takes requests and never answers: the caller's
        // own timeout, named.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            handshake::server(&mut s, &key()).await.unwrap();
            let _: RuntimeRequest = wire::recv_message(&mut s, CONTROL_FRAME_BYTES_MAX)
                .await
                .unwrap();
            s
        });
        let link = StageLink::open(4, &addr, key(), 10, down_tx);
        let e = call(
            link.caller(),
            stop(2),
            Duration::from_millis(100),
            "STAGE_STOP_TIMEOUT",
        )
        .await
        .unwrap_err();
        assert_eq!(e, "no answer within 100ms (STAGE_STOP_TIMEOUT)");
        drop(server.await.unwrap());
    }
}
