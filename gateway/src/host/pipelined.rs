//! A lean, blocking, pipelined NVMe/TCP I/O queue for benchmarks.
//!
//! [`LeanQueue`] is one I/O queue (one TCP connection) driven from the calling thread over
//! a blocking socket, with the workspace's PDU codec and no allocation per command: it keeps
//! a fixed number of reads or writes in flight, records the latency of each, and so measures
//! the target rather than itself. The admin queue (Connect, enabling the controller, Set
//! Features Number of Queues) is set up with [`HostConnection`](super::HostConnection)
//! first; its controller ID is what [`LeanQueue::connect`] joins.
//!
//! ```no_run
//! use std::time::Duration;
//! use nvmeof_gateway::host::pipelined::{LeanQueue, Region, Workload};
//! # fn demo(cntlid: u16) -> std::io::Result<()> {
//! let addr = "127.0.0.1:4420".parse().unwrap();
//! let mut q = LeanQueue::connect(addr, "nqn.2016-06.io.example:sub",
//!                                "nqn.2014-08.org.nvmexpress:uuid:bench", cntlid, 1)?;
//! let region = Region { nsid: 1, block_size: 512, bytes: 1 << 30 };
//! let w = Workload { name: "4K randread QD16", write: false, random: true,
//!                    io_bytes: 4096, queue_depth: 16 };
//! let mut figures = q.run(&w, &region, Duration::from_secs(5))?;
//! println!("{:.0} IOPS, p99 {:.1} us", figures.iops(), figures.percentile_us(0.99));
//! # Ok(()) }
//! ```
//!
//! Writes of up to 8 KiB - 64 bytes go as in-capsule data (the gateway's IOCCSZ), larger
//! ones by R2T/H2CData. No digests. Any failed command or protocol surprise ends the run
//! with an error.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::cmd::{self as hcmd, Completion, Sqe};
use crate::tcp::pdu::{encode_icreq, DecoderConfig, IcReq, Pdu, PduDecoder, PduEncoder, Role};

/// How long a socket read may wait for the target.
const READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Bytes one socket read may return.
const READ_CHUNK: usize = 256 * 1024;
/// In-capsule data limit of the gateway's I/O queues (IOCCSZ 516 x 16 bytes, less the SQE).
const IN_CAPSULE_MAX: u32 = 8192 - 64;

/// What to run: direction, access pattern, I/O size and queue depth.
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    /// Label for reports.
    pub name: &'static str,
    /// Writes (of a constant pattern) instead of reads.
    pub write: bool,
    /// Uniformly random aligned offsets; otherwise sequential, wrapping at the region's end.
    pub random: bool,
    /// Bytes per I/O; a multiple of the region's block size.
    pub io_bytes: u32,
    /// Commands kept in flight (at most the queue size the queue was connected with).
    pub queue_depth: usize,
}

/// Where a workload runs: the first `bytes` of namespace `nsid`.
#[derive(Clone, Copy, Debug)]
pub struct Region {
    /// Namespace ID.
    pub nsid: u32,
    /// The namespace's LBA size in bytes.
    pub block_size: u32,
    /// Size of the range the I/Os cover, from LBA 0.
    pub bytes: u64,
}

/// The result of one run: completed I/Os, elapsed time and every I/O's latency.
#[derive(Clone, Debug)]
pub struct Figures {
    /// Completed I/Os.
    pub ios: u64,
    /// Seconds from the first submission to the last completion.
    pub seconds: f64,
    /// Latency of every I/O (submission to completion) in nanoseconds, in completion order.
    pub latencies_ns: Vec<u32>,
}

impl Figures {
    /// Completed I/Os per second.
    pub fn iops(&self) -> f64 {
        self.ios as f64 / self.seconds
    }

    /// The `p` quantile (0.0..=1.0) of the latencies, in microseconds; 0 without I/Os.
    /// Reorders `latencies_ns`.
    pub fn percentile_us(&mut self, p: f64) -> f64 {
        if self.latencies_ns.is_empty() {
            return 0.0;
        }
        let idx = ((self.latencies_ns.len() as f64 - 1.0) * p).round() as usize;
        let (_, v, _) = self.latencies_ns.select_nth_unstable(idx);
        f64::from(*v) / 1000.0
    }

    /// Mean latency in microseconds; 0 without I/Os.
    pub fn mean_us(&self) -> f64 {
        if self.latencies_ns.is_empty() {
            return 0.0;
        }
        let sum: u64 = self.latencies_ns.iter().map(|&l| u64::from(l)).sum();
        sum as f64 / self.latencies_ns.len() as f64 / 1000.0
    }
}

