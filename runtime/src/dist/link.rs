//! A link between two adjacent pipeline stages: activations one way,
//! gradients the other, over one TCP connection.
//!
//! After the opening ([`super::listener`]), each side sends one credit
//! *grant*: its receive window, the messages it will hold unread. A side
//! sends a message only with a credit in hand, and gets the credit back in a
//! credit *return* when the peer's application has taken the message
//! ([`StageLink::recv`]). So at most `window` messages are in flight per
//! direction, and a fast stage blocks in [`StageLink::send`] instead of
//! buffering without limit.
//!
//! ```text
//! credit frame (16 bytes, little-endian)
//!   0..4   tag "DMCR"
//!   4..6   kind u16: 1 grant (first frame each way), 2 return
//!   6..8   reserved u16, 0
//!   8..16  count u64 (grant: 1..=LINK_WINDOW_MAX; return: 1..=in flight)
//! message frame: a stage message as `super::tensor` encodes it (tag "DMTM")
//! ```
//!
//! Blocking std::net and one reader thread per link: stage workers are
//! threads, the reader keeps credits flowing while the stage computes, and
//! it drains the socket into a queue bounded by the window, so neither side
//! can wedge the other's writes.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam::channel::{Receiver, RecvTimeoutError, Sender, TrySendError};
use distmind_common::handshake::{ClusterKey, HandshakeError};
use distmind_transport::TokenBucket;

use super::limits::LINK_WINDOW_MAX;
use super::listener::{dial, ConnSlot, DialError, DistListener, Hello, PendingKey, Refusal};
use super::tensor::{
    MessageError, MessageHeader, MessageLimits, StageMessage, MESSAGE_HEADER_BYTES, MESSAGE_TAG,
};

const CREDIT_TAG: [u8; 4] = *b"DMCR";
const CREDIT_FRAME_BYTES: usize = 16;
const CREDIT_GRANT: u16 = 1;
const CREDIT_RETURN: u16 = 2;

/// One link as seen from one side: this side's stage (`from`) and the
/// peer's (`to`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LinkId {
    pub job: u64,
    pub pipeline: u32,
    pub from: u32,
    pub to: u32,
}

impl fmt::Display for LinkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "job {} pipeline {} stage {}->{}",
            self.job, self.pipeline, self.from, self.to
        )
    }
}

/// How a link behaves; both sides should use the same window and limits.
#[derive(Debug, Clone)]
pub struct LinkOptions {
    pub key: ClusterKey,
    /// Messages in flight per direction: the 1F1B in-flight bound.
    pub window: u32,
    pub limits: MessageLimits,
    /// How long [`StageLink::recv`] waits for a message.
    pub recv_timeout: Duration,
    /// How long [`StageLink::send`] waits for a credit.
    pub send_timeout: Duration,
    /// Bounds the TCP connect and the opening.
    pub connect_timeout: Duration,
    /// Bounds one socket write (a peer that stops reading).
    pub io_timeout: Duration,
    /// Paces this side's sends, to emulate a slower network.
    pub rate_limit_bytes_per_s: Option<u64>,
}

