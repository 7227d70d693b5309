//! The connection: ICReq/ICResp, a writer task, and a reader task that demultiplexes
//! completions by CID; the command helpers are in `commands.rs`.

use std::collections::HashMap;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpStream, ToSocketAddrs};
use tokio::sync::{mpsc, oneshot, watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;

use super::cmd::{self, Completion, Sqe};
use crate::auth::{DhGroup, DhchapSecret, HashFunction};
use crate::tcp::digest;
use crate::tcp::pdu::{
    self, encode_h2c_term_req, encode_icreq, DecoderConfig, IcReq, IcResp, Pdu, PduDecoder,
    PduEncoder, PduError, Role,
};

/// Connection parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostOptions {
    /// Host NQN sent in Connect.
    pub hostnqn: String,
    /// Host identifier sent in Connect.
    pub hostid: [u8; 16],
    /// Request header digests.
    pub header_digest: bool,
    /// Request data digests.
    pub data_digest: bool,
    /// HPDA to request (0's based dwords).
    pub hpda: u8,
    /// MAXR2T to announce (0's based).
    pub maxr2t: u32,
    /// Largest PDU accepted from the controller.
    pub max_pdu_len: u32,
    /// Largest write sent as in-capsule data (admin queue: 8 KiB capsule
    /// minus the SQE; for I/O queues use `IdentifyController::in_capsule_data_max`).
    pub in_capsule_data_max: usize,
    /// Per-command (and ICReq/ICResp) timeout.
    pub timeout: Duration,
    /// Ask at Connect to disable SQ flow control (`nvme connect --disable-sqflow`).
    pub disable_sq_flow_control: bool,
    /// The host's DH-HMAC-CHAP secret (`nvme connect --dhchap-secret`): used when a Connect
    /// response asks the queue to authenticate.
    pub dhchap_secret: Option<DhchapSecret>,
    /// The controller's secret (`--dhchap-ctrl-secret`): the host then makes the
    /// controller prove itself too.
    pub dhchap_ctrl_secret: Option<DhchapSecret>,
    /// Hashes and DH groups offered in AUTH_Negotiate (default: all, as Linux offers).
    pub dhchap_hashes: Vec<HashFunction>,
    pub dhchap_dhgroups: Vec<DhGroup>,
}

impl HostOptions {
    /// Defaults: no digests, HPDA 0, 8 MiB max PDU, 8 KiB - 64 in-capsule
    /// data, 30 s timeout, host ID derived from the NQN.
    pub fn new(hostnqn: impl Into<String>) -> Self {
        let hostnqn = hostnqn.into();
        let mut hostid = [0u8; 16];
        for (i, chunk) in hostid.chunks_mut(4).enumerate() {
            let mut d = digest::DataDigest::new();
            d.update(&[i as u8]);
            d.update(hostnqn.as_bytes());
            chunk.copy_from_slice(&d.to_wire());
        }
        Self {
            hostnqn,
            hostid,
            header_digest: false,
            data_digest: false,
            hpda: 0,
            maxr2t: 0,
            max_pdu_len: (8 << 20) + 4096,
            in_capsule_data_max: cmd::TCP_ADMIN_CCSZ - cmd::SQE_LEN,
            timeout: Duration::from_secs(30),
            disable_sq_flow_control: false,
            dhchap_secret: None,
            dhchap_ctrl_secret: None,
            dhchap_hashes: vec![
                HashFunction::Sha256,
                HashFunction::Sha384,
                HashFunction::Sha512,
            ],
            dhchap_dhgroups: DhGroup::ALL.to_vec(),
        }
    }
}

