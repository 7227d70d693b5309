//! The command helpers of [`HostConnection`]: Fabrics (Connect, Property Get/Set), admin
//! (enable/shutdown, Identify, Get Log Page, Keep Alive) and NVM I/O commands, each built on
//! [`HostConnection::submit_ok`] or [`HostConnection::start_fused`].

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::task::JoinHandle;

use super::cmd::{
    self, cc, prop, Completion, DiscoveryLog, IdentifyController, IdentifyNamespace, Sqe,
};
use super::conn::{nvme_ok, HostConnection, HostError, Xfer};

impl HostConnection {
    // ---- Fabrics ----------------------------------------------------------

    async fn connect_queue(
        &self,
        subnqn: &str,
        cntlid: u16,
        qid: u16,
        sqsize: u16,
        kato_ms: u32,
    ) -> Result<Completion, HostError> {
        if sqsize == 0 {
            return Err(HostError::InvalidArgument(
                "sqsize is 0's based and must be >= 1".into(),
            ));
        }
        let data = cmd::connect_data(
            &self.options().hostid,
            cntlid,
            subnqn,
            &self.options().hostnqn,
        );
        let mut sqe = Sqe::connect(qid, sqsize, kato_ms);
        if self.options().disable_sq_flow_control {
            sqe = sqe.disable_sq_flow_control();
        }
        let r = self.submit_ok(sqe, Xfer::Write(Bytes::from(data))).await?;
        if self.options().disable_sq_flow_control && r.cqe.sqhd() == cmd::SQHD_FLOW_CONTROL_DISABLED
        {
            self.set_sq_flow_control_disabled();
        }
        // sqsize is 0's based: allow sqsize outstanding (one slot exists already).
        self.add_queue_slots(sqsize as usize - 1);
        if r.cqe.dw0() & cmd::fabrics::CONNECT_AUTHREQ_ATR != 0 {
            self.authenticate(subnqn).await?;
        }
        Ok(r.cqe)
    }

    /// Connect the admin queue (QID 0, SQSIZE 31, dynamic controller);
    /// returns the controller ID.
    pub async fn connect_admin(&self, subnqn: &str, kato_ms: u32) -> Result<u16, HostError> {
        let cqe = self
            .connect_queue(subnqn, cmd::CNTLID_DYNAMIC, 0, 31, kato_ms)
            .await?;
        Ok(cqe.dw0() as u16)
    }

    /// Connect an I/O queue `qid` of 0's based size `sqsize` to controller `cntlid`.
    pub async fn connect_io(
        &self,
        subnqn: &str,
        cntlid: u16,
        qid: u16,
        sqsize: u16,
    ) -> Result<(), HostError> {
        self.connect_queue(subnqn, cntlid, qid, sqsize, 0)
            .await
            .map(|_| ())
    }

    /// Property Get (4 or 8 bytes).
    pub async fn property_get(&self, offset: u32, eight_bytes: bool) -> Result<u64, HostError> {
        let r = self
            .submit_ok(Sqe::property_get(offset, eight_bytes), Xfer::None)
            .await?;
        Ok(if eight_bytes {
            r.cqe.result64()
        } else {
            u64::from(r.cqe.dw0())
        })
    }

    /// Property Set (4 or 8 bytes).
    pub async fn property_set(
        &self,
        offset: u32,
        value: u64,
        eight_bytes: bool,
    ) -> Result<(), HostError> {
        self.submit_ok(Sqe::property_set(offset, value, eight_bytes), Xfer::None)
            .await
            .map(|_| ())
    }