impl LinkOptions {
    pub fn new(key: ClusterKey, window: u32) -> Self {
        LinkOptions {
            key,
            window,
            limits: MessageLimits::default(),
            recv_timeout: Duration::from_secs(60),
            send_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(10),
            io_timeout: Duration::from_secs(60),
            rate_limit_bytes_per_s: None,
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.window == 0 || self.window > LINK_WINDOW_MAX {
            return Err(format!(
                "window {} outside 1..={LINK_WINDOW_MAX} (LINK_WINDOW_MAX)",
                self.window
            ));
        }
        self.limits.validate().map_err(|e| e.to_string())?;
        for (name, d) in [
            ("recv_timeout", self.recv_timeout),
            ("send_timeout", self.send_timeout),
            ("connect_timeout", self.connect_timeout),
            ("io_timeout", self.io_timeout),
        ] {
            if d.is_zero() {
                return Err(format!("{name} is zero"));
            }
        }
        if self.rate_limit_bytes_per_s == Some(0) {
            return Err("rate_limit_bytes_per_s = 0: use None for no limit".into());
        }
        Ok(())
    }
}

/// What went wrong on a link; every variant names the link and the peer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LinkError {
    #[error("{link}: invalid link options: {detail}")]
    Options { link: LinkId, detail: String },
    #[error("{link}: cannot connect to {peer}: {source} (is the peer worker running and its listener bound?)")]
    Connect {
        peer: SocketAddr,
        link: LinkId,
        #[source]
        source: io::Error,
    },
    #[error("{link}: cluster-key handshake with {peer} failed: {source}")]
    Handshake {
        peer: SocketAddr,
        link: LinkId,
        #[source]
        source: HandshakeError,
    },
    #[error("{link}: {peer} refused the link: {refusal}")]
    Refused {
        peer: SocketAddr,
        link: LinkId,
        refusal: Refusal,
    },
    #[error("{link}: no connection from stage {} reached the listener on {listener} within {waited:?} (did the peer stage start and dial this worker?)", link.to)]
    AcceptTimeout {
        listener: SocketAddr,
        link: LinkId,
        waited: Duration,
    },
    #[error("{link}: {peer} closed the link ({how})")]
    Closed {
        peer: SocketAddr,
        link: LinkId,
        how: String,
    },
    #[error(
        "{link}: no message from {peer} within {waited:?} (is the peer stage alive and sending?)"
    )]
    RecvTimeout {
        peer: SocketAddr,
        link: LinkId,
        waited: Duration,
    },
    #[error("{link}: {peer} returned no credit within {waited:?}: it holds {in_flight} messages unread (is the peer stage stuck?)")]
    SendTimeout {
        peer: SocketAddr,
        link: LinkId,
        waited: Duration,
        in_flight: u32,
    },
    #[error("{link}: i/o error with {peer} while {what}: {source}")]
    Io {
        peer: SocketAddr,
        link: LinkId,
        what: &'static str,
        #[source]
        source: Arc<io::Error>,
    },
    #[error("{link}: protocol violation by {peer}: {detail}")]
    Protocol {
        peer: SocketAddr,
        link: LinkId,
        detail: String,
    },
    #[error("{link}: bad message from {peer}: {source}")]
    BadMessage {
        peer: SocketAddr,
        link: LinkId,
        #[source]
        source: Box<MessageError>,
    },
    #[error("{link}: message not sent to {peer}: {source}")]
    Unsendable {
        peer: SocketAddr,
        link: LinkId,
        #[source]
        source: Box<MessageError>,
    },
}

/// Why a link stopped, kept to answer every later call.
#[derive(Debug, Clone)]
enum Failure {
    /// This side dropped the link (only its own threads see this).
    Local,
    Closed(String),
    Io(&'static str, Arc<io::Error>),
    Protocol(String),
    BadMessage(MessageError),
}

#[derive(Debug, Default)]
struct Flow {
    /// The peer's receive window, once its grant arrived.
    granted: Option<u32>,
    in_flight: u32,
    failure: Option<Failure>,
}

struct Shared {
    flow: Mutex<Flow>,
    changed: Condvar,
}

impl Shared {
    /// Records why the link stopped (the first reason wins).
    fn fail(&self, f: Failure) {
        let mut flow = self.flow.lock().unwrap();
        if flow.failure.is_none() {
            flow.failure = Some(f);
        }
        drop(flow);
        self.changed.notify_all();
    }
}

struct Writer {
    stream: TcpStream,
    scratch: Vec<u8>,
}

/// One side of a link between adjacent stages. `send` and `recv` take
/// `&self`, so a forward and a backward thread may share it.
pub struct StageLink {
    id: LinkId,
    peer: SocketAddr,
    local: SocketAddr,
    window: u32,
    limits: MessageLimits,
    recv_timeout: Duration,
    send_timeout: Duration,
    bucket: Option<TokenBucket>,
    shared: Arc<Shared>,
    inbox: Receiver<StageMessage>,
    writer: Mutex<Writer>,
    /// Wakes the reader on drop.
    control: TcpStream,
    reader: Option<JoinHandle<()>>,
    _slot: Option<ConnSlot>,
}

impl fmt::Debug for StageLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StageLink")
            .field("id", &self.id)
            .field("peer", &self.peer)
            .field("window", &self.window)
            .finish()
    }
}

fn io_failure(e: io::Error, what: &'static str) -> Failure {
    match e.kind() {
        io::ErrorKind::UnexpectedEof => {
            Failure::Closed(format!("end of stream in the middle of {what}"))
        }
        io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::BrokenPipe => Failure::Closed(format!("{e} while {what}")),
        _ => Failure::Io(what, Arc::new(e)),
    }
}