/// Initiator errors.
#[derive(Debug, Error)]
pub enum HostError {
    /// Socket error.
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// The controller sent something we cannot decode; we sent an H2CTermReq.
    #[error("PDU error: {0}")]
    Pdu(#[from] PduError),
    /// The controller violated the protocol in a way the codec does not see.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The controller terminated the connection with a C2HTermReq.
    #[error("controller terminated the connection: FES {fes:#x} FEI {fei:#x}")]
    Terminated {
        /// Fatal error status.
        fes: u16,
        /// Fatal error information.
        fei: u32,
    },
    /// The connection is gone (the reason it went is in the message).
    #[error("connection closed: {0}")]
    Closed(String),
    /// Data digest mismatch on data received for this command.
    #[error("data digest error on received data")]
    DataDigest,
    /// The command completed with a non-zero status.
    #[error("command failed: SCT {:#x} SC {:#x} (DNR {})", .0.sct(), .0.sc(), .0.dnr())]
    Nvme(Completion),
    /// No completion within the timeout.
    #[error("command timed out")]
    Timeout,
    /// In-band authentication did not succeed (the controller refused, or failed to prove
    /// itself, or the host has no secret).
    #[error("authentication failed: {0}")]
    Authentication(String),
    /// Bad argument to a helper.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// Data movement of a command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Xfer {
    /// No data.
    None,
    /// Host to controller: in-capsule if small enough, else on R2T.
    Write(Bytes),
    /// Host to controller, always on R2T (never in-capsule).
    WriteR2t(Bytes),
    /// Controller to host: this many bytes by C2HData.
    Read(u32),
}

/// A command completion and the data read by it (empty unless a read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// The CQE (synthesized if the controller used C2HData SUCCESS).
    pub cqe: Completion,
    /// Data received by C2HData.
    pub data: Vec<u8>,
    /// The controller completed the command with the C2HData SUCCESS flag instead of a
    /// CapsuleResp.
    pub completed_by_data: bool,
}

/// A fully raw command: the SQE is sent as is (its CID is used to match the
/// response, its SGL is not touched).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawCommand {
    /// The SQE.
    pub sqe: [u8; cmd::SQE_LEN],
    /// Data to put in the capsule (may disagree with the SGL, on purpose).
    pub in_capsule: Bytes,
    /// Data to answer R2Ts from.
    pub r2t_data: Bytes,
    /// Bytes of C2HData to accept.
    pub read_len: u32,
}

type Reply = oneshot::Sender<Result<Response, HostError>>;

struct Pending {
    reply: Option<Reply>,
    write: Bytes,
    read: Vec<u8>,
    error: Option<HostError>,
    /// Check on successful completion that all data moved.
    strict: bool,
    /// C2HData bytes received and whether LAST_PDU was seen.
    read_got: usize,
    read_last: bool,
    /// Write bytes requested by R2Ts.
    r2t_got: usize,
    _permit: Option<OwnedSemaphorePermit>,
}

enum WMsg {
    Data(Vec<Bytes>),
    Flush(oneshot::Sender<()>),
    Shutdown,
}

