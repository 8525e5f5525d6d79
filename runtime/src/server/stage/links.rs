//! A stage worker's data plane: its two stage links (it dials `next`,
//! `prev` dials it), its replicas' all-reduce, and the waits on them, each
//! bounded by a named timeout and cut short when the worker is aborted.
//!
//! One link per neighbour carries both directions: activations go down
//! the pipeline and gradients come back on the same connection, so each
//! direction of each link carries one kind, in 1F1B order. A message's
//! header names the job (its key), pipeline, sending stage and the
//! microbatch (`iteration * microbatches + m`); a receiver checks all of
//! them against what its own order expects next. A worker that stops on
//! purpose first offers its neighbours a control message (never waiting
//! for a credit), so they can tell a stop from a crash.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use distmind_common::handshake::ClusterKey;
use distmind_common::proto::DataPeer;

use super::error::{At, StageError};
use super::{
    ABORT_POLL, COLLECTIVE_IO_TIMEOUT, COLLECTIVE_SETUP_TIMEOUT, LINK_ACCEPT_TIMEOUT,
    LINK_CONNECT_TIMEOUT, LINK_IO_TIMEOUT, LINK_RECV_TIMEOUT, LINK_SEND_TIMEOUT,
};
use crate::dist::limits::MESSAGE_TENSORS_MAX;
use crate::dist::{
    Collective, CollectiveOptions, DistListener, LinkError, LinkId, LinkOptions, MessageHeader,
    MessageKind, MessageLimits, RingMember, StageLink, StageMessage, Tensor as WireTensor,
};

/// What both ends of a job's links agree on: the window is the pipeline's
/// depth (1F1B never has more unread messages per direction than stages;
/// the spec's `STAGES_MAX` fits `LINK_WINDOW_MAX`), and a message may hold
/// as many tensors as any cut of a model carries.
pub(crate) fn link_options(key: &ClusterKey, stages: u32) -> LinkOptions {
    LinkOptions {
        limits: MessageLimits {
            tensors_max: MESSAGE_TENSORS_MAX,
            ..MessageLimits::default()
        },
        recv_timeout: LINK_RECV_TIMEOUT,
        send_timeout: LINK_SEND_TIMEOUT,
        connect_timeout: LINK_CONNECT_TIMEOUT,
        io_timeout: LINK_IO_TIMEOUT,
        ..LinkOptions::new(key.clone(), stages.max(1))
    }
}

const _: () =
    assert!(distmind_common::train_spec::STAGES_MAX <= crate::dist::limits::LINK_WINDOW_MAX);

pub(crate) fn collective_options(key: &ClusterKey) -> CollectiveOptions {
    CollectiveOptions {
        setup_timeout: COLLECTIVE_SETUP_TIMEOUT,
        io_timeout: COLLECTIVE_IO_TIMEOUT,
        ..CollectiveOptions::new(key.clone())
    }
}

/// A peer's `host:port`, resolved (the first address).
pub(crate) fn resolve(at: &At, peer: &DataPeer) -> Result<SocketAddr, StageError> {
    let err = |why: String| StageError::PeerAddress {
        at: at.clone(),
        pipeline: peer.pipeline,
        stage: peer.stage,
        addr: peer.data_addr.clone(),
        why,
    };
    peer.data_addr
        .to_socket_addrs()
        .map_err(|e| err(e.to_string()))?
        .next()
        .ok_or_else(|| err("resolves to no address".into()))
}

/// A worker's data plane.
pub(crate) struct DataPlane {
    pub job_key: u64,
    pub pipeline: u32,
    pub stage: u32,
    pub prev: Option<StageLink>,
    pub next: Option<StageLink>,
    pub collective: Collective,
    /// This stage of every pipeline, by pipeline (this worker included).
    pub replicas: Vec<RingMember>,
}

