//! The RC queue-pair state machine, as plain data (no hardware).
//!
//! A reliable-connected QP is created in `Reset` and moved
//! `Reset -> Init -> Rtr -> Rts` with `ibv_modify_qp`; each step needs its own
//! attributes (see [`InitAttrs`], [`RtrAttrs`], [`RtsAttrs`]). Any state may go
//! to `Error` (flushes outstanding work) or back to `Reset`. Everything else is
//! refused here, before the driver sees it, with an error naming both states.

use super::VerbsError;

/// Packet sequence numbers and queue-pair numbers are 24-bit.
pub const PSN_MAX: u32 = (1 << 24) - 1;
/// Largest QP number (24 bits). 0 and 1 are the special QPs (SMI, GSI).
pub const QPN_MAX: u32 = (1 << 24) - 1;
/// The local ACK timeout field is 5 bits (4.096 us * 2^timeout; 0 = infinite).
pub const TIMEOUT_MAX: u8 = 31;
/// retry_cnt is 3 bits.
pub const RETRY_CNT_MAX: u8 = 7;
/// rnr_retry is 3 bits (7 = retry forever).
pub const RNR_RETRY_MAX: u8 = 7;
/// min_rnr_timer is a 5-bit code.
pub const MIN_RNR_TIMER_MAX: u8 = 31;

/// The states a QP of this transport goes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpState {
    Reset,
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    Error,
}

/// Remote access rights granted on a QP (and on MRs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Access {
    pub local_write: bool,
    pub remote_read: bool,
    pub remote_write: bool,
}

impl Access {
    /// What the serving (memory-server) side grants: its arena may be read.
    pub const REMOTE_READ: Access = Access {
        local_write: false,
        remote_read: true,
        remote_write: false,
    };
    /// Local buffers that RDMA READs land in.
    pub const LOCAL_WRITE: Access = Access {
        local_write: true,
        remote_read: false,
        remote_write: false,
    };

    /// The `IBV_ACCESS_*` bits (LOCAL_WRITE = 1, REMOTE_WRITE = 2, REMOTE_READ = 4).
    pub fn bits(self) -> u32 {
        (self.local_write as u32)
            | ((self.remote_write as u32) << 1)
            | ((self.remote_read as u32) << 2)
    }
}

/// Path MTU (`ibv_mtu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum PathMtu {
    Mtu256,
    Mtu512,
    Mtu1024,
    Mtu2048,
    Mtu4096,
}

impl PathMtu {
    /// The `ibv_mtu` enum value (IBV_MTU_256 = 1 .. IBV_MTU_4096 = 5).
    pub fn ibv_value(self) -> u32 {
        match self {
            PathMtu::Mtu256 => 1,
            PathMtu::Mtu512 => 2,
            PathMtu::Mtu1024 => 3,
            PathMtu::Mtu2048 => 4,
            PathMtu::Mtu4096 => 5,
        }
    }

    /// From an `ibv_mtu` value (e.g. a port's `active_mtu`).
    pub fn from_ibv(v: u32) -> Option<PathMtu> {
        Some(match v {
            1 => PathMtu::Mtu256,
            2 => PathMtu::Mtu512,
            3 => PathMtu::Mtu1024,
            4 => PathMtu::Mtu2048,
            5 => PathMtu::Mtu4096,
            _ => return None,
        })
    }

    pub fn bytes(self) -> u32 {
        256 << (self.ibv_value() - 1)
    }
}

/// A 128-bit GID (RoCE needs it; InfiniBand may route by LID alone).
pub type Gid = [u8; 16];

/// Where the remote QP is (the address vector of RTR).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteAddress {
    /// Remote LID (0 on RoCE).
    pub lid: u16,
    /// Remote GID; required when `lid` is 0 (RoCE) or across subnets.
    pub gid: Option<Gid>,
    /// Index of the local GID to send from (when `gid` is set).
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub service_level: u8,
    /// Local port the path leaves from.
    pub port_num: u8,
}

/// Reset -> Init.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitAttrs {
    /// 1-based physical port.
    pub port_num: u8,
    pub pkey_index: u16,
    /// Remote access granted on this QP: [`Access::REMOTE_READ`] on the serving side.
    pub access: Access,
}

/// Init -> Rtr.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtrAttrs {
    pub path_mtu: PathMtu,
    /// The remote QP number.
    pub dest_qpn: u32,
    /// The remote's initial send PSN.
    pub rq_psn: u32,
    /// RDMA READs the remote may have outstanding against this QP (responder resources).
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub remote: RemoteAddress,
}

