//! [`VerbsOptions`]: how the verbs transport and server use a device, with
//! defaults and validation (pure: checked without hardware, before any
//! device is opened).

use super::book::PEERS_MAX;
use super::plan::PlanLimits;
use super::qp::{RcConfig, MIN_RNR_TIMER_MAX, RETRY_CNT_MAX, RNR_RETRY_MAX, TIMEOUT_MAX};
use super::VerbsError;

/// The largest message an RDMA READ work request may carry (2 GiB, the
/// InfiniBand limit).
pub const READ_BYTES_MAX: u32 = 1 << 31;
/// Completion-queue entries a device allows at most on common HCAs
/// (mlx5: 4 Mi); larger values are refused before asking the driver.
pub const CQ_ENTRIES_MAX: u32 = 1 << 22;
/// Send-queue slots per queue pair at most (mlx5 allows 32 Ki).
pub const SEND_WR_MAX: u32 = 1 << 15;

/// How a `VerbsTransport` or `VerbsServer` (feature `verbs`) uses its device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsOptions {
    /// The RDMA device's name (`ibv_devices`, e.g. `"mlx5_0"`).
    pub device: String,
    /// Queue-pair connection attributes (port, GID index, MTU, depths, retries).
    pub rc: RcConfig,
    /// READ planning: work requests per doorbell, reads outstanding per
    /// queue pair (the send window), bytes per work request.
    pub limits: PlanLimits,
    /// Entries of the one completion queue (shared by every queue pair).
    pub cq_entries: u32,
    /// Send-queue slots of each client queue pair.
    pub max_send_wr: u32,
}