fn credit_frame(kind: u16, count: u64) -> [u8; CREDIT_FRAME_BYTES] {
    let mut b = [0u8; CREDIT_FRAME_BYTES];
    b[0..4].copy_from_slice(&CREDIT_TAG);
    b[4..6].copy_from_slice(&kind.to_le_bytes());
    b[8..16].copy_from_slice(&count.to_le_bytes());
    b
}

impl StageLink {
    /// Dials the peer stage's listener at `addr`. `id.from` is this side's
    /// stage, `id.to` the peer's.
    pub fn connect(addr: SocketAddr, id: LinkId, opts: LinkOptions) -> Result<Self, LinkError> {
        opts.validate()
            .map_err(|detail| LinkError::Options { link: id, detail })?;
        let hello = Hello::StageLink {
            job: id.job,
            pipeline: id.pipeline,
            from: id.from,
            to: id.to,
        };
        let stream = dial(addr, &opts.key, &hello, opts.connect_timeout).map_err(|e| match e {
            DialError::Connect(source) => LinkError::Connect {
                peer: addr,
                link: id,
                source,
            },
            DialError::Handshake(source) => LinkError::Handshake {
                peer: addr,
                link: id,
                source,
            },
            DialError::Hello(source) => LinkError::Io {
                peer: addr,
                link: id,
                what: "exchanging the opening hello",
                source: Arc::new(io::Error::other(source)),
            },
            DialError::Refused(refusal) => LinkError::Refused {
                peer: addr,
                link: id,
                refusal,
            },
        })?;
        Self::start(stream, addr, id, opts, None)
    }

    /// Takes the link that stage `peer_stage` dialled (or will dial) to
    /// `listener`, waiting up to `timeout`.
    pub fn accept(
        listener: &DistListener,
        peer_stage: u32,
        opts: LinkOptions,
        timeout: Duration,
    ) -> Result<Self, LinkError> {
        let me = listener.identity();
        let id = LinkId {
            job: me.job,
            pipeline: me.pipeline,
            from: me.stage,
            to: peer_stage,
        };
        opts.validate()
            .map_err(|detail| LinkError::Options { link: id, detail })?;
        let p = listener
            .take(
                &PendingKey::Stage { from: peer_stage },
                Instant::now() + timeout,
            )
            .ok_or(LinkError::AcceptTimeout {
                listener: listener.local_addr(),
                link: id,
                waited: timeout,
            })?;
        Self::start(p.stream, p.peer, id, opts, Some(p.slot))
    }

    fn start(
        stream: TcpStream,
        peer: SocketAddr,
        id: LinkId,
        opts: LinkOptions,
        slot: Option<ConnSlot>,
    ) -> Result<Self, LinkError> {
        let io_err = |what, e: io::Error| LinkError::Io {
            peer,
            link: id,
            what,
            source: Arc::new(e),
        };
        // The reader waits as long as the link lives; recv bounds the wait.
        stream
            .set_read_timeout(None)
            .map_err(|e| io_err("setting socket timeouts", e))?;
        stream
            .set_write_timeout(Some(opts.io_timeout))
            .map_err(|e| io_err("setting socket timeouts", e))?;
        let local = stream
            .local_addr()
            .map_err(|e| io_err("reading the local address", e))?;
        let clone = |s: &TcpStream| s.try_clone().map_err(|e| io_err("cloning the socket", e));
        let (read_half, control) = (clone(&stream)?, clone(&stream)?);
        let shared = Arc::new(Shared {
            flow: Mutex::new(Flow::default()),
            changed: Condvar::new(),
        });
        let (tx, inbox) = crossbeam::channel::bounded(opts.window as usize);
        let reader = {
            let (sh, limits, window) = (shared.clone(), opts.limits, opts.window);
            std::thread::Builder::new()
                .name(format!("dm-link-{}-{}>{}", id.pipeline, id.from, id.to))
                .spawn(move || reader_loop(read_half, &sh, &tx, &limits, window))
                .map_err(|e| io_err("starting the reader thread", e))?
        };
        let link = StageLink {
            id,
            peer,
            local,
            window: opts.window,
            limits: opts.limits,
            recv_timeout: opts.recv_timeout,
            send_timeout: opts.send_timeout,
            bucket: opts.rate_limit_bytes_per_s.map(TokenBucket::new),
            shared,
            inbox,
            writer: Mutex::new(Writer {
                stream,
                scratch: Vec::new(),
            }),
            control,
            reader: Some(reader),
            _slot: slot,
        };
        link.write_credit(CREDIT_GRANT, opts.window.into())?;
        Ok(link)
    }

