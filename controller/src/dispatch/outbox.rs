//! Bytes bound for one socket, written by the task that produced them.
//!
//! The dispatcher's core task encodes a request for a runtime (or a reply
//! for a client) and writes it to the socket itself with a non-blocking
//! write: no hand-off to another task, so no wake-up of another thread
//! between the decision and the bytes leaving. Only what the socket does
//! not take at once (its send buffer is full, or it is not connected yet)
//! waits in the outbox for the socket's writer task, which writes it as
//! the socket drains.
//!
//! Everything staged during one turn of the core task leaves in one write
//! ([`Outbox::flush`]), so a burst of requests to one runtime or replies to
//! one client shares a syscall.
//!
//! Bounded: staged and waiting bytes together at most the outbox's bound;
//! past it [`Outbox::stage_request`], [`Outbox::stage_reply`] and
//! [`Outbox::stage_raw`] refuse (the peer is not keeping up).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use distmind_common::proto::{RuntimeReply, RuntimeRequest};
use distmind_common::wire::{FrameHeader, FrameKind, FRAME_HEADER_BYTES};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::{Notify, OwnedSemaphorePermit};

/// Why bytes could not be staged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutboxError {
    /// Over the outbox's bound: the peer does not read fast enough.
    Full { bytes: usize, max: usize },
    /// An earlier write failed; the connection is finished.
    Closed(String),
}

impl std::fmt::Display for OutboxError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OutboxError::Full { bytes, max } => write!(
                f,
                "{bytes} bytes are waiting to be written, at most {max}; the peer is not keeping up"
            ),
            OutboxError::Closed(why) => write!(f, "the connection failed: {why}"),
        }
    }
}

#[derive(Default)]
struct State {
    /// Bytes staged since the last flush, and the permits they release
    /// once written (a client's in-flight bound).
    staged: Vec<u8>,
    staged_permits: Vec<OwnedSemaphorePermit>,
    /// Flushed bytes the socket did not take yet, oldest first; the first
    /// one written up to `offset`.
    waiting: VecDeque<(Vec<u8>, Vec<OwnedSemaphorePermit>)>,
    offset: usize,
    /// Staged plus waiting bytes (less `offset`).
    bytes: usize,
    failed: Option<String>,
}

/// One socket's outgoing bytes; see the module docs.
pub struct Outbox {
    state: Mutex<State>,
    /// Set once the connection is up (a link connects after its outbox is
    /// made, so that what is sent meanwhile waits here).
    wr: OnceLock<OwnedWriteHalf>,
    wake: Notify,
    max: usize,
}

