//! [`Transition`] -> `ibv_qp_attr` + attribute mask, for `ibv_modify_qp`.
//!
//! Pure (no device needed), so the mapping is unit-tested here.

use rdma_sys::{ibv_gid, ibv_qp_attr, ibv_qp_attr_mask, ibv_qp_state};

use super::qp::Transition;
use super::VerbsError;

/// The attributes and mask of one `ibv_modify_qp` call.
///
/// Validates the transition's attributes first (not the current state: the
/// caller's [`super::QpStateMachine`] does that).
pub fn qp_attr(t: &Transition) -> Result<(ibv_qp_attr, ibv_qp_attr_mask), VerbsError> {
    t.validate()?;
    // SAFETY: ibv_qp_attr is a plain C struct of integers, enums (as integers)
    // and nested plain structs/unions; all-zero is a valid value of it and is
    // what C callers start from (memset 0).
    let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
    let mask = match t {
        Transition::ToInit(i) => {
            a.qp_state = ibv_qp_state::IBV_QPS_INIT;
            a.pkey_index = i.pkey_index;
            a.port_num = i.port_num;
            a.qp_access_flags = i.access.bits();
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
                | ibv_qp_attr_mask::IBV_QP_PORT
                | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS
        }
        Transition::ToRtr(r) => {
            a.qp_state = ibv_qp_state::IBV_QPS_RTR;
            a.path_mtu = r.path_mtu.ibv_value();
            a.dest_qp_num = r.dest_qpn;
            a.rq_psn = r.rq_psn;
            a.max_dest_rd_atomic = r.max_dest_rd_atomic;
            a.min_rnr_timer = r.min_rnr_timer;
            a.ah_attr.dlid = r.remote.lid;
            a.ah_attr.sl = r.remote.service_level;
            a.ah_attr.src_path_bits = 0;
            a.ah_attr.port_num = r.remote.port_num;
            if let Some(gid) = r.remote.gid {
                a.ah_attr.is_global = 1;
                a.ah_attr.grh.dgid = ibv_gid { raw: gid };
                a.ah_attr.grh.sgid_index = r.remote.sgid_index;
                a.ah_attr.grh.hop_limit = r.remote.hop_limit;
                a.ah_attr.grh.flow_label = 0;
                a.ah_attr.grh.traffic_class = 0;
            }
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_AV
                | ibv_qp_attr_mask::IBV_QP_PATH_MTU
                | ibv_qp_attr_mask::IBV_QP_DEST_QPN
                | ibv_qp_attr_mask::IBV_QP_RQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
                | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER
        }
        Transition::ToRts(s) => {
            a.qp_state = ibv_qp_state::IBV_QPS_RTS;
            a.sq_psn = s.sq_psn;
            a.timeout = s.timeout;
            a.retry_cnt = s.retry_cnt;
            a.rnr_retry = s.rnr_retry;
            a.max_rd_atomic = s.max_rd_atomic;
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_TIMEOUT
                | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
                | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
                | ibv_qp_attr_mask::IBV_QP_SQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC
        }
        Transition::ToError => {
            a.qp_state = ibv_qp_state::IBV_QPS_ERR;
            ibv_qp_attr_mask::IBV_QP_STATE
        }
        Transition::ToReset => {
            a.qp_state = ibv_qp_state::IBV_QPS_RESET;
            ibv_qp_attr_mask::IBV_QP_STATE
        }
    };
    Ok((a, mask))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::qp::tests::{init, rtr, rts};
    use crate::verbs::qp::{RemoteAddress, RtrAttrs};
    use rdma_sys::{ibv_access_flags, ibv_mtu};

    #[test]
    fn init_sets_port_pkey_and_remote_read() {
        let (a, m) = qp_attr(&init()).unwrap();
        assert_eq!(a.qp_state, ibv_qp_state::IBV_QPS_INIT);
        assert_eq!(a.port_num, 1);
        assert_eq!(a.pkey_index, 0);
        assert_eq!(
            a.qp_access_flags,
            ibv_access_flags::IBV_ACCESS_REMOTE_READ.0
        );
        // IBV_QP_STATE | PKEY_INDEX | PORT | ACCESS_FLAGS = 1 | 16 | 32 | 8
        assert_eq!(m.0, 57);
    }

    #[test]
    fn rtr_sets_path_and_responder_resources() {
        let (a, m) = qp_attr(&Transition::ToRtr(rtr())).unwrap();
        assert_eq!(a.qp_state, ibv_qp_state::IBV_QPS_RTR);
        assert_eq!(a.path_mtu, ibv_mtu::IBV_MTU_4096);
        assert_eq!(a.dest_qp_num, 0x1234);
        assert_eq!(a.rq_psn, 0x00ab_cdef);
        assert_eq!(a.max_dest_rd_atomic, 16);
        assert_eq!(a.min_rnr_timer, 12);
        assert_eq!(a.ah_attr.dlid, 7);
        assert_eq!(a.ah_attr.port_num, 1);
        assert_eq!(a.ah_attr.is_global, 0);
        let want = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_AV
            | ibv_qp_attr_mask::IBV_QP_PATH_MTU
            | ibv_qp_attr_mask::IBV_QP_DEST_QPN
            | ibv_qp_attr_mask::IBV_QP_RQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
        assert_eq!(m, want);
        // 1 | 128 | 256 | 1048576 | 4096 | 131072 | 32768
        assert_eq!(m.0, 1_216_897);
        // Nothing of RTS leaks in.
        assert_eq!(a.sq_psn, 0);
        assert_eq!(a.max_rd_atomic, 0);
    }

    #[test]
    fn rtr_with_gid_sets_the_global_route() {
        let mut r = rtr();
        r.remote = RemoteAddress {
            lid: 0,
            gid: Some([9; 16]),
            sgid_index: 3,
            hop_limit: 1,
            ..r.remote
        };
        let (a, _) = qp_attr(&Transition::ToRtr(RtrAttrs { ..r })).unwrap();
        assert_eq!(a.ah_attr.is_global, 1);
        // SAFETY: `raw` is the member written above; every bit pattern is a valid [u8; 16].
        assert_eq!(unsafe { a.ah_attr.grh.dgid.raw }, [9; 16]);
        assert_eq!(a.ah_attr.grh.sgid_index, 3);
        assert_eq!(a.ah_attr.grh.hop_limit, 1);
    }

    #[test]
    fn rts_sets_sender_attributes() {
        let (a, m) = qp_attr(&Transition::ToRts(rts())).unwrap();
        assert_eq!(a.qp_state, ibv_qp_state::IBV_QPS_RTS);
        assert_eq!(
            (
                a.sq_psn,
                a.timeout,
                a.retry_cnt,
                a.rnr_retry,
                a.max_rd_atomic
            ),
            (42, 14, 7, 7, 16)
        );
        // 1 | 512 | 1024 | 2048 | 65536 | 8192
        assert_eq!(m.0, 77_313);
    }

    #[test]
    fn error_and_reset_only_set_the_state_and_bad_attrs_are_refused() {
        let (a, m) = qp_attr(&Transition::ToError).unwrap();
        assert_eq!(
            (a.qp_state, m),
            (ibv_qp_state::IBV_QPS_ERR, ibv_qp_attr_mask::IBV_QP_STATE)
        );
        let (a, m) = qp_attr(&Transition::ToReset).unwrap();
        assert_eq!(
            (a.qp_state, m),
            (ibv_qp_state::IBV_QPS_RESET, ibv_qp_attr_mask::IBV_QP_STATE)
        );
        let mut r = rts();
        r.timeout = 40;
        assert!(qp_attr(&Transition::ToRts(r)).is_err());
    }
}