struct Shared {
    pending: Mutex<HashMap<u16, Pending>>,
    next_cid: Mutex<u16>,
    tx: mpsc::UnboundedSender<WMsg>,
    slots: Arc<Semaphore>,
    encoder: PduEncoder,
    maxh2cdata: u32,
    in_capsule_max: AtomicUsize,
    timeout: Duration,
    closed: AtomicBool,
    close_reason: Mutex<Option<String>>,
    term_req: Mutex<Option<(u16, u32)>>,
    closed_tx: watch::Sender<bool>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    fn send(&self, chunks: Vec<Bytes>) -> Result<(), HostError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(self.closed_error());
        }
        self.tx
            .send(WMsg::Data(chunks))
            .map_err(|_| HostError::Closed("writer gone".into()))
    }

    fn closed_error(&self) -> HostError {
        if let Some((fes, fei)) = *lock(&self.term_req) {
            return HostError::Terminated { fes, fei };
        }
        HostError::Closed(
            lock(&self.close_reason)
                .clone()
                .unwrap_or_else(|| "closed".into()),
        )
    }

    /// Mark the connection dead and fail every outstanding command.
    fn close(&self, reason: String) {
        {
            let mut r = lock(&self.close_reason);
            if r.is_none() {
                *r = Some(reason);
            }
        }
        self.closed.store(true, Ordering::Release);
        let drained: Vec<Pending> = lock(&self.pending).drain().map(|(_, p)| p).collect();
        for mut p in drained {
            if let Some(r) = p.reply.take() {
                let _ = r.send(Err(self.closed_error()));
            }
        }
        let _ = self.tx.send(WMsg::Shutdown);
        let _ = self.closed_tx.send(true);
    }

    /// Register a command under `cid`; `None` picks a free CID.
    fn register(
        &self,
        cid: Option<u16>,
        write: Bytes,
        read_len: u32,
        permit: Option<OwnedSemaphorePermit>,
        strict: bool,
    ) -> Result<(u16, oneshot::Receiver<Result<Response, HostError>>), HostError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(self.closed_error());
        }
        let (tx, rx) = oneshot::channel();
        let mut pending = lock(&self.pending);
        let cid = match cid {
            Some(c) => {
                if pending.contains_key(&c) {
                    return Err(HostError::InvalidArgument(format!(
                        "CID {c} is outstanding"
                    )));
                }
                c
            }
            None => {
                let mut next = lock(&self.next_cid);
                let mut tries = 0u32;
                while pending.contains_key(&*next) {
                    *next = next.wrapping_add(1);
                    tries += 1;
                    if tries > u16::MAX as u32 {
                        return Err(HostError::InvalidArgument("no free CID".into()));
                    }
                }
                let c = *next;
                *next = next.wrapping_add(1);
                c
            }
        };
        pending.insert(
            cid,
            Pending {
                reply: Some(tx),
                write,
                read: vec![0; read_len as usize],
                error: None,
                strict,
                read_got: 0,
                read_last: false,
                r2t_got: 0,
                _permit: permit,
            },
        );
        Ok((cid, rx))
    }

    fn unregister(&self, cid: u16) {
        lock(&self.pending).remove(&cid);
    }

    /// `by_data`: the completion is a C2HData's SUCCESS flag, not a CapsuleResp.
    fn complete(&self, cid: u16, cqe: Completion, by_data: bool) -> Result<(), HostError> {
        let Some(mut p) = lock(&self.pending).remove(&cid) else {
            return Err(HostError::Protocol(format!(
                "completion for unknown CID {cid}"
            )));
        };
        let short = if p.strict && cqe.is_success() {
            if p.read_got != p.read.len() || (!p.read.is_empty() && !p.read_last) {
                Some(format!(
                    "CID {cid} completed after {} of {} read bytes (LAST_PDU seen: {})",
                    p.read_got,
                    p.read.len(),
                    p.read_last
                ))
            } else if p.r2t_got != p.write.len() {
                Some(format!(
                    "CID {cid} completed after R2Ts for {} of {} write bytes",
                    p.r2t_got,
                    p.write.len()
                ))
            } else {
                None
            }
        } else {
            None
        };
        let res = match (p.error.take(), short) {
            (Some(e), _) => Err(e),
            (None, Some(msg)) => Err(HostError::Protocol(msg)),
            (None, None) => Ok(Response {
                cqe,
                data: std::mem::take(&mut p.read),
                completed_by_data: by_data,
            }),
        };
        if let Some(r) = p.reply.take() {
            let _ = r.send(res);
        }
        Ok(())
    }

    /// Handle one PDU from the controller.
    fn handle(&self, pdu: Pdu<'_>) -> Result<(), HostError> {
        match pdu {
            Pdu::CapsuleResp(r) => self.complete(r.cid(), Completion(*r.cqe), false),
            Pdu::C2HData(d) => {
                {
                    let mut pending = lock(&self.pending);
                    let Some(p) = pending.get_mut(&d.cccid) else {
                        return Err(HostError::Protocol(format!(
                            "C2HData for unknown CID {}",
                            d.cccid
                        )));
                    };
                    let start = d.datao as usize;
                    let Some(dst) = p.read.get_mut(start..start + d.data.len()) else {
                        return Err(HostError::Pdu(PduError::DataOutOfRange {
                            offset: pdu::offsets::DATAO,
                        }));
                    };
                    dst.copy_from_slice(d.data);
                    p.read_got += d.data.len();
                    p.read_last |= d.last;
                }
                if d.success {
                    self.complete(d.cccid, Completion::success(d.cccid), true)?;
                }
                Ok(())
            }
            Pdu::R2T(r) => {
                let data = {
                    let mut pending = lock(&self.pending);
                    let Some(p) = pending.get_mut(&r.cccid) else {
                        return Err(HostError::Protocol(format!(
                            "R2T for unknown CID {}",
                            r.cccid
                        )));
                    };
                    let start = r.r2to as usize;
                    let end = start.saturating_add(r.r2tl as usize);
                    if r.r2tl == 0 || end > p.write.len() {
                        return Err(HostError::Pdu(PduError::DataOutOfRange {
                            offset: pdu::offsets::DATAL,
                        }));
                    }
                    p.r2t_got += r.r2tl as usize;
                    p.write.slice(start..end)
                };
                let max = (self.maxh2cdata as usize).max(4096);
                let mut chunks = Vec::new();
                let mut off = 0usize;
                while off < data.len() {
                    let n = (data.len() - off).min(max);
                    let part = data.slice(off..off + n);
                    let last = off + n == data.len();
                    let mut hdr = Vec::with_capacity(64);
                    self.encoder.h2c_data_header(
                        &mut hdr,
                        r.cccid,
                        r.ttag,
                        r.r2to + off as u32,
                        n as u32,
                        last,
                    );
                    chunks.push(Bytes::from(hdr));
                    if self.encoder.data_digest() {
                        let d = digest::data_digest(&part);
                        chunks.push(part);
                        chunks.push(Bytes::copy_from_slice(&d.to_le_bytes()));
                    } else {
                        chunks.push(part);
                    }
                    off += n;
                }
                self.send(chunks)
            }
            Pdu::C2HTermReq(t) => {
                *lock(&self.term_req) = Some((t.fes, t.fei));
                Err(HostError::Terminated {
                    fes: t.fes,
                    fei: t.fei,
                })
            }
            other => Err(HostError::Protocol(format!(
                "unexpected {:?}",
                other.pdu_type()
            ))),
        }
    }
}