/// Rtr -> Rts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtsAttrs {
    pub sq_psn: u32,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    /// RDMA READs this QP may have outstanding (initiator depth).
    pub max_rd_atomic: u8,
}

/// How an RC connection is set up (from settings; defaults are usual values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RcConfig {
    pub port_num: u8,
    pub pkey_index: u16,
    /// The local GID index (RoCE v2 is often 1 or 3).
    pub gid_index: u8,
    /// `None`: the port's active MTU.
    pub path_mtu: Option<PathMtu>,
    /// Reads outstanding per QP, both directions (initiator and responder depth).
    pub max_rd_atomic: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub min_rnr_timer: u8,
    pub hop_limit: u8,
}

impl Default for RcConfig {
    fn default() -> Self {
        Self {
            port_num: 1,
            pkey_index: 0,
            gid_index: 0,
            path_mtu: None,
            max_rd_atomic: 16,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            hop_limit: 64,
        }
    }
}

/// One `ibv_modify_qp` step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    ToInit(InitAttrs),
    ToRtr(RtrAttrs),
    ToRts(RtsAttrs),
    ToError,
    ToReset,
}

impl Transition {
    pub fn target(&self) -> QpState {
        match self {
            Transition::ToInit(_) => QpState::Init,
            Transition::ToRtr(_) => QpState::Rtr,
            Transition::ToRts(_) => QpState::Rts,
            Transition::ToError => QpState::Error,
            Transition::ToReset => QpState::Reset,
        }
    }

    /// Checks the attributes' ranges (independent of the current state).
    pub fn validate(&self) -> Result<(), VerbsError> {
        let bad = |m: String| Err(VerbsError::InvalidAttr(m));
        match self {
            Transition::ToInit(a) => {
                if a.port_num == 0 {
                    return bad("port_num is 1-based; 0 is not a port".into());
                }
            }
            Transition::ToRtr(a) => {
                if a.dest_qpn < 2 || a.dest_qpn > QPN_MAX {
                    return bad(format!(
                        "dest_qpn {} outside 2..={QPN_MAX} (24 bits; 0 and 1 are special QPs)",
                        a.dest_qpn
                    ));
                }
                if a.rq_psn > PSN_MAX {
                    return bad(format!("rq_psn {} exceeds 24 bits", a.rq_psn));
                }
                if a.max_dest_rd_atomic == 0 {
                    return bad("max_dest_rd_atomic 0 would refuse every RDMA READ".into());
                }
                if a.min_rnr_timer > MIN_RNR_TIMER_MAX {
                    return bad(format!(
                        "min_rnr_timer {} exceeds {MIN_RNR_TIMER_MAX}",
                        a.min_rnr_timer
                    ));
                }
                if a.remote.port_num == 0 {
                    return bad("remote.port_num is 1-based; 0 is not a port".into());
                }
                if a.remote.lid == 0 && a.remote.gid.is_none() {
                    return bad(
                        "remote address needs a LID (InfiniBand) or a GID (RoCE); both are unset"
                            .into(),
                    );
                }
                if a.remote.gid.is_some() && a.remote.hop_limit == 0 {
                    return bad("hop_limit 0 with a GID: packets would be dropped at once".into());
                }
            }
            Transition::ToRts(a) => {
                if a.sq_psn > PSN_MAX {
                    return bad(format!("sq_psn {} exceeds 24 bits", a.sq_psn));
                }
                if a.timeout > TIMEOUT_MAX {
                    return bad(format!("timeout {} exceeds {TIMEOUT_MAX}", a.timeout));
                }
                if a.retry_cnt > RETRY_CNT_MAX {
                    return bad(format!("retry_cnt {} exceeds {RETRY_CNT_MAX}", a.retry_cnt));
                }
                if a.rnr_retry > RNR_RETRY_MAX {
                    return bad(format!("rnr_retry {} exceeds {RNR_RETRY_MAX}", a.rnr_retry));
                }
                if a.max_rd_atomic == 0 {
                    return bad("max_rd_atomic 0 would never issue an RDMA READ".into());
                }
            }
            Transition::ToError | Transition::ToReset => {}
        }
        Ok(())
    }
}