impl DataPlane {
    /// Dials `next`, then takes the link `prev` dials (waiting up to
    /// [`LINK_ACCEPT_TIMEOUT`]), and sets up the collective of the
    /// replicas. Each neighbour does the same, so the order of the workers'
    /// starts does not matter.
    #[allow(clippy::too_many_arguments)]
    pub fn connect(
        at: &At,
        key: &ClusterKey,
        stages: u32,
        listener: Arc<DistListener>,
        prev: Option<&DataPeer>,
        next: Option<&DataPeer>,
        replicas: &[DataPeer],
        abort: &AtomicBool,
    ) -> Result<DataPlane, StageError> {
        let me = listener.identity();
        let opts = link_options(key, stages);
        let link_err = |peer_stage: u32| {
            move |source: LinkError| StageError::Link {
                at: at.clone(),
                peer_stage,
                source: Box::new(source),
            }
        };
        let next = match next {
            Some(peer) => {
                let addr = resolve(at, peer)?;
                let id = LinkId {
                    job: me.job,
                    pipeline: me.pipeline,
                    from: me.stage,
                    to: peer.stage,
                };
                Some(StageLink::connect(addr, id, opts.clone()).map_err(link_err(peer.stage))?)
            }
            None => None,
        };
        let prev = match prev {
            Some(peer) => {
                let deadline = Instant::now() + LINK_ACCEPT_TIMEOUT;
                loop {
                    if abort.load(Ordering::Relaxed) {
                        return Err(StageError::Aborted {
                            at: at.clone(),
                            what: "waiting for the previous stage to connect",
                        });
                    }
                    let slice = ABORT_POLL.min(deadline.saturating_duration_since(Instant::now()));
                    match StageLink::accept(&listener, peer.stage, opts.clone(), slice) {
                        Ok(l) => break Some(l),
                        Err(LinkError::AcceptTimeout { .. }) if Instant::now() < deadline => {}
                        Err(LinkError::AcceptTimeout {
                            listener: l, link, ..
                        }) => {
                            return Err(link_err(peer.stage)(LinkError::AcceptTimeout {
                                listener: l,
                                link,
                                waited: LINK_ACCEPT_TIMEOUT,
                            }))
                        }
                        Err(e) => return Err(link_err(peer.stage)(e)),
                    }
                }
            }
            None => None,
        };
        let mut members = Vec::with_capacity(replicas.len());
        for r in replicas {
            members.push(RingMember {
                id: r.worker,
                addr: resolve(at, r)?,
            });
        }
        let collective =
            Collective::new(listener.clone(), collective_options(key)).map_err(|source| {
                StageError::Collective {
                    at: at.clone(),
                    members: Vec::new(),
                    source: Box::new(source),
                }
            })?;
        Ok(DataPlane {
            job_key: me.job,
            pipeline: me.pipeline,
            stage: me.stage,
            prev,
            next,
            collective,
            replicas: members,
        })
    }

    fn header(&self, kind: MessageKind, microbatch: u64) -> MessageHeader {
        MessageHeader {
            job: self.job_key,
            pipeline: self.pipeline,
            stage: self.stage,
            microbatch,
            kind,
        }
    }

    /// Sends microbatch `mb`'s activations down the pipeline.
    pub fn send_activations(
        &self,
        at: &At,
        mb: u64,
        tensors: Vec<WireTensor>,
    ) -> Result<(), StageError> {
        let link = self
            .next
            .as_ref()
            .expect("only a stage with a next one sends on");
        self.send(
            at,
            link,
            self.stage + 1,
            MessageKind::Activation,
            mb,
            tensors,
        )
    }

    /// Sends microbatch `mb`'s input gradients up the pipeline.
    pub fn send_gradients(
        &self,
        at: &At,
        mb: u64,
        tensors: Vec<WireTensor>,
    ) -> Result<(), StageError> {
        let link = self
            .prev
            .as_ref()
            .expect("only a stage with a previous one sends back");
        self.send(at, link, self.stage - 1, MessageKind::Gradient, mb, tensors)
    }

    fn send(
        &self,
        at: &At,
        link: &StageLink,
        peer_stage: u32,
        kind: MessageKind,
        mb: u64,
        tensors: Vec<WireTensor>,
    ) -> Result<(), StageError> {
        let msg = StageMessage {
            header: self.header(kind, mb),
            tensors,
        };
        link.send(&msg).map_err(|source| StageError::Link {
            at: at.clone(),
            peer_stage,
            source: Box::new(source),
        })
    }