/// An outstanding command; `.await` it (or call [`Inflight::wait`]) for the response.
pub struct Inflight {
    rx: oneshot::Receiver<Result<Response, HostError>>,
    timeout: Duration,
    cid: u16,
}

impl Inflight {
    /// The command's CID.
    pub fn cid(&self) -> u16 {
        self.cid
    }

    /// Wait for the response (regardless of its status). On timeout the
    /// CID stays reserved until the controller answers.
    pub async fn wait(self) -> Result<Response, HostError> {
        match tokio::time::timeout(self.timeout, self.rx).await {
            Err(_) => Err(HostError::Timeout),
            Ok(Err(_)) => Err(HostError::Closed("connection dropped".into())),
            Ok(Ok(r)) => r,
        }
    }
}

impl IntoFuture for Inflight {
    type Output = Result<Response, HostError>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(self.wait())
    }
}

/// One NVMe/TCP connection (one queue) to a controller.
pub struct HostConnection {
    shared: Arc<Shared>,
    opts: HostOptions,
    icresp: IcResp,
    closed_rx: watch::Receiver<bool>,
    reader: JoinHandle<()>,
    writer: JoinHandle<()>,
    /// The controller accepted disabling SQ flow control (SQHD FFFFh in the Connect
    /// response).
    sq_flow_control_disabled: AtomicBool,
}

impl Drop for HostConnection {
    fn drop(&mut self) {
        self.reader.abort();
        self.writer.abort();
    }
}

impl std::fmt::Debug for HostConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostConnection")
            .field("icresp", &self.icresp)
            .field("closed", &self.is_closed())
            .finish()
    }
}

pub(super) fn nvme_ok(r: Response) -> Result<Response, HostError> {
    if r.cqe.is_success() {
        Ok(r)
    } else {
        Err(HostError::Nvme(r.cqe))
    }
}