impl Outbox {
    /// An outbox of at most `max` bytes, connected later ([`Outbox::connect`]).
    pub fn new(max: usize) -> Arc<Outbox> {
        Arc::new(Outbox {
            state: Mutex::new(State::default()),
            wr: OnceLock::new(),
            wake: Notify::new(),
            max,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands the outbox its socket; the writer task ([`Outbox::drain`])
    /// then writes what waited.
    pub fn connect(&self, wr: OwnedWriteHalf) {
        let _ = self.wr.set(wr);
        self.wake.notify_one();
    }

    /// Stages a request to a runtime, then `inputs` as write-chunk frames.
    /// Returns whether the outbox had nothing staged before (the caller
    /// flushes it at the end of its turn).
    pub fn stage_request(
        &self,
        req: &RuntimeRequest,
        inputs: &[&[u8]],
    ) -> Result<bool, OutboxError> {
        self.stage_with(
            |buf| encode_into(buf, |b| serde_json::to_writer(b, req)),
            inputs,
            None,
        )
    }

    /// Stages a reply to a client, then `frames` as write-chunk frames,
    /// released with `permit` once written; returns as
    /// [`Outbox::stage_request`] does.
    pub fn stage_reply(
        &self,
        reply: &RuntimeReply,
        frames: &[&[u8]],
        permit: Option<OwnedSemaphorePermit>,
    ) -> Result<bool, OutboxError> {
        self.stage_with(
            |buf| encode_into(buf, |b| serde_json::to_writer(b, reply)),
            frames,
            permit,
        )
    }

    /// Like [`Outbox::stage_reply`] with the message frame's payload given as
    /// bytes already encoded, in parts.
    pub fn stage_raw(
        &self,
        message: &[&[u8]],
        frames: &[&[u8]],
        permit: Option<OwnedSemaphorePermit>,
    ) -> Result<bool, OutboxError> {
        self.stage_with(
            |buf| {
                let len: usize = message.iter().map(|p| p.len()).sum();
                let h = FrameHeader {
                    kind: FrameKind::Message,
                    len: len as u32,
                };
                buf.extend_from_slice(&h.encode());
                for p in message {
                    buf.extend_from_slice(p);
                }
            },
            frames,
            permit,
        )
    }

    fn stage_with(
        &self,
        message: impl FnOnce(&mut Vec<u8>),
        frames: &[&[u8]],
        permit: Option<OwnedSemaphorePermit>,
    ) -> Result<bool, OutboxError> {
        let mut s = self.lock();
        if let Some(why) = &s.failed {
            return Err(OutboxError::Closed(why.clone()));
        }
        if s.bytes >= self.max {
            return Err(OutboxError::Full {
                bytes: s.bytes,
                max: self.max,
            });
        }
        let first = s.staged.is_empty();
        let before = s.staged.len();
        message(&mut s.staged);
        for f in frames {
            let h = FrameHeader {
                kind: FrameKind::WriteChunk,
                len: f.len() as u32,
            };
            s.staged.extend_from_slice(&h.encode());
            s.staged.extend_from_slice(f);
        }
        s.bytes += s.staged.len() - before;
        s.staged_permits.extend(permit);
        Ok(first)
    }

    /// Writes what was staged: at once when nothing waits before it and
    /// the socket takes it, else (what is left) by the writer task.
    pub fn flush(&self) {
        let mut s = self.lock();
        if s.staged.is_empty() {
            return;
        }
        let mut buf = std::mem::take(&mut s.staged);
        let permits = std::mem::take(&mut s.staged_permits);
        let mut written = 0;
        if s.waiting.is_empty() && s.failed.is_none() {
            if let Some(wr) = self.wr.get() {
                while written < buf.len() {
                    match wr.try_write(&buf[written..]) {
                        Ok(n) => written += n,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(e) => {
                            s.failed = Some(e.to_string());
                            break;
                        }
                    }
                }
            }
        }
        s.bytes -= written;
        if written == buf.len() {
            drop(permits);
            // Keep the allocation for the next turn.
            buf.clear();
            if s.staged.capacity() < buf.capacity() {
                s.staged = buf;
            }
            if s.failed.is_some() {
                self.wake.notify_one();
            }
            return;
        }
        if s.waiting.is_empty() {
            s.offset = written;
        }
        s.waiting.push_back((buf, permits));
        drop(s);
        self.wake.notify_one();
    }

    /// The writer task's loop: writes what waits as the socket takes it,
    /// until the socket fails; returns why. Writes first and waits after,
    /// so a wake-up taken by an earlier, cancelled call is not lost.
    pub async fn drain(&self) -> String {
        loop {
            if let Some(why) = self.lock().failed.clone() {
                return why;
            }
            let blocked = match self.wr.get() {
                None => false,
                Some(wr) => {
                    let mut s = self.lock();
                    let mut blocked = false;
                    while let Some((buf, _)) = s.waiting.front() {
                        match wr.try_write(&buf[s.offset..]) {
                            Ok(n) => {
                                s.offset += n;
                                s.bytes -= n;
                                if s.offset == s.waiting[0].0.len() {
                                    // Its permits go with it: written.
                                    s.waiting.pop_front();
                                    s.offset = 0;
                                }
                            }
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                                blocked = true;
                                break;
                            }
                            Err(e) => {
                                let why = e.to_string();
                                s.failed = Some(why.clone());
                                return why;
                            }
                        }
                    }
                    blocked
                }
            };
            match self.wr.get() {
                Some(wr) if blocked => {
                    if let Err(e) = wr.writable().await {
                        let why = e.to_string();
                        self.lock().failed = Some(why.clone());
                        return why;
                    }
                }
                _ => self.wake.notified().await,
            }
        }
    }

    /// Fails the outbox: nothing more is staged, and the writer task ends
    /// with `why` (a client that does not read its replies is dropped).
    pub fn close(&self, why: String) {
        let mut s = self.lock();
        if s.failed.is_none() {
            s.failed = Some(why);
        }
        drop(s);
        self.wake.notify_one();
    }

    /// Bytes staged or waiting.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }
}

/// Appends a message frame whose payload `encode` writes.
fn encode_into(buf: &mut Vec<u8>, encode: impl FnOnce(&mut Vec<u8>) -> serde_json::Result<()>) {
    let at = buf.len();
    buf.extend_from_slice(&[0; FRAME_HEADER_BYTES]);
    encode(buf).expect("protocol messages always serialise");
    let h = FrameHeader {
        kind: FrameKind::Message,
        len: (buf.len() - at - FRAME_HEADER_BYTES) as u32,
    };
    buf[at..at + FRAME_HEADER_BYTES].copy_from_slice(&h.encode());
}

#[cfg(test)]
mod tests {
    use super::*;
    use distmind_common::proto::{ErrorCode, ErrorReply};
    use distmind_common::wire;
    use tokio::io::AsyncReadExt;
    use tokio::sync::Semaphore;

    async fn pair() -> (OwnedWriteHalf, tokio::net::TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let c = tokio::net::TcpStream::connect(l.local_addr().unwrap());
        let (c, s) = tokio::join!(c, l.accept());
        let (_, wr) = c.unwrap().into_split();
        (wr, s.unwrap().0)
    }

    fn reply(id: u64) -> RuntimeReply {
        RuntimeReply::Error {
            id,
            error: ErrorReply::new(ErrorCode::Busy, "x"),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn what_the_socket_does_not_take_is_written_by_the_writer_in_order() {
        let (wr, mut peer) = pair().await;
        let out = Outbox::new(64 << 20);
        out.connect(wr);
        let writer = {
            let out = out.clone();
            tokio::spawn(async move { out.drain().await })
        };
        // Far more than a socket buffer, nobody reading yet: most of it
        // waits, and the permits with it.
        let permits = Arc::new(Semaphore::new(8));
        let big = vec![7u8; 4 << 20];
        for id in 0..8 {
            let p = permits.clone().try_acquire_owned().unwrap();
            // Flushed each time: each is the first staged since.
            assert_eq!(out.stage_reply(&reply(id), &[&big], Some(p)), Ok(true));
            out.flush();
        }
        assert!(out.bytes() > 0, "a socket buffer does not hold 32 MiB");
        assert!(
            permits.available_permits() < 8,
            "unwritten replies hold their permits"
        );
        for id in 0..8 {
            let msg: RuntimeReply = wire::recv_message(&mut peer, 1 << 20).await.unwrap();
            assert_eq!(msg, reply(id));
            let (kind, b) = wire::read_frame(&mut peer, 8 << 20).await.unwrap().unwrap();
            assert_eq!((kind, b.len()), (FrameKind::WriteChunk, big.len()));
        }
        // Everything written: every permit back, nothing waiting.
        let _all =
            tokio::time::timeout(std::time::Duration::from_secs(10), permits.acquire_many(8))
                .await
                .unwrap();
        assert_eq!(out.bytes(), 0);
        drop(peer);
        writer.abort();
    }

    #[tokio::test]
    async fn past_its_bound_or_closed_it_refuses() {
        let out = Outbox::new(100);
        // Not connected: staged and flushed bytes wait.
        assert_eq!(out.stage_reply(&reply(1), &[&[0u8; 200]], None), Ok(true));
        out.flush();
        assert!(out.bytes() > 100);
        assert!(matches!(
            out.stage_reply(&reply(2), &[], None),
            Err(OutboxError::Full { .. })
        ));
        out.close("gone".into());
        assert_eq!(
            out.stage_reply(&reply(3), &[], None),
            Err(OutboxError::Closed("gone".into()))
        );
        assert_eq!(out.drain().await, "gone");
        // Requests are framed the same way.
        let (wr, mut peer) = pair().await;
        let out = Outbox::new(1 << 20);
        out.connect(wr);
        let req = RuntimeRequest::Stats { id: 9 };
        assert_eq!(out.stage_request(&req, &[b"in"]), Ok(true));
        out.flush();
        let got: RuntimeRequest = wire::recv_message(&mut peer, 1 << 20).await.unwrap();
        assert_eq!(got, req);
        let mut hb = [0u8; FRAME_HEADER_BYTES + 2];
        peer.read_exact(&mut hb).await.unwrap();
        assert_eq!(&hb[FRAME_HEADER_BYTES..], b"in");
    }
}