    pub fn id(&self) -> LinkId {
        self.id
    }

    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Messages sent and not yet taken by the peer's application.
    pub fn in_flight(&self) -> u32 {
        self.shared.flow.lock().unwrap().in_flight
    }

    fn error(&self, f: Failure) -> LinkError {
        let (peer, link) = (self.peer, self.id);
        match f {
            Failure::Local => LinkError::Closed {
                peer,
                link,
                how: "closed by this side".into(),
            },
            Failure::Closed(how) => LinkError::Closed { peer, link, how },
            Failure::Io(what, source) => LinkError::Io {
                peer,
                link,
                what,
                source,
            },
            Failure::Protocol(detail) => LinkError::Protocol { peer, link, detail },
            Failure::BadMessage(source) => LinkError::BadMessage {
                peer,
                link,
                source: Box::new(source),
            },
        }
    }

    fn failure(&self) -> LinkError {
        let f = self.shared.flow.lock().unwrap().failure.clone();
        self.error(f.unwrap_or(Failure::Closed("reader stopped".into())))
    }

    /// Takes a credit, waiting until `deadline` (`None`: do not wait).
    fn take_credit(&self, deadline: Option<Instant>) -> Result<bool, LinkError> {
        let mut flow = self.shared.flow.lock().unwrap();
        loop {
            if let Some(f) = &flow.failure {
                let f = f.clone();
                drop(flow);
                return Err(self.error(f));
            }
            if let Some(granted) = flow.granted {
                if flow.in_flight < granted.min(self.window) {
                    flow.in_flight += 1;
                    return Ok(true);
                }
            }
            let Some(deadline) = deadline else {
                return Ok(false);
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(LinkError::SendTimeout {
                    peer: self.peer,
                    link: self.id,
                    waited: self.send_timeout,
                    in_flight: flow.in_flight,
                });
            }
            flow = self
                .shared
                .changed
                .wait_timeout(flow, deadline - now)
                .unwrap()
                .0;
        }
    }

    fn write_or_fail(
        &self,
        stream: &mut TcpStream,
        bytes: &[u8],
        what: &'static str,
    ) -> Result<(), LinkError> {
        stream.write_all(bytes).map_err(|e| {
            let f = io_failure(e, what);
            self.shared.fail(f.clone());
            let _ = self.control.shutdown(Shutdown::Both);
            self.error(f)
        })
    }

    fn write_credit(&self, kind: u16, count: u64) -> Result<(), LinkError> {
        let mut w = self.writer.lock().unwrap();
        self.write_or_fail(
            &mut w.stream,
            &credit_frame(kind, count),
            "sending a credit",
        )
    }

    fn send_with(&self, msg: &StageMessage, deadline: Option<Instant>) -> Result<bool, LinkError> {
        let unsendable = |source| LinkError::Unsendable {
            peer: self.peer,
            link: self.id,
            source: Box::new(source),
        };
        let bytes = msg.check(&self.limits).map_err(unsendable)?;
        if !self.take_credit(deadline)? {
            return Ok(false);
        }
        // Paced before taking the writer, so credit returns are not held up.
        if let Some(b) = &self.bucket {
            b.acquire(bytes);
        }
        let mut guard = self.writer.lock().unwrap();
        let Writer { stream, scratch } = &mut *guard;
        msg.encode_into(scratch, &self.limits).map_err(unsendable)?;
        self.write_or_fail(stream, scratch, "sending a message")?;
        Ok(true)
    }

    /// Sends a message, waiting up to the send timeout for a credit while
    /// `window` messages are unread by the peer.
    pub fn send(&self, msg: &StageMessage) -> Result<(), LinkError> {
        self.send_with(msg, Some(Instant::now() + self.send_timeout))
            .map(|_| ())
    }

    /// Sends a message if a credit is at hand; `Ok(false)` (nothing sent)
    /// when the window is full or the peer's grant has not arrived.
    pub fn try_send(&self, msg: &StageMessage) -> Result<bool, LinkError> {
        self.send_with(msg, None)
    }

