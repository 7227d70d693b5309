//! The NVMe/RDMA connection handshake: `rdma_cm` private data of the connect request, reply
//! and reject (NVMe RDMA Transport Specification; Linux `include/linux/nvme-rdma.h`).

/// `enum nvme_rdma_cm_fmt`: record format 1.0.
pub const CM_FMT_1_0: u16 = 0x0;

/// `enum nvme_rdma_cm_status`: why a connect request was rejected.
pub mod cm_status {
    pub const INVALID_LEN: u16 = 0x01;
    pub const INVALID_RECFMT: u16 = 0x02;
    pub const INVALID_QID: u16 = 0x03;
    pub const INVALID_HSQSIZE: u16 = 0x04;
    pub const INVALID_HRQSIZE: u16 = 0x05;
    pub const NO_RSC: u16 = 0x06;
    pub const INVALID_IRD: u16 = 0x07;
    pub const INVALID_ORD: u16 = 0x08;
    pub const INVALID_CNTLID: u16 = 0x09;
}

/// `struct nvme_rdma_cm_req`: recfmt, qid, hrqsize, hsqsize, cntlid, 22 reserved bytes.
pub const CM_REQ_LEN: usize = 32;
/// `struct nvme_rdma_cm_rep`: recfmt, crqsize, 28 reserved bytes.
pub const CM_REP_LEN: usize = 32;
/// `struct nvme_rdma_cm_rej`: recfmt, sts.
pub const CM_REJ_LEN: usize = 4;

/// The admin queue's depth (`NVME_AQ_DEPTH`): hsqsize must be below it on QID 0.
pub const ADMIN_QUEUE_DEPTH: u16 = 32;

/// A checked connect request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectRequest {
    pub qid: u16,
    /// Entries of the host's receive queue: completions we may have outstanding.
    pub hrqsize: u16,
    /// The host's submission queue size, 0's based: we need hsqsize + 1 receives.
    pub hsqsize: u16,
    pub cntlid: u16,
}