impl HostConnection {
    /// Open a TCP connection and perform the ICReq/ICResp exchange.
    pub async fn connect(addr: impl ToSocketAddrs, opts: HostOptions) -> Result<Self, HostError> {
        let stream = tokio::time::timeout(opts.timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| HostError::Timeout)??;
        Self::from_stream(stream, opts).await
    }

    /// Perform the ICReq/ICResp exchange on an already connected stream.
    pub async fn from_stream(stream: TcpStream, opts: HostOptions) -> Result<Self, HostError> {
        let _ = stream.set_nodelay(true);
        let (mut rd, mut wr) = stream.into_split();
        let mut out = Vec::with_capacity(128);
        encode_icreq(
            &mut out,
            &IcReq {
                pfv: pdu::PFV_1_0,
                hpda: opts.hpda,
                hdgst: opts.header_digest,
                ddgst: opts.data_digest,
                maxr2t: opts.maxr2t,
            },
        );
        wr.write_all(&out).await?;

        let mut cfg = DecoderConfig::new(Role::Host);
        cfg.max_pdu_len = opts.max_pdu_len;
        let mut dec = PduDecoder::new(cfg);
        let mut buf: Vec<u8> = Vec::with_capacity(64 * 1024);
        let (icresp, used) = tokio::time::timeout(opts.timeout, async {
            loop {
                match dec.decode(&buf)? {
                    Some((Pdu::IcResp(r), used)) => return Ok::<_, HostError>((r, used)),
                    Some((Pdu::C2HTermReq(t), _)) => {
                        return Err(HostError::Terminated {
                            fes: t.fes,
                            fei: t.fei,
                        })
                    }
                    Some((p, _)) => {
                        return Err(HostError::Protocol(format!(
                            "expected ICResp, got {:?}",
                            p.pdu_type()
                        )))
                    }
                    None => {}
                }
                if rd.read_buf(&mut buf).await? == 0 {
                    return Err(HostError::Closed("EOF before ICResp".into()));
                }
            }
        })
        .await
        .map_err(|_| HostError::Timeout)??;
        buf.drain(..used);

        if icresp.maxh2cdata < 4096 || !icresp.maxh2cdata.is_multiple_of(4) {
            return Err(HostError::Protocol(format!(
                "invalid MAXH2CDATA {}",
                icresp.maxh2cdata
            )));
        }
        if (icresp.hdgst && !opts.header_digest) || (icresp.ddgst && !opts.data_digest) {
            return Err(HostError::Protocol(
                "controller enabled a digest we did not request".into(),
            ));
        }
        dec.set_digests(icresp.hdgst, icresp.ddgst);
        dec.set_rx_pda(opts.hpda);
        let encoder = PduEncoder::new(icresp.hdgst, icresp.ddgst, icresp.cpda);

        let (tx, rx) = mpsc::unbounded_channel();
        let (closed_tx, closed_rx) = watch::channel(false);
        let shared = Arc::new(Shared {
            pending: Mutex::new(HashMap::new()),
            next_cid: Mutex::new(0),
            tx,
            slots: Arc::new(Semaphore::new(1)),
            encoder,
            maxh2cdata: icresp.maxh2cdata,
            in_capsule_max: AtomicUsize::new(opts.in_capsule_data_max),
            timeout: opts.timeout,
            closed: AtomicBool::new(false),
            close_reason: Mutex::new(None),
            term_req: Mutex::new(None),
            closed_tx,
        });
        let writer = tokio::spawn(writer_task(wr, rx, shared.clone()));
        let reader = tokio::spawn(reader_task(rd, dec, buf, shared.clone()));
        Ok(Self {
            shared,
            opts,
            icresp,
            closed_rx,
            reader,
            writer,
            sq_flow_control_disabled: AtomicBool::new(false),
        })
    }

    /// Whether the controller accepted disabling SQ flow control at Connect.
    pub fn sq_flow_control_disabled(&self) -> bool {
        self.sq_flow_control_disabled.load(Ordering::Relaxed)
    }