/// Whether `from -> to` is a transition this transport performs.
pub fn transition_allowed(from: QpState, to: QpState) -> bool {
    matches!(
        (from, to),
        (QpState::Reset, QpState::Init)
            | (QpState::Init, QpState::Rtr)
            | (QpState::Rtr, QpState::Rts)
            | (_, QpState::Error)
            | (_, QpState::Reset)
    )
}

/// Tracks a QP's state; [`QpStateMachine::apply`] refuses invalid steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpStateMachine {
    state: QpState,
}

impl Default for QpStateMachine {
    fn default() -> Self {
        Self::new()
    }
}

impl QpStateMachine {
    /// A freshly created QP is in `Reset`.
    pub fn new() -> Self {
        Self {
            state: QpState::Reset,
        }
    }

    pub fn state(&self) -> QpState {
        self.state
    }

    /// Checks `t` against the current state and its attributes, without applying it.
    pub fn check(&self, t: &Transition) -> Result<QpState, VerbsError> {
        let to = t.target();
        if !transition_allowed(self.state, to) {
            return Err(VerbsError::InvalidTransition {
                from: self.state,
                to,
            });
        }
        t.validate()?;
        Ok(to)
    }

    /// Records a transition the driver accepted (call [`Self::check`] first, or
    /// use this alone in pure code: it checks too).
    pub fn apply(&mut self, t: &Transition) -> Result<QpState, VerbsError> {
        let to = self.check(t)?;
        self.state = to;
        Ok(to)
    }