    /// Microbatch `mb`'s activations from the previous stage.
    pub fn recv_activations(
        &self,
        at: &At,
        mb: u64,
        abort: &AtomicBool,
    ) -> Result<Vec<WireTensor>, StageError> {
        let link = self
            .prev
            .as_ref()
            .expect("only a stage with a previous one receives");
        self.recv(at, link, self.stage - 1, MessageKind::Activation, mb, abort)
    }

    /// Microbatch `mb`'s gradients from the next stage.
    pub fn recv_gradients(
        &self,
        at: &At,
        mb: u64,
        abort: &AtomicBool,
    ) -> Result<Vec<WireTensor>, StageError> {
        let link = self
            .next
            .as_ref()
            .expect("only a stage with a next one gets gradients");
        self.recv(at, link, self.stage + 1, MessageKind::Gradient, mb, abort)
    }

    /// The next message on `link`, which must be `kind` for `mb` from
    /// `peer_stage` of this job and pipeline; waits up to
    /// [`LINK_RECV_TIMEOUT`], looking at `abort` every [`ABORT_POLL`].
    fn recv(
        &self,
        at: &At,
        link: &StageLink,
        peer_stage: u32,
        kind: MessageKind,
        mb: u64,
        abort: &AtomicBool,
    ) -> Result<Vec<WireTensor>, StageError> {
        let deadline = Instant::now() + LINK_RECV_TIMEOUT;
        let msg = loop {
            if abort.load(Ordering::Relaxed) {
                return Err(StageError::Aborted {
                    at: at.clone(),
                    what: "waiting for a neighbour's message",
                });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match link.recv_timeout(ABORT_POLL.min(left)) {
                Ok(m) => break m,
                Err(LinkError::RecvTimeout { peer, link: id, .. }) => {
                    if left <= ABORT_POLL {
                        return Err(StageError::Link {
                            at: at.clone(),
                            peer_stage,
                            source: Box::new(LinkError::RecvTimeout {
                                peer,
                                link: id,
                                waited: LINK_RECV_TIMEOUT,
                            }),
                        });
                    }
                }
                Err(source) => {
                    return Err(StageError::Link {
                        at: at.clone(),
                        peer_stage,
                        source: Box::new(source),
                    })
                }
            }
        };
        let h = msg.header;
        if h.kind == MessageKind::Control {
            return Err(StageError::PeerStopped {
                at: at.clone(),
                peer_stage,
                mb,
            });
        }
        let want = self.header(kind, mb);
        let want = MessageHeader {
            stage: peer_stage,
            ..want
        };
        if h != want {
            return Err(StageError::OutOfOrder {
                at: at.clone(),
                peer_stage,
                got: describe(&h),
                want: describe(&want),
            });
        }
        Ok(msg.tensors)
    }

    /// Tells both neighbours this worker stops (without waiting for a
    /// credit: a full window means the neighbour is not reading anyway).
    pub fn say_stop(&self) {
        for link in [&self.prev, &self.next].into_iter().flatten() {
            let _ = link.try_send(&StageMessage::control(
                self.header(MessageKind::Control, u64::MAX),
            ));
        }
    }

    /// Replaces `buf` by its mean over the replicas of `pipelines` (this
    /// worker's pipeline among them): a ring all-reduce, every member ends
    /// with the same bits.
    pub fn average(
        &mut self,
        at: &At,
        pipelines: &[u32],
        buf: &mut [f32],
    ) -> Result<(), StageError> {
        let members: Vec<RingMember> = pipelines
            .iter()
            .map(|&p| self.replicas[p as usize])
            .collect();
        self.collective
            .all_reduce_mean(&members, buf)
            .map_err(|source| StageError::Collective {
                at: at.clone(),
                members: pipelines.to_vec(),
                source: Box::new(source),
            })
    }
}

fn describe(h: &MessageHeader) -> String {
    format!(
        "{:?} of microbatch {} (job key {:x}, pipeline {}, stage {})",
        h.kind, h.microbatch, h.job, h.pipeline, h.stage
    )
}

/// Sleeps `d` in slices of [`ABORT_POLL`]; false when aborted.
pub(crate) fn sleep_unless(abort: &AtomicBool, d: Duration) -> bool {
    let end = Instant::now() + d;
    loop {
        if abort.load(Ordering::Relaxed) {
            return false;
        }
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return true;
        }
        std::thread::sleep(left.min(ABORT_POLL));
    }
}
