//! Why a running stage worker stopped: every variant names the job,
//! pipeline, stage and iteration ([`At`]), and the microbatch or peer where
//! one is to blame. The text is what `TrainFailed` carries to the
//! controller. Sources are boxed: the error travels up every call of the
//! iteration loop.

use std::fmt;
use std::time::Duration;

use distmind_controller::ClientError;

use super::routing::ComputeError;
use crate::dist::{CollectiveError, LinkError};

/// Where a stage worker was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct At {
    pub job: String,
    pub pipeline: u32,
    pub stage: u32,
    /// The iteration running (0-based), or about to.
    pub iteration: u64,
}

impl fmt::Display for At {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "job {} pipeline {} stage {} iteration {}",
            self.job, self.pipeline, self.stage, self.iteration
        )
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum StageError {
    /// A stage link failed (the neighbour closed it, timed out, sent garbage).
    #[error("{at}: stage link to stage {peer_stage}: {source}")]
    Link {
        at: At,
        peer_stage: u32,
        #[source]
        source: Box<LinkError>,
    },
    /// The neighbour's message is not the one 1F1B expects next.
    #[error("{at}: stage {peer_stage} sent {got} where {want} was due (the two workers run different schedules or generations; restart the job)")]
    OutOfOrder {
        at: At,
        peer_stage: u32,
        got: String,
        want: String,
    },
    /// The neighbour stopped (a stop it was told, or its runtime's
    /// shutdown) while this worker still needed it.
    #[error("{at}: stage {peer_stage} stopped while this worker waited for microbatch {mb}")]
    PeerStopped { at: At, peer_stage: u32, mb: u64 },
    /// Averaging the stage's weights with its replicas failed.
    #[error("{at}: averaging the stage's weights with pipelines {members:?}: {source}")]
    Collective {
        at: At,
        members: Vec<u32>,
        #[source]
        source: Box<CollectiveError>,
    },
    /// A forward, backward or step failed, or a neighbour's tensors do not
    /// fit the stage.
    #[error("{at}: {source}")]
    Compute {
        at: At,
        #[source]
        source: Box<ComputeError>,
    },
    /// The controller could not be reached or refused a report.
    #[error("{at}: {what} to the controller at {controller}: {source}")]
    Controller {
        at: At,
        what: &'static str,
        controller: String,
        #[source]
        source: Box<ClientError>,
    },
    /// The controller's sync group does not name this worker's pipeline
    /// or names a pipeline the job does not have.
    #[error("{at}: the controller's sync group {members:?} {why}")]
    BadGroup {
        at: At,
        members: Vec<u32>,
        why: String,
    },
    /// The controller says the job failed elsewhere (its reply to a report).
    #[error("{at}: the job failed at pipeline {pipeline} stage {stage}: {reason}")]
    JobFailed {
        at: At,
        pipeline: u32,
        stage: u32,
        reason: String,
    },
    /// No `TrainStageStart` came.
    #[error(
        "{at}: no TrainStageStart within {waited:?} (START_TIMEOUT) after the worker was ready"
    )]
    NeverStarted { at: At, waited: Duration },
    /// A peer's data address does not resolve.
    #[error("{at}: the data address {addr:?} of pipeline {pipeline} stage {stage}: {why}")]
    PeerAddress {
        at: At,
        pipeline: u32,
        stage: u32,
        addr: String,
        why: String,
    },
    /// A re-partitioning's drain or checkpoint went wrong.
    #[error("{at}: re-partitioning: {why}")]
    Checkpoint { at: At, why: String },
    /// The runtime is shutting down: the worker was aborted mid-wait.
    #[error("{at}: the runtime shut down while the worker was {what}")]
    Aborted { at: At, what: &'static str },
}

impl StageError {
    /// Whether the controller answered the request and refused it (so it
    /// recorded nothing of it), rather than being unreachable or breaking
    /// the connection (then it may have).
    pub fn refused_by_controller(&self) -> bool {
        match self {
            StageError::Controller { source, .. } => {
                source.error_reply().is_some()
                    || matches!(**source, ClientError::RequestTooLarge { .. })
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distmind_common::proto::{ErrorCode, ErrorReply};

    #[test]
    fn only_an_answered_refusal_counts_as_refused_by_the_controller() {
        let at = At {
            job: "j".into(),
            pipeline: 0,
            stage: 1,
            iteration: 4,
        };
        let err = |source| StageError::Controller {
            at: at.clone(),
            what: "the checkpoint notice",
            controller: "c".into(),
            source: Box::new(source),
        };
        let refused = ClientError::Server {
            addr: "c".into(),
            reply: ErrorReply::new(ErrorCode::BadRequest, "a part of an older checkpoint"),
        };
        assert!(err(refused).refused_by_controller());
        assert!(err(ClientError::RequestTooLarge { len: 9, max: 8 }).refused_by_controller());
        // Unknown whether it recorded the part.
        assert!(!err(ClientError::Broken { addr: "c".into() }).refused_by_controller());
        let lost = ClientError::Connect {
            addr: "c".into(),
            source: std::io::Error::other("refused"),
        };
        assert!(!err(lost).refused_by_controller());
        assert!(!StageError::Aborted {
            at,
            what: "waiting"
        }
        .refused_by_controller());
    }
}