    pub(super) fn set_sq_flow_control_disabled(&self) {
        self.sq_flow_control_disabled.store(true, Ordering::Relaxed);
    }

    /// The controller's ICResp.
    pub fn icresp(&self) -> &IcResp {
        &self.icresp
    }

    /// The options this connection was made with.
    pub fn options(&self) -> &HostOptions {
        &self.opts
    }

    /// Largest write sent in-capsule from now on.
    pub fn set_in_capsule_data_max(&self, n: usize) {
        self.shared.in_capsule_max.store(n, Ordering::Relaxed);
    }

    /// Allow `n` more outstanding commands (the queue starts with one slot,
    /// for Connect; the connect helpers add the rest).
    pub fn add_queue_slots(&self, n: usize) {
        self.shared.slots.add_permits(n);
    }

    /// Whether the connection has failed or been closed.
    pub fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire)
    }

    /// The C2HTermReq (FES, FEI) received, if any.
    pub fn term_req(&self) -> Option<(u16, u32)> {
        *lock(&self.shared.term_req)
    }

    /// Why the connection closed, if it did.
    pub fn close_reason(&self) -> Option<String> {
        lock(&self.shared.close_reason).clone()
    }

    /// Wait until the connection is closed (by either side), at most `timeout`.
    /// Returns whether it is closed.
    pub async fn wait_closed(&self, timeout: Duration) -> bool {
        let mut rx = self.closed_rx.clone();
        let _ = tokio::time::timeout(timeout, rx.wait_for(|c| *c)).await;
        self.is_closed()
    }

    /// Close the connection (half-close our side, then drop).
    pub async fn close(self) {
        let _ = self.shared.tx.send(WMsg::Shutdown);
        let mut rx = self.closed_rx.clone();
        let _ = tokio::time::timeout(Duration::from_secs(2), rx.wait_for(|c| *c)).await;
    }

    /// Send raw bytes on the connection (after anything already queued)
    /// and wait until they are handed to the socket.
    pub async fn send_raw(&self, bytes: &[u8]) -> Result<(), HostError> {
        self.shared.send(vec![Bytes::copy_from_slice(bytes)])?;
        let (tx, rx) = oneshot::channel();
        self.shared
            .tx
            .send(WMsg::Flush(tx))
            .map_err(|_| HostError::Closed("writer gone".into()))?;
        rx.await.map_err(|_| self.shared.closed_error())
    }

    async fn slot(&self) -> Result<OwnedSemaphorePermit, HostError> {
        let permit =
            tokio::time::timeout(self.opts.timeout, self.shared.slots.clone().acquire_owned())
                .await
                .map_err(|_| HostError::Timeout)?
                .map_err(|_| HostError::Closed("queue closed".into()))?;
        Ok(permit)
    }

    /// Encode a capsule for `sqe` with its SGL set for `xfer`; returns the
    /// R2T data and read length to register.
    fn prepare(&self, sqe: &mut Sqe, xfer: &Xfer) -> (Bytes, Bytes, u32) {
        match xfer {
            Xfer::None => {
                sqe.set_sgl_transport(0);
                (Bytes::new(), Bytes::new(), 0)
            }
            Xfer::Read(n) => {
                sqe.set_sgl_transport(*n);
                (Bytes::new(), Bytes::new(), *n)
            }
            Xfer::Write(d) if d.len() <= self.shared.in_capsule_max.load(Ordering::Relaxed) => {
                sqe.set_sgl_in_capsule(d.len() as u32);
                (d.clone(), Bytes::new(), 0)
            }
            Xfer::Write(d) | Xfer::WriteR2t(d) => {
                sqe.set_sgl_transport(d.len() as u32);
                (Bytes::new(), d.clone(), 0)
            }
        }
    }

    fn capsule(&self, sqe: &[u8; cmd::SQE_LEN], in_capsule: &[u8]) -> Vec<Bytes> {
        let enc = &self.shared.encoder;
        let mut out = Vec::with_capacity(enc.pdu_len(pdu::PduType::CapsuleCmd, in_capsule.len()));
        enc.capsule_cmd(&mut out, sqe, in_capsule);
        vec![Bytes::from(out)]
    }

    /// Send a command (CID and SGL filled in here) and return a handle to
    /// its completion. Awaiting this only waits for a free queue slot.
    pub async fn start(&self, mut sqe: Sqe, xfer: Xfer) -> Result<Inflight, HostError> {
        let permit = self.slot().await?;
        let (in_capsule, r2t, read_len) = self.prepare(&mut sqe, &xfer);
        let (cid, rx) = self
            .shared
            .register(None, r2t, read_len, Some(permit), true)?;
        sqe.set_cid(cid);
        let chunks = self.capsule(&sqe.0, &in_capsule);
        if let Err(e) = self.shared.send(chunks) {
            self.shared.unregister(cid);
            return Err(e);
        }
        Ok(Inflight {
            rx,
            timeout: self.shared.timeout,
            cid,
        })
    }

    /// Send a command and wait for its response, whatever its status.
    pub async fn submit(&self, sqe: Sqe, xfer: Xfer) -> Result<Response, HostError> {
        self.start(sqe, xfer).await?.wait().await
    }

    /// Send a command and wait for its response; a non-zero status is an error.
    pub async fn submit_ok(&self, sqe: Sqe, xfer: Xfer) -> Result<Response, HostError> {
        nvme_ok(self.submit(sqe, xfer).await?)
    }

    /// Send a raw SQE exactly as given (its CID is used to match the
    /// response) and return the CQE and any C2HData received.
    pub async fn start_raw(&self, cmd: RawCommand) -> Result<Inflight, HostError> {
        let permit = self.slot().await?;
        let cid = u16::from_le_bytes([cmd.sqe[2], cmd.sqe[3]]);
        let (cid, rx) =
            self.shared
                .register(Some(cid), cmd.r2t_data, cmd.read_len, Some(permit), false)?;
        let chunks = self.capsule(&cmd.sqe, &cmd.in_capsule);
        if let Err(e) = self.shared.send(chunks) {
            self.shared.unregister(cid);
            return Err(e);
        }
        Ok(Inflight {
            rx,
            timeout: self.shared.timeout,
            cid,
        })
    }

    /// Forgets an outstanding command without telling the controller, freeing its CID and
    /// queue slot: what SPDK's initiator does with its Asynchronous Event Requests when it
    /// detaches (it completes them itself, then reuses their CIDs at once). A completion
    /// the controller sends for it afterwards is a protocol error that closes the
    /// connection.
    pub fn forget(&self, cid: u16) {
        self.shared.unregister(cid);
    }

    /// [`HostConnection::start_raw`] and wait.
    pub async fn submit_raw(&self, cmd: RawCommand) -> Result<Response, HostError> {
        self.start_raw(cmd).await?.wait().await
    }

    /// Send two commands as a fused pair (FUSE bits set here), back to back
    /// in one write so nothing can come between them on the queue.
    pub async fn start_fused(
        &self,
        first: (Sqe, Xfer),
        second: (Sqe, Xfer),
    ) -> Result<(Inflight, Inflight), HostError> {
        let p1 = self.slot().await?;
        let p2 = self.slot().await?;
        let (mut s1, x1) = first;
        let (mut s2, x2) = second;
        s1.0[1] = (s1.0[1] & !0x3) | cmd::sqe_flags::FUSE_FIRST;
        s2.0[1] = (s2.0[1] & !0x3) | cmd::sqe_flags::FUSE_SECOND;
        let (ic1, r1, n1) = self.prepare(&mut s1, &x1);
        let (ic2, r2, n2) = self.prepare(&mut s2, &x2);
        let (c1, rx1) = self.shared.register(None, r1, n1, Some(p1), true)?;
        let (c2, rx2) = match self.shared.register(None, r2, n2, Some(p2), true) {
            Ok(v) => v,
            Err(e) => {
                self.shared.unregister(c1);
                return Err(e);
            }
        };
        s1.set_cid(c1);
        s2.set_cid(c2);
        let mut chunks = self.capsule(&s1.0, &ic1);
        chunks.extend(self.capsule(&s2.0, &ic2));
        if let Err(e) = self.shared.send(chunks) {
            self.shared.unregister(c1);
            self.shared.unregister(c2);
            return Err(e);
        }
        let t = self.shared.timeout;
        Ok((
            Inflight {
                rx: rx1,
                timeout: t,
                cid: c1,
            },
            Inflight {
                rx: rx2,
                timeout: t,
                cid: c2,
            },
        ))
    }
}

