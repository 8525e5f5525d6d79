//! Blocking client of a memory server's sample service ([`crate::samples`]).

use std::io::{BufWriter, Write};
use std::net::TcpStream;
use std::time::Duration;

use distmind_common::handshake::ClusterKey;
use distmind_common::limits::CONTROL_FRAME_BYTES_MAX;
use distmind_common::samples::{
    ExtractorInfo, SampleCost, SampleFailure, SampleRef, SampleReply, SampleRequest,
    SAMPLE_FRAME_BYTES_MAX,
};
use distmind_common::wire::{self, FrameKind, Role, WireError};

use crate::client::{connect_role, ClientError};

/// One sample connection to one memory server.
pub struct SampleClient {
    addr: String,
    stream: BufWriter<TcpStream>,
}

/// Features of the samples a memory server extracted.
#[derive(Debug, Clone, PartialEq)]
pub struct Features {
    /// Sample indices, one per row.
    pub samples: Vec<u64>,
    pub feature_dim: usize,
    /// `samples.len() x feature_dim` values (sent as f16).
    pub values: Vec<f32>,
    pub labels: Vec<u32>,
    pub failed: Vec<SampleFailure>,
    /// Bytes of the reply's data frame: features and labels.
    pub wire_bytes: u64,
}

impl Features {
    /// No samples yet, of `feature_dim` features each.
    pub fn empty(feature_dim: usize) -> Features {
        Features {
            samples: Vec::new(),
            feature_dim,
            values: Vec::new(),
            labels: Vec::new(),
            failed: Vec::new(),
            wire_bytes: 0,
        }
    }
}

impl SampleClient {
    pub fn connect(addr: &str, key: &ClusterKey, timeout: Duration) -> Result<Self, ClientError> {
        let s = connect_role(addr, key, timeout, Role::Sample)?;
        Ok(SampleClient {
            addr: addr.to_owned(),
            stream: BufWriter::new(s),
        })
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn wire_err(&self, source: WireError) -> ClientError {
        ClientError::Wire {
            addr: self.addr.clone(),
            source,
        }
    }

    fn unexpected(&self, reply: impl std::fmt::Debug) -> ClientError {
        ClientError::Unexpected {
            addr: self.addr.clone(),
            reply: format!("{reply:?}"),
        }
    }

    fn request(&mut self, req: &SampleRequest) -> Result<SampleReply, ClientError> {
        wire::send_message_sync(&mut self.stream, req).map_err(|e| self.wire_err(e))?;
        self.stream.flush().map_err(|e| self.wire_err(e.into()))?;
        let reply: SampleReply =
            wire::recv_message_sync(self.stream.get_mut(), CONTROL_FRAME_BYTES_MAX)
                .map_err(|e| self.wire_err(e))?;
        match reply {
            SampleReply::Error(reply) => Err(ClientError::Server {
                addr: self.addr.clone(),
                reply,
            }),
            r => Ok(r),
        }
    }

    /// The data frame that follows a `Prepped` or `Extracted` reply.
    fn bytes(&mut self, expected: u64) -> Result<Vec<u8>, ClientError> {
        match wire::read_frame_sync(self.stream.get_mut(), SAMPLE_FRAME_BYTES_MAX)
            .map_err(|e| self.wire_err(e))?
        {
            Some((FrameKind::Bytes, b)) if b.len() as u64 == expected => Ok(b),
            Some((kind, b)) => Err(self.unexpected(format!(
                "a {kind:?} frame of {} bytes where {expected} data bytes were announced",
                b.len()
            ))),
            None => Err(self.unexpected("the connection closed before the data frame")),
        }
    }

    /// The first `steps` preprocessing steps of one sample, in step
    /// `steps`'s wire form (`steps = 0`: the file).
    pub fn prep(
        &mut self,
        sample: &SampleRef,
        steps: u8,
        seed: u64,
    ) -> Result<Vec<u8>, ClientError> {
        let req = SampleRequest::Prep {
            sample: sample.clone(),
            steps,
            seed,
        };
        match self.request(&req)? {
            SampleReply::Prepped {
                sample: s,
                steps: k,
                bytes,
            } if s == sample.sample && k == steps => self.bytes(bytes),
            r => Err(self.unexpected(r)),
        }
    }

    /// Every step's output size and time for each sample.
    pub fn profile(
        &mut self,
        samples: &[SampleRef],
        seed: u64,
    ) -> Result<(Vec<SampleCost>, Vec<SampleFailure>), ClientError> {
        let req = SampleRequest::Profile {
            samples: samples.to_vec(),
            seed,
        };
        match self.request(&req)? {
            SampleReply::Profiled { costs, failed } => Ok((costs, failed)),
            r => Err(self.unexpected(r)),
        }
    }

    /// The frozen backbone's features of these samples.
    pub fn extract(&mut self, samples: &[SampleRef]) -> Result<Features, ClientError> {
        let req = SampleRequest::Extract {
            samples: samples.to_vec(),
        };
        let (ids, dim, bytes, failed) = match self.request(&req)? {
            SampleReply::Extracted {
                samples,
                feature_dim,
                bytes,
                failed,
            } => (samples, feature_dim as usize, bytes, failed),
            r => return Err(self.unexpected(r)),
        };
        let n = ids.len();
        if bytes != (n * dim * 2 + n * 4) as u64 {
            return Err(self.unexpected(format!(
                "{bytes} bytes announced for {n} samples of {dim} f16 features and a u32 label"
            )));
        }
        let data = self.bytes(bytes)?;
        let (f, l) = data.split_at(n * dim * 2);
        Ok(Features {
            samples: ids,
            feature_dim: dim,
            values: distmind_data::prep::f16_le_to_f32(f)
                .map_err(|e| self.unexpected(format!("features: {e}")))?,
            labels: l
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect(),
            failed,
            wire_bytes: bytes,
        })
    }

    /// The service's preprocessing workers and backbone.
    pub fn info(&mut self) -> Result<(u32, Option<ExtractorInfo>), ClientError> {
        match self.request(&SampleRequest::Info)? {
            SampleReply::Info {
                prep_workers,
                extractor,
            } => Ok((prep_workers, extractor)),
            r => Err(self.unexpected(r)),
        }
    }
}