    async fn wait_csts(&self, mask: u32, want: u32) -> Result<u32, HostError> {
        let cap = self.property_get(prop::CAP, true).await?;
        // CAP.TO: worst case ready time in 500 ms units; cap our wait by the command timeout too.
        let to =
            Duration::from_millis(((cap >> 24) & 0xff).max(1) * 500).min(self.options().timeout);
        let deadline = tokio::time::Instant::now() + to;
        loop {
            let csts = self.property_get(prop::CSTS, false).await? as u32;
            if csts & cc::CSTS_CFS != 0 {
                return Err(HostError::Protocol(format!(
                    "controller fatal status, CSTS {csts:#x}"
                )));
            }
            if csts & mask == want {
                return Ok(csts);
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(HostError::Timeout);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Set CC.EN (with 64/16-byte queue entry sizes) and wait for CSTS.RDY.
    pub async fn enable_controller(&self) -> Result<(), HostError> {
        let v = cc::EN | cc::IOSQES_64 | cc::IOCQES_16;
        self.property_set(prop::CC, u64::from(v), false).await?;
        self.wait_csts(cc::CSTS_RDY, cc::CSTS_RDY).await.map(|_| ())
    }

    /// Request a normal shutdown (CC.SHN) and wait for CSTS.SHST complete.
    pub async fn shutdown_controller(&self) -> Result<(), HostError> {
        let cur = self.property_get(prop::CC, false).await? as u32;
        self.property_set(prop::CC, u64::from(cur | cc::SHN_NORMAL), false)
            .await?;
        self.wait_csts(cc::CSTS_SHST_MASK, cc::CSTS_SHST_CMPLT)
            .await
            .map(|_| ())
    }

    // ---- Admin --------------------------------------------------------------

    /// Identify with any CNS; returns the 4096 raw bytes.
    pub async fn identify(&self, cns: u8, nsid: u32, cntid: u16) -> Result<Vec<u8>, HostError> {
        let r = self
            .submit_ok(
                Sqe::identify(cns, nsid, cntid),
                Xfer::Read(cmd::IDENTIFY_LEN as u32),
            )
            .await?;
        Ok(r.data)
    }

    /// Identify Controller.
    pub async fn identify_controller(&self) -> Result<IdentifyController, HostError> {
        Ok(IdentifyController::new(
            self.identify(cmd::cns::CTRL, 0, 0).await?,
        ))
    }

    /// Identify Namespace.
    pub async fn identify_namespace(&self, nsid: u32) -> Result<IdentifyNamespace, HostError> {
        Ok(IdentifyNamespace::new(
            self.identify(cmd::cns::NS, nsid, 0).await?,
        ))
    }

    /// Active namespace IDs (first page, NSIDs greater than `after`).
    pub async fn active_namespaces(&self, after: u32) -> Result<Vec<u32>, HostError> {
        let raw = self.identify(cmd::cns::NS_ACTIVE_LIST, after, 0).await?;
        Ok(raw
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .take_while(|&n| n != 0)
            .collect())
    }

    /// Get Log Page: `len` bytes (rounded up to dwords) at byte `offset`.
    pub async fn get_log_page(
        &self,
        lid: u8,
        nsid: u32,
        len: u32,
        offset: u64,
    ) -> Result<Vec<u8>, HostError> {
        let len4 = len.div_ceil(4) * 4;
        if len4 == 0 {
            return Err(HostError::InvalidArgument("log page length 0".into()));
        }
        let mut r = self
            .submit_ok(Sqe::get_log_page(lid, nsid, len4, offset), Xfer::Read(len4))
            .await?;
        r.data.truncate(len as usize);
        Ok(r.data)
    }

    /// Read the whole Discovery Log Page (header, then all records).
    pub async fn discovery_log(&self) -> Result<DiscoveryLog, HostError> {
        let rec = cmd::DISCOVERY_RECORD_LEN as u32;
        let hdr = self.get_log_page(cmd::log::DISCOVERY, 0, rec, 0).await?;
        let numrec = DiscoveryLog::parse(&hdr).numrec.min(1024) as u32;
        if numrec == 0 {
            return Ok(DiscoveryLog::parse(&hdr));
        }
        let all = self
            .get_log_page(cmd::log::DISCOVERY, 0, rec * (numrec + 1), 0)
            .await?;
        Ok(DiscoveryLog::parse(&all))
    }

    /// Keep Alive.
    pub async fn keep_alive(&self) -> Result<(), HostError> {
        self.submit_ok(Sqe::keep_alive(), Xfer::None)
            .await
            .map(|_| ())
    }

    /// Send Keep Alive every `interval` in the background until the
    /// connection closes, a Keep Alive fails, or the connection is dropped.
    pub fn spawn_keep_alive(self: &Arc<Self>, interval: Duration) -> JoinHandle<()> {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(conn) = weak.upgrade() else { break };
                if conn.is_closed() || conn.keep_alive().await.is_err() {
                    break;
                }
            }
        })
    }

    // ---- NVM I/O --------------------------------------------------------------

    fn blocks(len: usize, block_size: u32) -> Result<u32, HostError> {
        if block_size == 0 || len == 0 || !len.is_multiple_of(block_size as usize) {
            return Err(HostError::InvalidArgument(format!(
                "{len} bytes is not a positive multiple of the block size {block_size}"
            )));
        }
        let nlb = len / block_size as usize;
        if nlb > 65536 {
            return Err(HostError::InvalidArgument(format!(
                "{nlb} blocks in one command"
            )));
        }
        Ok(nlb as u32)
    }