async fn writer_task(
    wr: OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<WMsg>,
    shared: Arc<Shared>,
) {
    let mut w = BufWriter::with_capacity(256 * 1024, wr);
    let mut flushed = Vec::new();
    let mut shutdown = false;
    'outer: while let Some(first) = rx.recv().await {
        let mut msg = Some(first);
        while let Some(m) = msg.take() {
            match m {
                WMsg::Data(chunks) => {
                    for c in chunks {
                        if let Err(e) = w.write_all(&c).await {
                            shared.close(format!("write failed: {e}"));
                            break 'outer;
                        }
                    }
                }
                WMsg::Flush(tx) => flushed.push(tx),
                WMsg::Shutdown => {
                    shutdown = true;
                    break;
                }
            }
            msg = rx.try_recv().ok();
        }
        if let Err(e) = w.flush().await {
            shared.close(format!("write failed: {e}"));
            break;
        }
        for tx in flushed.drain(..) {
            let _ = tx.send(());
        }
        if shutdown {
            break;
        }
    }
    let _ = w.shutdown().await;
}

async fn reader_task(
    mut rd: OwnedReadHalf,
    mut dec: PduDecoder,
    mut buf: Vec<u8>,
    shared: Arc<Shared>,
) {
    let reason = loop {
        // Decode everything buffered.
        let mut start = 0usize;
        let failure = loop {
            match dec.decode(&buf[start..]) {
                Ok(Some((pdu, used))) => {
                    if let Err(e) = shared.handle(pdu) {
                        break Some((e, start));
                    }
                    start += used;
                }
                Ok(None) => break None,
                Err(PduError::DataDigest {
                    cccid, consumed, ..
                }) => {
                    if let Some(p) = lock(&shared.pending).get_mut(&cccid) {
                        p.error = Some(HostError::DataDigest);
                    }
                    // A C2HData with SUCCESS completes the command by itself.
                    let success = buf
                        .get(start + 1)
                        .is_some_and(|f| f & pdu::flags::SUCCESS != 0);
                    if success {
                        let _ = shared.complete(cccid, Completion::success(cccid), true);
                    }
                    start += consumed;
                }
                Err(e) => break Some((HostError::Pdu(e), start)),
            }
        };
        if let Some((e, at)) = failure {
            // Tell the controller why, unless it is the one terminating.
            let info = match &e {
                HostError::Pdu(pe) => pe.term_req_info(),
                HostError::Terminated { .. } => None,
                _ => Some((pdu::Fes::InvalidHeaderField, 0)),
            };
            if let Some((fes, fei)) = info {
                let hdr_len = buf.len().saturating_sub(at).min(pdu::TERM_REQ_MAX_DATA);
                let mut out = Vec::new();
                encode_h2c_term_req(&mut out, fes, fei, &buf[at..at + hdr_len]);
                let _ = shared.tx.send(WMsg::Data(vec![Bytes::from(out)]));
            }
            break e.to_string();
        }
        buf.drain(..start);
        let want = match dec.needed(&buf) {
            Ok(n) => n,
            Err(e) => break e.to_string(),
        };
        buf.reserve(want.saturating_sub(buf.len()).max(16 * 1024));
        match rd.read_buf(&mut buf).await {
            Ok(0) => break "connection closed by the controller".to_string(),
            Ok(_) => {}
            Err(e) => break format!("read failed: {e}"),
        }
    };
    shared.close(reason);
}