/// A lean pipelined I/O queue over a blocking socket: no allocation per command, so the
/// host is not what limits the figures. See the [module docs](self).
pub struct LeanQueue {
    stream: TcpStream,
    enc: PduEncoder,
    dec: PduDecoder,
    rx: Vec<u8>,
    /// What one `read` lands in, allocated once: a fresh zeroed array per read cost the
    /// host ~10 us per I/O (a 256 KiB memset), which the target's figures then carried.
    chunk: Vec<u8>,
    tx: Vec<u8>,
}

fn protocol_error(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

impl LeanQueue {
    /// Opens a TCP connection to `addr`, exchanges ICReq/ICResp (no digests) and connects
    /// I/O queue `qid` (queue size 128) of controller `cntlid` of `subnqn` as `hostnqn`.
    pub fn connect(
        addr: SocketAddr,
        subnqn: &str,
        hostnqn: &str,
        cntlid: u16,
        qid: u16,
    ) -> io::Result<LeanQueue> {
        Self::connect_with(addr, subnqn, hostnqn, cntlid, qid, false)
    }

    /// [`LeanQueue::connect`], asking with `disable_sq_flow_control` to disable SQ flow
    /// control as `nvme connect-all` does when the discovery log offers it; reads may then
    /// complete by their C2HData's SUCCESS flag. Fails if the controller does not grant it.
    pub fn connect_with(
        addr: SocketAddr,
        subnqn: &str,
        hostnqn: &str,
        cntlid: u16,
        qid: u16,
        disable_sq_flow_control: bool,
    ) -> io::Result<LeanQueue> {
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        // A target that stops answering fails the run instead of hanging it.
        stream.set_read_timeout(Some(READ_TIMEOUT))?;
        let mut q = LeanQueue {
            stream,
            enc: PduEncoder::new(false, false, 0),
            dec: PduDecoder::new(DecoderConfig::new(Role::Host)),
            rx: Vec::with_capacity(4 << 20),
            chunk: vec![0; READ_CHUNK],
            tx: Vec::with_capacity(1 << 20),
        };
        let mut out = Vec::new();
        encode_icreq(&mut out, &IcReq::default());
        q.stream.write_all(&out)?;
        let mut ok = false;
        q.next_pdu(|pdu| ok = matches!(pdu, Pdu::IcResp(_)))?;
        if !ok {
            return Err(protocol_error("expected ICResp"));
        }
        let mut sqe = Sqe::connect(qid, 127, 0);
        if disable_sq_flow_control {
            sqe = sqe.disable_sq_flow_control();
        }
        sqe.set_sgl_in_capsule(hcmd::CONNECT_DATA_LEN as u32);
        let data = hcmd::connect_data(&[9; 16], cntlid, subnqn, hostnqn);
        q.tx.clear();
        q.enc.capsule_cmd(&mut q.tx, &sqe.0, &data);
        q.stream.write_all(&q.tx)?;
        q.tx.clear();
        let mut response = None;
        q.next_pdu(|pdu| {
            if let Pdu::CapsuleResp(r) = pdu {
                response = Some(Completion(*r.cqe));
            }
        })?;
        let Some(cqe) = response else {
            return Err(protocol_error("expected a CapsuleResp to Connect"));
        };
        match cqe.status() {
            0 if disable_sq_flow_control && cqe.sqhd() != hcmd::SQHD_FLOW_CONTROL_DISABLED => {
                Err(protocol_error(format!(
                    "I/O queue {qid}: SQ flow control stays on (SQHD {:#x})",
                    cqe.sqhd()
                )))
            }
            0 => Ok(q),
            s => Err(protocol_error(format!(
                "I/O queue {qid} Connect failed with status {s:#x}"
            ))),
        }
    }

    fn next_pdu(&mut self, mut f: impl FnMut(Pdu<'_>)) -> io::Result<()> {
        loop {
            let decoded = self
                .dec
                .decode(&self.rx)
                .map_err(|e| protocol_error(format!("invalid PDU: {e:?}")))?;
            if let Some((pdu, used)) = decoded {
                f(pdu);
                self.rx.drain(..used);
                return Ok(());
            }
            self.fill()?;
        }
    }

    fn fill(&mut self) -> io::Result<()> {
        let n = self.stream.read(&mut self.chunk)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "target closed the connection",
            ));
        }
        self.rx.extend_from_slice(&self.chunk[..n]);
        Ok(())
    }

    fn queue_command(&mut self, w: &Workload, r: &Region, cid: u16, lba: u64, payload: &[u8]) {
        let blocks = w.io_bytes / r.block_size;
        let opcode = if w.write {
            hcmd::io::WRITE
        } else {
            hcmd::io::READ
        };
        let mut sqe = Sqe::rw(opcode, r.nsid, lba, blocks);
        sqe.set_cid(cid);
        if w.write && w.io_bytes <= IN_CAPSULE_MAX {
            sqe.set_sgl_in_capsule(w.io_bytes);
            self.enc.capsule_cmd(&mut self.tx, &sqe.0, payload);
        } else {
            sqe.set_sgl_transport(w.io_bytes);
            self.enc.capsule_cmd(&mut self.tx, &sqe.0, &[]);
        }
    }

    /// Keeps `w.queue_depth` commands in flight on `region` for `duration`, then waits for
    /// the outstanding ones. Errors on a failed command, an unexpected PDU or a socket error.
    pub fn run(
        &mut self,
        w: &Workload,
        region: &Region,
        duration: Duration,
    ) -> io::Result<Figures> {
        let block = u64::from(region.block_size);
        if w.queue_depth == 0
            || w.io_bytes == 0
            || u64::from(w.io_bytes) % block != 0
            || region.bytes < u64::from(w.io_bytes)
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "queue depth and I/O size must be > 0, the I/O size a multiple of the block size and at most the region",
            ));
        }
        let payload = vec![0xa5u8; w.io_bytes as usize];
        let span_blocks = region.bytes / block - u64::from(w.io_bytes) / block;
        let step = u64::from(w.io_bytes) / block;
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut seq = 0u64;
        let mut next_lba = |rng: &mut u64| {
            if w.random {
                *rng ^= *rng << 13;
                *rng ^= *rng >> 7;
                *rng ^= *rng << 17;
                (*rng % (span_blocks / step).max(1)) * step
            } else {
                seq = (seq + step) % span_blocks.max(1);
                seq
            }
        };
        let mut started = vec![Instant::now(); w.queue_depth];
        let mut latencies = Vec::with_capacity(1 << 22);
        for (cid, start) in started.iter_mut().enumerate() {
            let lba = next_lba(&mut rng);
            self.queue_command(w, region, cid as u16, lba, &payload);
            *start = Instant::now();
        }
        self.stream.write_all(&self.tx)?;
        self.tx.clear();
        let begin = Instant::now();
        let deadline = begin + duration;
        let mut ios = 0u64;
        let mut outstanding = w.queue_depth;
        let mut stopping = false;
        while outstanding > 0 {
            self.fill()?;
            let mut consumed = 0;
            while let Some((pdu, used)) = self
                .dec
                .decode(&self.rx[consumed..])
                .map_err(|e| protocol_error(format!("invalid PDU: {e:?}")))?
            {
                let completed = match pdu {
                    Pdu::CapsuleResp(r) => Some((r.cid(), Completion(*r.cqe).status())),
                    // SUCCESS: the read completed with its data, no CapsuleResp follows
                    Pdu::C2HData(d) => d.success.then_some((d.cccid, 0)),
                    Pdu::R2T(r) => {
                        let range = r.r2to as usize..(r.r2to + r.r2tl) as usize;
                        let data = payload
                            .get(range)
                            .ok_or_else(|| protocol_error("R2T beyond the command's data"))?;
                        self.enc
                            .h2c_data(&mut self.tx, r.cccid, r.ttag, r.r2to, data, true);
                        None
                    }
                    other => {
                        return Err(protocol_error(format!(
                            "unexpected PDU {:?}",
                            other.pdu_type()
                        )))
                    }
                };
                if let Some((cid, status)) = completed {
                    let cid = usize::from(cid);
                    if status != 0 {
                        return Err(protocol_error(format!(
                            "I/O failed with status {status:#x}"
                        )));
                    }
                    let now = Instant::now();
                    let start = started
                        .get(cid)
                        .ok_or_else(|| protocol_error(format!("unknown CID {cid}")))?;
                    latencies.push(
                        now.duration_since(*start)
                            .as_nanos()
                            .min(u128::from(u32::MAX)) as u32,
                    );
                    ios += 1;
                    if !stopping && now >= deadline {
                        stopping = true;
                    }
                    if stopping {
                        outstanding -= 1;
                    } else {
                        let lba = next_lba(&mut rng);
                        self.queue_command(w, region, cid as u16, lba, &payload);
                        started[cid] = now;
                    }
                }
                consumed += used;
            }
            self.rx.drain(..consumed);
            if !self.tx.is_empty() {
                self.stream.write_all(&self.tx)?;
                self.tx.clear();
            }
        }
        Ok(Figures {
            ios,
            seconds: begin.elapsed().as_secs_f64(),
            latencies_ns: latencies,
        })
    }
}