impl VerbsOptions {
    /// Defaults: 8 work requests per doorbell, 16 reads outstanding per queue
    /// pair (window and `max_rd_atomic`), 1 MiB per work request, a
    /// 4096-entry completion queue, 256 send slots per queue pair.
    pub fn new(device: impl Into<String>) -> Self {
        let rc = RcConfig::default();
        VerbsOptions {
            device: device.into(),
            rc,
            limits: PlanLimits {
                max_wr_per_doorbell: 8,
                max_rd_atomic: usize::from(rc.max_rd_atomic),
                max_read_bytes: 1 << 20,
                signal_every: 0,
            },
            cq_entries: 4096,
            max_send_wr: 256,
        }
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), VerbsError> {
        let bad = |m: String| Err(VerbsError::InvalidAttr(format!("VerbsOptions.{m}")));
        if self.device.is_empty() {
            return bad("device is empty: name an RDMA device (e.g. mlx5_0)".into());
        }
        let rc = &self.rc;
        if rc.port_num == 0 {
            return bad("rc.port_num = 0: ports are 1-based".into());
        }
        if rc.max_rd_atomic == 0 {
            return bad("rc.max_rd_atomic = 0 would never issue an RDMA READ".into());
        }
        if rc.timeout > TIMEOUT_MAX {
            return bad(format!("rc.timeout = {} exceeds {TIMEOUT_MAX}", rc.timeout));
        }
        if rc.retry_cnt > RETRY_CNT_MAX {
            return bad(format!(
                "rc.retry_cnt = {} exceeds {RETRY_CNT_MAX}",
                rc.retry_cnt
            ));
        }
        if rc.rnr_retry > RNR_RETRY_MAX {
            return bad(format!(
                "rc.rnr_retry = {} exceeds {RNR_RETRY_MAX}",
                rc.rnr_retry
            ));
        }
        if rc.min_rnr_timer > MIN_RNR_TIMER_MAX {
            return bad(format!(
                "rc.min_rnr_timer = {} exceeds {MIN_RNR_TIMER_MAX}",
                rc.min_rnr_timer
            ));
        }
        if rc.hop_limit == 0 {
            return bad("rc.hop_limit = 0: routed (RoCE) packets would be dropped at once".into());
        }
        if !(1..=SEND_WR_MAX).contains(&self.max_send_wr) {
            return bad(format!(
                "max_send_wr = {} must be in 1..={SEND_WR_MAX}",
                self.max_send_wr
            ));
        }
        let l = &self.limits;
        let send_wr = self.max_send_wr as usize;
        if !(1..=send_wr).contains(&l.max_wr_per_doorbell) {
            return bad(format!(
                "limits.max_wr_per_doorbell = {} must be in 1..=max_send_wr ({send_wr})",
                l.max_wr_per_doorbell
            ));
        }
        if !(1..=send_wr).contains(&l.max_rd_atomic) {
            return bad(format!(
                "limits.max_rd_atomic = {} (the send window) must be in 1..=max_send_wr ({send_wr})",
                l.max_rd_atomic
            ));
        }
        if !(1..=READ_BYTES_MAX).contains(&l.max_read_bytes) {
            return bad(format!(
                "limits.max_read_bytes = {} must be in 1..={READ_BYTES_MAX}",
                l.max_read_bytes
            ));
        }
        // Every queue pair has at most `max_rd_atomic` work requests
        // outstanding, so this many entries can never overflow.
        let need = l.max_rd_atomic.saturating_mul(PEERS_MAX);
        if (self.cq_entries as usize) < need || self.cq_entries > CQ_ENTRIES_MAX {
            return bad(format!(
                "cq_entries = {} must be in limits.max_rd_atomic ({}) x PEERS_MAX ({PEERS_MAX}) = {need} ..= {CQ_ENTRIES_MAX}, so the completion queue cannot overflow",
                self.cq_entries, l.max_rd_atomic
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        let o = VerbsOptions::new("mlx5_0");
        o.validate().unwrap();
        assert_eq!(o.device, "mlx5_0");
        assert_eq!(o.limits.max_wr_per_doorbell, 8);
        assert_eq!(o.limits.max_rd_atomic, 16);
        assert_eq!(o.limits.max_read_bytes, 1 << 20);
        assert_eq!((o.cq_entries, o.max_send_wr), (4096, 256));
        assert_eq!(o.rc.max_rd_atomic, 16);
        let s = String::from("mlx5_1");
        assert_eq!(VerbsOptions::new(&s).device, "mlx5_1");
    }

    #[test]
    fn each_bad_field_is_named() {
        let base = VerbsOptions::new("mlx5_0");
        type Edit = Box<dyn Fn(&mut VerbsOptions)>;
        let cases: Vec<(Edit, &str)> = vec![
            (Box::new(|o| o.device.clear()), "VerbsOptions.device"),
            (Box::new(|o| o.rc.port_num = 0), "rc.port_num"),
            (Box::new(|o| o.rc.max_rd_atomic = 0), "rc.max_rd_atomic"),
            (Box::new(|o| o.rc.timeout = 32), "rc.timeout"),
            (Box::new(|o| o.rc.retry_cnt = 8), "rc.retry_cnt"),
            (Box::new(|o| o.rc.rnr_retry = 8), "rc.rnr_retry"),
            (Box::new(|o| o.rc.min_rnr_timer = 32), "rc.min_rnr_timer"),
            (Box::new(|o| o.rc.hop_limit = 0), "rc.hop_limit"),
            (Box::new(|o| o.max_send_wr = 0), "max_send_wr"),
            (Box::new(|o| o.max_send_wr = SEND_WR_MAX + 1), "max_send_wr"),
            (
                Box::new(|o| o.limits.max_wr_per_doorbell = 0),
                "limits.max_wr_per_doorbell",
            ),
            (
                Box::new(|o| o.limits.max_wr_per_doorbell = 257),
                "limits.max_wr_per_doorbell",
            ),
            (
                Box::new(|o| o.limits.max_rd_atomic = 0),
                "limits.max_rd_atomic",
            ),
            (
                Box::new(|o| o.limits.max_rd_atomic = 300),
                "limits.max_rd_atomic",
            ),
            (
                Box::new(|o| o.limits.max_read_bytes = 0),
                "limits.max_read_bytes",
            ),
            (
                Box::new(|o| o.limits.max_read_bytes = READ_BYTES_MAX + 1),
                "limits.max_read_bytes",
            ),
            (Box::new(|o| o.cq_entries = 4095), "cq_entries"),
            (
                Box::new(|o| o.cq_entries = CQ_ENTRIES_MAX + 1),
                "cq_entries",
            ),
        ];
        for (f, word) in cases {
            let mut o = base.clone();
            f(&mut o);
            let e = o.validate().unwrap_err();
            assert!(matches!(e, VerbsError::InvalidAttr(_)));
            assert!(e.to_string().contains(word), "{e} should name {word}");
        }
        // A smaller window needs a smaller completion queue.
        let mut o = base;
        o.limits.max_rd_atomic = 4;
        o.cq_entries = 1024;
        o.validate().unwrap();
    }
}