    /// The QP went to Error on its own (a failed work request).
    pub fn set_error(&mut self) {
        self.state = QpState::Error;
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub fn init() -> Transition {
        Transition::ToInit(InitAttrs {
            port_num: 1,
            pkey_index: 0,
            access: Access::REMOTE_READ,
        })
    }

    pub fn rtr() -> RtrAttrs {
        RtrAttrs {
            path_mtu: PathMtu::Mtu4096,
            dest_qpn: 0x1234,
            rq_psn: 0x00ab_cdef,
            max_dest_rd_atomic: 16,
            min_rnr_timer: 12,
            remote: RemoteAddress {
                lid: 7,
                gid: None,
                sgid_index: 0,
                hop_limit: 64,
                service_level: 0,
                port_num: 1,
            },
        }
    }

    pub fn rts() -> RtsAttrs {
        RtsAttrs {
            sq_psn: 42,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 16,
        }
    }

    #[test]
    fn happy_path_reset_init_rtr_rts() {
        let mut m = QpStateMachine::new();
        assert_eq!(m.state(), QpState::Reset);
        assert_eq!(m.apply(&init()).unwrap(), QpState::Init);
        assert_eq!(m.apply(&Transition::ToRtr(rtr())).unwrap(), QpState::Rtr);
        assert_eq!(m.apply(&Transition::ToRts(rts())).unwrap(), QpState::Rts);
        assert_eq!(m.apply(&Transition::ToError).unwrap(), QpState::Error);
        assert_eq!(m.apply(&Transition::ToReset).unwrap(), QpState::Reset);
        assert_eq!(m.apply(&init()).unwrap(), QpState::Init);
    }

    #[test]
    fn skipping_or_going_back_is_refused_with_both_states_named() {
        let mut m = QpStateMachine::new();
        let e = m.apply(&Transition::ToRts(rts())).unwrap_err();
        assert_eq!(
            e,
            VerbsError::InvalidTransition {
                from: QpState::Reset,
                to: QpState::Rts
            }
        );
        let msg = e.to_string();
        assert!(msg.contains("Reset") && msg.contains("Rts"), "{msg}");
        assert_eq!(m.state(), QpState::Reset, "a refused step changes nothing");
        assert!(m.apply(&Transition::ToRtr(rtr())).is_err());
        m.apply(&init()).unwrap();
        assert!(m.apply(&init()).is_err(), "Init -> Init");
        assert!(m.apply(&Transition::ToRts(rts())).is_err(), "Init -> Rts");
        m.apply(&Transition::ToRtr(rtr())).unwrap();
        assert!(m.apply(&init()).is_err(), "Rtr -> Init");
        m.apply(&Transition::ToRts(rts())).unwrap();
        assert!(m.apply(&Transition::ToRtr(rtr())).is_err(), "Rts -> Rtr");
        m.set_error();
        assert!(m.apply(&Transition::ToRts(rts())).is_err(), "Error -> Rts");
        assert_eq!(m.state(), QpState::Error);
    }

    #[test]
    fn every_pair_matches_the_table() {
        use QpState::*;
        let all = [Reset, Init, Rtr, Rts, Error];
        for from in all {
            for to in all {
                let want = matches!(
                    (from, to),
                    (Reset, Init) | (Init, Rtr) | (Rtr, Rts) | (_, Error) | (_, Reset)
                );
                assert_eq!(transition_allowed(from, to), want, "{from:?}->{to:?}");
            }
        }
    }

    #[test]
    fn attribute_bounds_are_checked() {
        let mut m = QpStateMachine::new();
        let bad_port = Transition::ToInit(InitAttrs {
            port_num: 0,
            pkey_index: 0,
            access: Access::REMOTE_READ,
        });
        assert!(matches!(
            m.apply(&bad_port),
            Err(VerbsError::InvalidAttr(_))
        ));
        m.apply(&init()).unwrap();
        let cases: Vec<(RtrAttrs, &str)> = vec![
            (
                RtrAttrs {
                    dest_qpn: 1,
                    ..rtr()
                },
                "dest_qpn",
            ),
            (
                RtrAttrs {
                    dest_qpn: 1 << 24,
                    ..rtr()
                },
                "dest_qpn",
            ),
            (
                RtrAttrs {
                    rq_psn: 1 << 24,
                    ..rtr()
                },
                "rq_psn",
            ),
            (
                RtrAttrs {
                    max_dest_rd_atomic: 0,
                    ..rtr()
                },
                "max_dest_rd_atomic",
            ),
            (
                RtrAttrs {
                    min_rnr_timer: 32,
                    ..rtr()
                },
                "min_rnr_timer",
            ),
            (
                RtrAttrs {
                    remote: RemoteAddress {
                        lid: 0,
                        gid: None,
                        ..rtr().remote
                    },
                    ..rtr()
                },
                "LID",
            ),
            (
                RtrAttrs {
                    remote: RemoteAddress {
                        gid: Some([1; 16]),
                        hop_limit: 0,
                        ..rtr().remote
                    },
                    ..rtr()
                },
                "hop_limit",
            ),
        ];
        for (a, word) in cases {
            let e = m.apply(&Transition::ToRtr(a)).unwrap_err().to_string();
            assert!(e.contains(word), "{e} should name {word}");
            assert_eq!(m.state(), QpState::Init);
        }
        // RoCE: no LID, a GID.
        let roce = RtrAttrs {
            remote: RemoteAddress {
                lid: 0,
                gid: Some([0xfe; 16]),
                ..rtr().remote
            },
            ..rtr()
        };
        m.apply(&Transition::ToRtr(roce)).unwrap();
        for (a, word) in [
            (
                RtsAttrs {
                    sq_psn: 1 << 24,
                    ..rts()
                },
                "sq_psn",
            ),
            (
                RtsAttrs {
                    timeout: 32,
                    ..rts()
                },
                "timeout",
            ),
            (
                RtsAttrs {
                    retry_cnt: 8,
                    ..rts()
                },
                "retry_cnt",
            ),
            (
                RtsAttrs {
                    rnr_retry: 8,
                    ..rts()
                },
                "rnr_retry",
            ),
            (
                RtsAttrs {
                    max_rd_atomic: 0,
                    ..rts()
                },
                "max_rd_atomic",
            ),
        ] {
            let e = m.apply(&Transition::ToRts(a)).unwrap_err().to_string();
            assert!(e.contains(word), "{e} should name {word}");
        }
        m.apply(&Transition::ToRts(rts())).unwrap();
    }

    #[test]
    fn access_bits_and_mtu_values_match_ibverbs() {
        assert_eq!(Access::REMOTE_READ.bits(), 4);
        assert_eq!(Access::LOCAL_WRITE.bits(), 1);
        let all = Access {
            local_write: true,
            remote_read: true,
            remote_write: true,
        };
        assert_eq!(all.bits(), 7);
        for m in [
            PathMtu::Mtu256,
            PathMtu::Mtu512,
            PathMtu::Mtu1024,
            PathMtu::Mtu2048,
            PathMtu::Mtu4096,
        ] {
            assert_eq!(PathMtu::from_ibv(m.ibv_value()), Some(m));
        }
        assert_eq!(PathMtu::Mtu4096.bytes(), 4096);
        assert_eq!(PathMtu::Mtu256.bytes(), 256);
        assert_eq!(PathMtu::from_ibv(0), None);
        assert_eq!(PathMtu::from_ibv(6), None);
    }
}