    /// Read `nlb` blocks of `block_size` bytes at `slba`.
    pub async fn read(
        &self,
        nsid: u32,
        slba: u64,
        nlb: u32,
        block_size: u32,
    ) -> Result<Vec<u8>, HostError> {
        let len = nlb as u64 * block_size as u64;
        Self::blocks(len as usize, block_size)?;
        let r = self
            .submit_ok(
                Sqe::rw(cmd::io::READ, nsid, slba, nlb),
                Xfer::Read(len as u32),
            )
            .await?;
        Ok(r.data)
    }

    /// Write `data` (a multiple of `block_size`) at `slba`: in-capsule when
    /// small enough, else on R2T.
    pub async fn write(
        &self,
        nsid: u32,
        slba: u64,
        data: impl Into<Bytes>,
        block_size: u32,
    ) -> Result<(), HostError> {
        let data = data.into();
        let nlb = Self::blocks(data.len(), block_size)?;
        self.submit_ok(Sqe::rw(cmd::io::WRITE, nsid, slba, nlb), Xfer::Write(data))
            .await
            .map(|_| ())
    }

    /// Compare `data` with the blocks at `slba`; `Ok(false)` on Compare Failure.
    pub async fn compare(
        &self,
        nsid: u32,
        slba: u64,
        data: impl Into<Bytes>,
        block_size: u32,
    ) -> Result<bool, HostError> {
        let data = data.into();
        let nlb = Self::blocks(data.len(), block_size)?;
        let r = self
            .submit(
                Sqe::rw(cmd::io::COMPARE, nsid, slba, nlb),
                Xfer::Write(data),
            )
            .await?;
        compare_result(r.cqe)
    }

    /// Flush.
    pub async fn flush(&self, nsid: u32) -> Result<(), HostError> {
        self.submit_ok(Sqe::flush(nsid), Xfer::None)
            .await
            .map(|_| ())
    }

    /// Write Zeroes of `nlb` blocks at `slba`.
    pub async fn write_zeroes(&self, nsid: u32, slba: u64, nlb: u32) -> Result<(), HostError> {
        self.submit_ok(Sqe::write_zeroes(nsid, slba, nlb), Xfer::None)
            .await
            .map(|_| ())
    }

    /// Dataset Management, deallocate `(slba, nlb)` ranges.
    pub async fn dsm_deallocate(&self, nsid: u32, ranges: &[(u64, u32)]) -> Result<(), HostError> {
        if ranges.is_empty() || ranges.len() > 256 {
            return Err(HostError::InvalidArgument(format!(
                "{} DSM ranges",
                ranges.len()
            )));
        }
        let data = cmd::dsm_ranges(ranges);
        self.submit_ok(
            Sqe::dsm(nsid, ranges.len() as u32, cmd::DSM_ATTR_DEALLOCATE),
            Xfer::Write(Bytes::from(data)),
        )
        .await
        .map(|_| ())
    }

    /// Fused Compare and Write: writes `write` at `slba` only if the blocks
    /// equal `compare`. `Ok(false)` if the compare failed (nothing written).
    pub async fn compare_and_write(
        &self,
        nsid: u32,
        slba: u64,
        compare: impl Into<Bytes>,
        write: impl Into<Bytes>,
        block_size: u32,
    ) -> Result<bool, HostError> {
        let (compare, write) = (compare.into(), write.into());
        let nlb = Self::blocks(compare.len(), block_size)?;
        if write.len() != compare.len() {
            return Err(HostError::InvalidArgument(
                "compare and write buffers differ in size".into(),
            ));
        }
        let (a, b) = self
            .start_fused(
                (
                    Sqe::rw(cmd::io::COMPARE, nsid, slba, nlb),
                    Xfer::Write(compare),
                ),
                (Sqe::rw(cmd::io::WRITE, nsid, slba, nlb), Xfer::Write(write)),
            )
            .await?;
        let (ra, rb) = (a.wait().await?, b.wait().await?);
        let matched = compare_result(ra.cqe)?;
        if matched {
            nvme_ok(rb)?;
        }
        Ok(matched)
    }
}

/// Compare Failure: SCT 2 (media and data integrity), SC 0x85.
fn compare_result(cqe: Completion) -> Result<bool, HostError> {
    if cqe.is_success() {
        Ok(true)
    } else if cqe.sct() == 2 && cqe.sc() == 0x85 {
        Ok(false)
    } else {
        Err(HostError::Nvme(cqe))
    }
}