    /// The next message, waiting up to the receive timeout.
    pub fn recv(&self) -> Result<StageMessage, LinkError> {
        self.recv_timeout(self.recv_timeout)
    }

    /// The next message, waiting up to `timeout`. Messages that arrived
    /// before the peer closed are delivered before the error.
    pub fn recv_timeout(&self, timeout: Duration) -> Result<StageMessage, LinkError> {
        match self.inbox.recv_timeout(timeout) {
            Ok(m) => {
                // A lost credit shows on the next call; the message is here.
                let _ = self.write_credit(CREDIT_RETURN, 1);
                Ok(m)
            }
            Err(RecvTimeoutError::Timeout) => Err(LinkError::RecvTimeout {
                peer: self.peer,
                link: self.id,
                waited: timeout,
            }),
            Err(RecvTimeoutError::Disconnected) => Err(self.failure()),
        }
    }
}

impl Drop for StageLink {
    fn drop(&mut self) {
        self.shared.fail(Failure::Local);
        // Our end of stream after every byte written; then stop the reader.
        let _ = self.control.shutdown(Shutdown::Write);
        let _ = self.control.shutdown(Shutdown::Read);
        if let Some(t) = self.reader.take() {
            let _ = t.join();
        }
    }
}

/// Reads 4 bytes of tag; `Ok(false)` is a clean end of stream before it.
fn read_tag(s: &mut TcpStream, tag: &mut [u8; 4]) -> io::Result<bool> {
    let mut got = 0;
    while got < tag.len() {
        match s.read(&mut tag[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

fn reader_loop(
    mut s: TcpStream,
    sh: &Shared,
    inbox: &Sender<StageMessage>,
    limits: &MessageLimits,
    window: u32,
) {
    let mut scratch = Vec::new();
    let failure = loop {
        let mut tag = [0u8; 4];
        match read_tag(&mut s, &mut tag) {
            Ok(true) => {}
            Ok(false) => break Failure::Closed("end of stream".into()),
            Err(e) => break io_failure(e, "reading a frame tag"),
        }
        if tag == MESSAGE_TAG {
            let mut head = [0u8; MESSAGE_HEADER_BYTES];
            head[0..4].copy_from_slice(&tag);
            if let Err(e) = s.read_exact(&mut head[4..]) {
                break io_failure(e, "reading a message header");
            }
            let h = match MessageHeader::decode(&head, limits) {
                Ok(h) => h,
                Err(e) => break Failure::BadMessage(e),
            };
            // Bounded by limits.bytes_max, checked by decode.
            scratch.resize(h.body_bytes as usize, 0);
            if let Err(e) = s.read_exact(&mut scratch) {
                break io_failure(e, "reading a message body");
            }
            let m = match StageMessage::decode_body(&h, &scratch, limits) {
                Ok(m) => m,
                Err(e) => break Failure::BadMessage(e),
            };
            match inbox.try_send(m) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) => {
                    break Failure::Protocol(format!(
                        "sent more than the window of {window} unread messages"
                    ))
                }
                Err(TrySendError::Disconnected(_)) => break Failure::Local,
            }
        } else if tag == CREDIT_TAG {
            let mut b = [0u8; CREDIT_FRAME_BYTES];
            b[0..4].copy_from_slice(&tag);
            if let Err(e) = s.read_exact(&mut b[4..]) {
                break io_failure(e, "reading a credit");
            }
            if let Err(detail) = apply_credit(sh, &b) {
                break Failure::Protocol(detail);
            }
        } else {
            break Failure::Protocol(format!(
                "unknown frame tag {tag:02x?} (expected \"DMTM\" or \"DMCR\")"
            ));
        }
    };
    sh.fail(failure);
    let _ = s.shutdown(Shutdown::Both);
}

fn apply_credit(sh: &Shared, b: &[u8; CREDIT_FRAME_BYTES]) -> Result<(), String> {
    let kind = u16::from_le_bytes([b[4], b[5]]);
    let reserved = u16::from_le_bytes([b[6], b[7]]);
    let count = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
    if reserved != 0 {
        return Err(format!("credit frame reserved field is {reserved}"));
    }
    let mut flow = sh.flow.lock().unwrap();
    match kind {
        CREDIT_GRANT => {
            if flow.granted.is_some() {
                return Err("a second credit grant".into());
            }
            if count == 0 || count > u64::from(LINK_WINDOW_MAX) {
                return Err(format!(
                    "credit grant of {count} outside 1..={LINK_WINDOW_MAX}"
                ));
            }
            flow.granted = Some(count as u32);
        }
        CREDIT_RETURN => {
            if flow.granted.is_none() {
                return Err("a credit return before the grant".into());
            }
            if count == 0 || count > u64::from(flow.in_flight) {
                return Err(format!(
                    "returned {count} credits with {} messages in flight",
                    flow.in_flight
                ));
            }
            flow.in_flight -= count as u32;
        }
        _ => return Err(format!("unknown credit kind {kind}")),
    }
    drop(flow);
    sh.changed.notify_all();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::tensor::{MessageKind, Tensor};
    use crate::dist::WorkerIdentity;

    fn key() -> ClusterKey {
        ClusterKey::from_secret(b"link-unit-test-key-01")
    }

    fn msg(mb: u64) -> StageMessage {
        StageMessage {
            header: MessageHeader {
                job: 1,
                pipeline: 0,
                stage: 0,
                microbatch: mb,
                kind: MessageKind::Activation,
            },
            tensors: vec![Tensor {
                reference: 3,
                shape: vec![2],
                data: vec![mb as f32, -1.0],
            }],
        }
    }

    fn pair(window: u32) -> (DistListener, StageLink, StageLink) {
        let l = DistListener::bind(
            "127.0.0.1:0".parse().unwrap(),
            key(),
            WorkerIdentity {
                job: 1,
                worker: 1,
                pipeline: 0,
                stage: 1,
            },
        )
        .unwrap();
        let id = LinkId {
            job: 1,
            pipeline: 0,
            from: 0,
            to: 1,
        };
        let a = StageLink::connect(l.local_addr(), id, LinkOptions::new(key(), window)).unwrap();
        let b = StageLink::accept(
            &l,
            0,
            LinkOptions::new(key(), window),
            Duration::from_secs(10),
        )
        .unwrap();
        (l, a, b)
    }

    #[test]
    fn both_directions_carry_messages_and_credits() {
        let (_l, a, b) = pair(2);
        a.send(&msg(1)).unwrap();
        b.send(&msg(2)).unwrap();
        assert_eq!(b.recv().unwrap(), msg(1));
        assert_eq!(a.recv().unwrap(), msg(2));
        assert_eq!(b.id().to, 0);
        assert_eq!(a.id().to, 1);
    }

    #[test]
    fn options_are_validated() {
        let mut o = LinkOptions::new(key(), 0);
        assert!(o.validate().is_err());
        o.window = LINK_WINDOW_MAX + 1;
        assert!(o.validate().is_err());
        o.window = 4;
        o.validate().unwrap();
        o.rate_limit_bytes_per_s = Some(0);
        assert!(o.validate().is_err());
        o.rate_limit_bytes_per_s = None;
        o.recv_timeout = Duration::ZERO;
        assert!(o.validate().is_err());
    }

    #[test]
    fn credit_frames_are_checked() {
        let sh = Shared {
            flow: Mutex::new(Flow::default()),
            changed: Condvar::new(),
        };
        assert!(apply_credit(&sh, &credit_frame(CREDIT_RETURN, 1)).is_err());
        assert!(apply_credit(&sh, &credit_frame(CREDIT_GRANT, 0)).is_err());
        assert!(apply_credit(
            &sh,
            &credit_frame(CREDIT_GRANT, u64::from(LINK_WINDOW_MAX) + 1)
        )
        .is_err());
        apply_credit(&sh, &credit_frame(CREDIT_GRANT, 2)).unwrap();
        assert!(apply_credit(&sh, &credit_frame(CREDIT_GRANT, 2)).is_err());
        // Nothing in flight: nothing to return.
        assert!(apply_credit(&sh, &credit_frame(CREDIT_RETURN, 1)).is_err());
        sh.flow.lock().unwrap().in_flight = 2;
        apply_credit(&sh, &credit_frame(CREDIT_RETURN, 2)).unwrap();
        assert_eq!(sh.flow.lock().unwrap().in_flight, 0);
        let mut b = credit_frame(CREDIT_RETURN, 1);
        b[6] = 1;
        assert!(apply_credit(&sh, &b).is_err());
        assert!(apply_credit(&sh, &credit_frame(9, 1)).is_err());
    }
}