impl ConnectRequest {
    /// Receives the target must post (one per host submission queue entry).
    pub fn recv_queue_size(&self) -> u32 {
        u32::from(self.hsqsize) + 1
    }
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// Parses and checks the private data of a connect request against the largest queue the
/// target accepts (`max_entries`, i.e. CAP.MQES + 1). Errors are `nvme_rdma_cm_status` codes.
pub fn parse_connect_request(data: &[u8], max_entries: u32) -> Result<ConnectRequest, u16> {
    if data.len() < CM_REQ_LEN {
        return Err(cm_status::INVALID_LEN);
    }
    if le16(data, 0) != CM_FMT_1_0 {
        return Err(cm_status::INVALID_RECFMT);
    }
    let req = ConnectRequest {
        qid: le16(data, 2),
        hrqsize: le16(data, 4),
        hsqsize: le16(data, 6),
        cntlid: le16(data, 8),
    };
    // QID 0xFFFF and the like: the Connect command later checks it against the controller.
    if req.qid == u16::MAX {
        return Err(cm_status::INVALID_QID);
    }
    if req.hsqsize == 0 || req.recv_queue_size() > max_entries {
        return Err(cm_status::INVALID_HSQSIZE);
    }
    if req.qid == 0 && req.hsqsize >= ADMIN_QUEUE_DEPTH {
        return Err(cm_status::INVALID_HSQSIZE);
    }
    if req.hrqsize == 0 || u32::from(req.hrqsize) > max_entries {
        return Err(cm_status::INVALID_HRQSIZE);
    }
    Ok(req)
}

/// The reply's private data: crqsize = the receives posted for this queue.
pub fn encode_reply(crqsize: u16) -> [u8; CM_REP_LEN] {
    let mut rep = [0u8; CM_REP_LEN];
    rep[0..2].copy_from_slice(&CM_FMT_1_0.to_le_bytes());
    rep[2..4].copy_from_slice(&crqsize.to_le_bytes());
    rep
}

/// The reject's private data.
pub fn encode_reject(status: u16) -> [u8; CM_REJ_LEN] {
    let mut rej = [0u8; CM_REJ_LEN];
    rej[0..2].copy_from_slice(&CM_FMT_1_0.to_le_bytes());
    rej[2..4].copy_from_slice(&status.to_le_bytes());
    rej
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(recfmt: u16, qid: u16, hrqsize: u16, hsqsize: u16) -> Vec<u8> {
        let mut b = vec![0u8; CM_REQ_LEN];
        b[0..2].copy_from_slice(&recfmt.to_le_bytes());
        b[2..4].copy_from_slice(&qid.to_le_bytes());
        b[4..6].copy_from_slice(&hrqsize.to_le_bytes());
        b[6..8].copy_from_slice(&hsqsize.to_le_bytes());
        b[8..10].copy_from_slice(&0xffffu16.to_le_bytes());
        b
    }

    #[test]
    fn linux_requests_are_accepted() {
        // nvme-rdma: admin queue 32 deep, I/O queues 128 deep.
        let admin = parse_connect_request(&req(0, 0, 32, 31), 1024).unwrap();
        assert_eq!(admin.recv_queue_size(), 32);
        assert_eq!(admin.cntlid, 0xffff);
        let io = parse_connect_request(&req(0, 1, 128, 127), 1024).unwrap();
        assert_eq!((io.qid, io.hrqsize, io.recv_queue_size()), (1, 128, 128));
    }

    #[test]
    fn bad_requests_get_the_spec_codes() {
        assert_eq!(
            parse_connect_request(&[0; 8], 1024),
            Err(cm_status::INVALID_LEN)
        );
        assert_eq!(
            parse_connect_request(&[], 1024),
            Err(cm_status::INVALID_LEN)
        );
        assert_eq!(
            parse_connect_request(&req(1, 0, 32, 31), 1024),
            Err(cm_status::INVALID_RECFMT)
        );
        assert_eq!(
            parse_connect_request(&req(0, 0, 32, 32), 1024),
            Err(cm_status::INVALID_HSQSIZE),
            "admin hsqsize must be <= 31"
        );
        assert_eq!(
            parse_connect_request(&req(0, 1, 128, 1024), 1024),
            Err(cm_status::INVALID_HSQSIZE)
        );
        assert_eq!(
            parse_connect_request(&req(0, 1, 128, 0), 1024),
            Err(cm_status::INVALID_HSQSIZE)
        );
        assert_eq!(
            parse_connect_request(&req(0, 1, 0, 127), 1024),
            Err(cm_status::INVALID_HRQSIZE)
        );
        assert_eq!(
            parse_connect_request(&req(0, 0xffff, 32, 31), 1024),
            Err(cm_status::INVALID_QID)
        );
    }

    #[test]
    fn keyed_sgl_has_a_24_bit_length_and_a_key() {
        use crate::core::command::{Command, SQE_LEN};
        let mut sqe = [0u8; SQE_LEN];
        sqe[0] = 0x02; // Read
        sqe[24..32].copy_from_slice(&0x1122_3344_5566_7788u64.to_le_bytes());
        sqe[32..35].copy_from_slice(&[0x00, 0x00, 0x02]); // 128 KiB
        sqe[35..39].copy_from_slice(&0xdead_beefu32.to_le_bytes());
        sqe[39] = 0x4f; // keyed data block, invalidate
        let cmd = Command::from_bytes(&sqe);
        let d = cmd.sgl();
        assert_eq!((d.desc_type, d.subtype), (4, 0xf));
        assert_eq!(d.length, 128 * 1024);
        assert_eq!(cmd.data_len(), 128 * 1024);
        assert_eq!(d.key, 0xdead_beef);
        assert_eq!(d.address, 0x1122_3344_5566_7788);
    }

    #[test]
    fn reply_and_reject_layout() {
        assert_eq!(&encode_reply(128)[..4], &[0, 0, 128, 0]);
        assert_eq!(encode_reject(cm_status::INVALID_HSQSIZE), [0, 0, 4, 0]);
    }
}
