//! One NVMe/RDMA queue pair (one NVMe queue) on a tokio task.
//!
//! Everything protocol-shaped happens in [`crate::core::Queue`]; this file moves capsules and
//! data. Receives are posted before the connection is accepted, one per host submission queue
//! entry, each `64 + IN_CAPSULE_DATA_SIZE` bytes; a receive is re-posted as soon as its
//! command (and in-capsule data) has been copied out.
//!
//! Data buffers are registered memory from the device's [`BufferPool`]: a keyed SGL command
//! first gets a buffer of its length (waiting if the pool is exhausted), then a write's data is
//! RDMA READ into it and handed to the core, and a read's buffer is stashed for the core, which
//! takes it for the device op, so the device's data lands in the registered buffer the RDMA
//! WRITE sends from (no copy). The response goes as an unsignaled RDMA WRITE chained with a
//! signaled SEND of the CQE (inline), with Invalidate when the host's SGL asked for it; the
//! buffer returns to the pool with the SEND's completion.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rbd_backend::{IoBuf, IoCompletion, IoDone};
use rdma_transport::{
    BufferPool, CmEventKind, CmId, CompletionChannel, CompletionQueue, Lent, Remote, WcOpcode,
    WorkCompletion,
};
use tokio::sync::{mpsc, watch};
use tracing::Instrument;

use super::close::{CloseSequence, CloseStep, Observed};
use super::{rdma_caps, stats, Device, RECV_LEN};
use crate::core::cid_map::CidMap;
use crate::core::command::SQE_LEN;
use crate::core::{
    Action, BufferSource, Command, Completion, Queue, Status, Target, TransportType,
};
use crate::signals::QueueSignals;
use crate::spec::{sc, sgl};

/// Completions handled per wake-up before yielding to other tasks.
const POLL_BUDGET: usize = 256;
/// How long a closing connection waits for its device I/O before abandoning the buffers.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// How often a closing connection polls its CQ for the completions of the sends it posted
/// (they take microseconds on hardware, about a millisecond with Soft-RoCE).
const CLOSE_POLL_INTERVAL: Duration = Duration::from_millis(1);
/// Transient Transport Error: the host retries the command (NVMe Base, generic status 22h).
const TRANSIENT_TRANSPORT_ERROR: u16 = 0x22;

const TAG_SHIFT: u32 = 56;
const TAG_RECV: u64 = 1;
const TAG_READ: u64 = 2;
const TAG_SEND: u64 = 3;

fn tag(kind: u64, value: u64) -> u64 {
    (kind << TAG_SHIFT) | value
}

/// The core's buffers: registered memory from the pool. A buffer reserved for the command
/// about to run (`stash`) is handed out first, so a read's device data lands in it.
struct PoolSource {
    pool: Arc<BufferPool>,
    stash: Arc<Mutex<Option<Vec<u8>>>>,
}

impl BufferSource for PoolSource {
    fn take(&mut self, len: usize) -> IoBuf {
        let stashed = self.stash.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(mut v) = stashed {
            if v.capacity() >= len {
                v.resize(len, 0);
                return IoBuf::from_vec(v);
            }
            let _ = self.pool.give_back(v);
        }
        match self.pool.take(len) {
            Some((v, _)) => IoBuf::from_vec(v),
            None => {
                stats().unregistered_buffers.fetch_add(1, Ordering::Relaxed);
                IoBuf::zeroed(len)
            }
        }
    }

    fn give_back(&mut self, buf: IoBuf) {
        // Plain memory (not the pool's) is simply freed.
        let _ = self.pool.give_back(buf.into_vec());
    }
}

/// Where a command's data is on the host, from its keyed SGL.
#[derive(Debug, Clone, Copy)]
struct HostData {
    remote: Remote,
    len: usize,
    invalidate: bool,
    host_to_controller: bool,
}

enum Flow {
    Continue,
    Close,
}

/// What the listener tells a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnEvent {
    /// An `rdma_cm` event on the connection's ID.
    Cm(CmEventKind),
    /// An asynchronous event put the queue pair in the error state (QP fatal, access error).
    QpFatal,
    /// The device is going away: close without a disconnect exchange.
    DeviceRemoved,
}

pub struct RdmaConnection {
    id: CmId,
    peer: String,
    cq: Arc<CompletionQueue>,
    channel: Arc<CompletionChannel>,
    device: Arc<Device>,
    queue: Queue,
    signals: Arc<QueueSignals>,
    /// Completions taken from `signals`, kept to reuse its allocation.
    completed: Vec<IoDone>,
    completion_sink: Arc<dyn IoCompletion>,
    events: mpsc::UnboundedReceiver<ConnEvent>,
    stash: Arc<Mutex<Option<Vec<u8>>>>,
    recv_len: usize,
    /// Keyed SGL commands waiting for a registered buffer, in arrival order.
    backlog: VecDeque<Command>,
    /// Commands whose data is being RDMA READ.
    reading: CidMap<Command>,
    host_data: CidMap<HostData>,
    wcs: Vec<WorkCompletion>,
    actions: Vec<Action>,
    /// Ops a device finished inside `run_actions` ([`rbd_backend::BlockDevice::complete_now`]),
    /// waiting there for the queue to complete them.
    completed_inline: Vec<IoDone>,
    keep_alive: Option<tokio::time::Interval>,
    /// More completions may be waiting (the budget ran out).
    more: bool,
    disconnected: bool,
    /// `RDMA_CM_EVENT_ESTABLISHED` seen: before it the CM cannot send a disconnect request.
    established: bool,
    /// False once a post failed, a work request completed in error or the device reported
    /// the QP fatal: what was posted will not reach the host, so a close does not wait for it.
    qp_usable: bool,
    /// The listener dropped its end of `events`: no `ESTABLISHED` can come any more.
    events_closed: bool,
}

impl RdmaConnection {
    /// Wraps a queue pair whose CQ is armed and whose receives are posted.
    pub fn new(
        id: CmId,
        cq: Arc<CompletionQueue>,
        channel: Arc<CompletionChannel>,
        device: Arc<Device>,
        target: Arc<Target>,
        events: mpsc::UnboundedReceiver<ConnEvent>,
    ) -> Self {
        let peer = id
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|| "unknown".into());
        let (signals, completion_sink, notifier) = QueueSignals::new();
        let stash = Arc::new(Mutex::new(None));
        let mut queue = Queue::new(target, rdma_caps(), notifier);
        if let Some(local) = id.local_addr() {
            queue.set_local_address(TransportType::Rdma, local.ip());
        }
        queue.set_buffer_source(Box::new(PoolSource {
            pool: device.pool.clone(),
            stash: stash.clone(),
        }));
        let recv_len = RECV_LEN;
        Self {
            id,
            peer,
            cq,
            channel,
            device,
            queue,
            signals,
            completed: Vec::new(),
            completion_sink,
            events,
            stash,
            recv_len,
            backlog: VecDeque::new(),
            reading: CidMap::default(),
            host_data: CidMap::default(),
            wcs: Vec::with_capacity(64),
            actions: Vec::new(),
            completed_inline: Vec::new(),
            keep_alive: None,
            more: false,
            disconnected: false,
            established: false,
            qp_usable: true,
            events_closed: false,
        }
    }

    /// Posts `count` receives on `id`'s queue pair, before the connection is accepted. On
    /// failure the caller destroys the QP, which returns the posted buffers.
    pub fn post_receives(id: &mut CmId, device: &Device, count: u32) -> Result<(), String> {
        let recv_len = RECV_LEN;
        let qp = id.qp().ok_or("no queue pair")?;
        for i in 0..count {
            let Some((buf, lkey)) = device.recv_pool.take_for_setup(recv_len) else {
                return Err("no registered memory for the receive buffers".into());
            };
            if let Err((e, buf)) = qp.post_recv(tag(TAG_RECV, u64::from(i)), Lent { buf, lkey }) {
                device.give_back(buf);
                return Err(format!("post_recv: {e}"));
            }
        }
        Ok(())
    }

    /// Accepts the connection (receives are posted).
    pub fn accept(
        &mut self,
        reply: &[u8],
        responder_resources: u8,
        initiator_depth: u8,
    ) -> Result<(), String> {
        self.id
            .accept(reply, responder_resources, initiator_depth)
            .map_err(|e| e.to_string())
    }

    /// Serves the queue pair until the host disconnects, a fatal error, or `shutdown`.
    pub async fn run(self, shutdown: watch::Receiver<bool>) {
        // Attached to the future rather than entered across awaits, so log lines of one queue
        // pair never carry another's span.
        let span = tracing::info_span!("nvme-rdma", peer = %self.peer, cntlid = tracing::field::Empty, qid = tracing::field::Empty);
        self.serve(shutdown, span.clone()).instrument(span).await
    }

    async fn serve(mut self, mut shutdown: watch::Receiver<bool>, span: tracing::Span) {
        let fd = match self.channel.async_fd() {
            Ok(fd) => fd,
            Err(e) => {
                tracing::error!(error = %e, "cannot register the completion channel");
                self.close().await;
                return;
            }
        };
        tracing::debug!("queue pair accepted");
        let mut span_recorded = false;
        let returned = self.device.buffers_returned.clone();
        loop {
            let waiting = !self.backlog.is_empty();
            let flow = tokio::select! {
                biased;
                _ = shutdown.changed() => Flow::Close,
                ev = self.events.recv() => match ev {
                    Some(ConnEvent::Cm(CmEventKind::Established)) => {
                        self.established = true;
                        Flow::Continue
                    }
                    Some(ConnEvent::Cm(CmEventKind::Other(_))) => Flow::Continue,
                    Some(ConnEvent::Cm(kind)) => {
                        tracing::debug!(?kind, "connection event: closing");
                        self.disconnected = true;
                        Flow::Close
                    }
                    Some(ConnEvent::QpFatal) => {
                        tracing::warn!("queue pair fatal error (asynchronous event): closing");
                        self.qp_usable = false;
                        Flow::Close
                    }
                    Some(ConnEvent::DeviceRemoved) => {
                        tracing::info!("RDMA device removed: closing");
                        self.disconnected = true;
                        Flow::Close
                    }
                    None => Flow::Close,
                },
                _ = self.signals.notify.notified() => self.on_signals(),
                _ = crate::keep_alive::tick(&mut self.keep_alive) => self.on_keep_alive_tick(),
                ready = fd.readable() => match ready {
                    Ok(mut guard) => {
                        guard.clear_ready();
                        self.on_cq_event()
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "completion channel failed");
                        Flow::Close
                    }
                },
                _ = std::future::ready(()), if self.more => {
                    tokio::task::yield_now().await;
                    self.poll_cq()
                }
                _ = returned.notified(), if waiting => self.run_backlog(),
                // (async block: select! evaluates every branch's expression each turn, and a
                // bare sleep() would read the clock even when the branch is disabled)
                _ = async { tokio::time::sleep(Duration::from_millis(5)).await }, if waiting => {
                    self.run_backlog()
                }
            };
            // Every response of this turn goes out with one post (one doorbell).
            let flow = match self.id.qp().map(|qp| qp.flush()) {
                Some(Ok(())) => flow,
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "cannot post responses: closing");
                    self.qp_usable = false;
                    Flow::Close
                }
                None => Flow::Close,
            };
            if !span_recorded {
                if let Some(b) = self.queue.binding() {
                    span.record("cntlid", b.controller.cntlid);
                    span.record("qid", b.qid);
                    span_recorded = true;
                }
            }
            if let Flow::Close = flow {
                break;
            }
        }
        drop(fd);
        self.close().await;
    }

    /// Takes the channel's event, re-arms the CQ and polls (completions that arrive between
    /// the poll and the re-arm are caught by polling after arming). Per wake-up: one `read`
    /// of the channel and one re-arm, for however many completions the poll finds.
    fn on_cq_event(&mut self) -> Flow {
        if let Err(e) = self.cq.take_event() {
            tracing::warn!(error = %e, "completion channel");
            return Flow::Close;
        }
        if let Err(e) = self.cq.arm() {
            tracing::warn!(error = %e, "cannot arm the completion queue");
            return Flow::Close;
        }
        self.poll_cq()
    }

    fn poll_cq(&mut self) -> Flow {
        self.more = false;
        let mut done = 0;
        while done < POLL_BUDGET {
            let mut wcs = std::mem::take(&mut self.wcs);
            wcs.clear();
            let n = match self.cq.poll(&mut wcs, 64) {
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!(error = %e, "poll_cq failed");
                    return Flow::Close;
                }
            };
            let mut flow = Flow::Continue;
            for wc in wcs.drain(..) {
                if let Flow::Close = self.on_completion(wc) {
                    flow = Flow::Close;
                }
            }
            self.wcs = wcs;
            if let Flow::Close = flow {
                return Flow::Close;
            }
            done += n;
            if n < 64 {
                return self.drain_completions();
            }
        }
        self.more = true;
        self.drain_completions()
    }

    fn on_completion(&mut self, wc: WorkCompletion) -> Flow {
        if let Some(srq) = self.device.srq.clone() {
            if let Some((_, buf)) = srq.reap(&wc) {
                if !wc.is_ok() {
                    // A flushed receive's buffer is intact: it serves the other queues.
                    self.device.repost_shared(buf);
                    self.wc_error(&wc);
                    return Flow::Close;
                }
                return self.on_recv(None, buf, wc.byte_len as usize);
            }
        }
        let Some(qp) = self.id.qp() else {
            return Flow::Close;
        };
        let Some((tag, buf)) = qp.reap(&wc) else {
            // The unsignaled RDMA WRITE of a response only completes with an error.
            if !wc.is_ok() {
                self.wc_error(&wc);
            }
            return Flow::Close;
        };
        if !wc.is_ok() {
            if let Some(b) = buf {
                self.device.give_back(b);
            }
            self.wc_error(&wc);
            return Flow::Close;
        }
        let value = tag & ((1 << TAG_SHIFT) - 1);
        match (tag >> TAG_SHIFT, wc.opcode, buf) {
            (TAG_RECV, WcOpcode::Recv, Some(buf)) => {
                self.on_recv(Some(value), buf, wc.byte_len as usize)
            }
            (TAG_READ, WcOpcode::RdmaRead, Some(buf)) => {
                let cid = value as u16;
                match self.reading.remove(&cid) {
                    Some(cmd) => self.execute(cmd, Some(IoBuf::from_vec(buf))),
                    None => {
                        self.device.give_back(buf);
                        Flow::Continue
                    }
                }
            }
            (TAG_SEND, WcOpcode::Send, buf) => {
                if let Some(b) = buf {
                    self.queue.recycle(IoBuf::from_vec(b));
                }
                Flow::Continue
            }
            (_, opcode, buf) => {
                tracing::warn!(tag, ?opcode, "unexpected work completion");
                if let Some(b) = buf {
                    self.device.give_back(b);
                }
                Flow::Close
            }
        }
    }

    fn wc_error(&mut self, wc: &WorkCompletion) {
        self.qp_usable = false;
        if wc.is_flush() {
            tracing::debug!("work request flushed: the queue pair is down");
        } else {
            stats().wc_errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(status = %wc.status_str(), opcode = ?wc.opcode, "work completion error: closing");
        }
    }

    /// A command capsule arrived in receive buffer `slot` of this QP's own receive queue, or
    /// (`None`) in a buffer of the device's shared receive queue.
    fn on_recv(&mut self, slot: Option<u64>, buf: Vec<u8>, len: usize) -> Flow {
        let flow = if len < SQE_LEN || len > buf.len() {
            tracing::warn!(len, "capsule shorter than a command: closing");
            Flow::Close
        } else {
            let mut sqe = [0u8; SQE_LEN];
            sqe.copy_from_slice(&buf[..SQE_LEN]);
            self.on_capsule(Command::from_bytes(&sqe), &buf[SQE_LEN..len])
        };
        // Re-post the receive now that the capsule is copied out.
        let Some(slot) = slot else {
            self.device.repost_shared(buf);
            return flow;
        };
        let lkey = self.device.recv_pool.lkey(&buf);
        let mut buf = buf;
        buf.resize(self.recv_len, 0);
        match (self.id.qp(), lkey) {
            (Some(qp), Some(lkey)) => {
                if let Err((e, b)) = qp.post_recv(tag(TAG_RECV, slot), Lent { buf, lkey }) {
                    tracing::warn!(error = %e, "cannot re-post a receive");
                    self.device.give_back(b);
                    return Flow::Close;
                }
            }
            _ => {
                self.device.give_back(buf);
                return Flow::Close;
            }
        }
        flow
    }

    fn on_capsule(&mut self, cmd: Command, in_capsule: &[u8]) -> Flow {
        stats().commands.fetch_add(1, Ordering::Relaxed);
        if let Err(completion) = self.queue.check_data_len(&cmd) {
            return self.send_response(completion, None);
        }
        let len = cmd.data_len() as usize;
        if len == 0 {
            return self.execute(cmd, None);
        }
        let d = cmd.sgl();
        if cmd.is_host_to_controller() && d.is_in_capsule() {
            let off = usize::try_from(d.address).unwrap_or(usize::MAX);
            if off
                .checked_add(len)
                .is_none_or(|end| end > in_capsule.len())
            {
                return self.respond_error(cmd.cid(), Status::error(sc::SGL_INVALID_OFFSET));
            }
            let mut buf = self.queue.take_buffer(len);
            buf.as_mut_slice()
                .copy_from_slice(&in_capsule[off..off + len]);
            return self.execute(cmd, Some(buf));
        }
        if d.desc_type != sgl::KEYED_DATA_DESC
            || (d.subtype != sgl::FMT_ADDRESS && d.subtype != sgl::FMT_INVALIDATE)
        {
            return self.respond_error(cmd.cid(), Status::error(sc::SGL_INVALID_TYPE));
        }
        if self.host_data.contains_key(&cmd.cid()) || self.reading.contains_key(&cmd.cid()) {
            return self.respond_error(cmd.cid(), Status::error(sc::CMDID_CONFLICT));
        }
        self.host_data.insert(
            cmd.cid(),
            HostData {
                remote: Remote {
                    addr: d.address,
                    rkey: d.key,
                },
                len,
                invalidate: d.subtype == sgl::FMT_INVALIDATE,
                host_to_controller: cmd.is_host_to_controller(),
            },
        );
        self.backlog.push_back(cmd);
        self.run_backlog()
    }

    /// Starts the keyed SGL commands for which a registered buffer is available, in order.
    fn run_backlog(&mut self) -> Flow {
        while let Some(cmd) = self.backlog.front() {
            let cid = cmd.cid();
            let Some(hd) = self.host_data.get(&cid).copied() else {
                self.backlog.pop_front();
                continue;
            };
            let Some((buf, lkey)) = self.device.pool.take(hd.len) else {
                stats().buffer_waits.fetch_add(1, Ordering::Relaxed);
                return Flow::Continue;
            };
            let Some(cmd) = self.backlog.pop_front() else {
                break;
            };
            if hd.host_to_controller {
                let Some(qp) = self.id.qp() else {
                    self.device.give_back(buf);
                    return Flow::Close;
                };
                match qp.post_read(tag(TAG_READ, u64::from(cid)), Lent { buf, lkey }, hd.remote) {
                    Ok(()) => {
                        stats().rdma_reads.fetch_add(1, Ordering::Relaxed);
                        self.reading.insert(cid, cmd);
                    }
                    Err((e, buf)) => {
                        tracing::warn!(error = %e, "cannot post an RDMA READ");
                        self.device.give_back(buf);
                        return Flow::Close;
                    }
                }
            } else {
                *self.stash.lock().unwrap_or_else(|e| e.into_inner()) = Some(buf);
                let flow = self.execute(cmd, None);
                let left = self.stash.lock().unwrap_or_else(|e| e.into_inner()).take();
                if let Some(buf) = left {
                    self.device.give_back(buf);
                }
                if let Flow::Close = flow {
                    return Flow::Close;
                }
            }
        }
        Flow::Continue
    }

    fn execute(&mut self, cmd: Command, data: Option<IoBuf>) -> Flow {
        let mut actions = std::mem::take(&mut self.actions);
        if cmd.is_authentication() {
            crate::blocking::cpu_heavy(|| self.queue.execute(cmd, data, &mut actions));
        } else {
            self.queue.execute(cmd, data, &mut actions);
        }
        let flow = self.run_actions(&mut actions);
        self.actions = actions;
        if self.keep_alive.is_none() {
            self.arm_keep_alive();
        }
        flow
    }

    fn run_actions(&mut self, actions: &mut Vec<Action>) -> Flow {
        let mut flow = Flow::Continue;
        while !actions.is_empty() {
            self.run_actions_once(actions, &mut flow);
            // Ops their device finished on this thread: their responses go out now.
            self.queue
                .complete_each(&mut self.completed_inline, actions);
        }
        flow
    }

    fn run_actions_once(&mut self, actions: &mut Vec<Action>, flow: &mut Flow) {
        for action in actions.drain(..) {
            match action {
                Action::Respond(resp) => {
                    if let Flow::Close = self.send_response(resp.completion, resp.data) {
                        *flow = Flow::Close;
                    }
                }
                Action::Submit { device, tag, op } => match device.complete_now(tag, op) {
                    Ok(done) => self.completed_inline.push(done),
                    Err(op) => device.submit(tag, op, &self.completion_sink),
                },
                Action::SubmitThrottled {
                    qos,
                    device,
                    tag,
                    op,
                } => crate::qos::submit(qos, device, tag, op, &self.completion_sink),
                Action::Close => *flow = Flow::Close,
            }
        }
    }

    fn respond_error(&mut self, cid: u16, status: Status) -> Flow {
        let completion = self.queue.completion(cid, status);
        self.host_data.remove(&cid);
        self.send_response(completion, None)
    }

    /// Sends the data (RDMA WRITE) if any, then the completion (SEND, with Invalidate when
    /// the host asked for it).
    fn send_response(&mut self, completion: Completion, data: Option<IoBuf>) -> Flow {
        let hd = self.host_data.remove(&completion.cid);
        let invalidate = hd.filter(|h| h.invalidate).map(|h| h.remote.rkey);
        let mut completion = completion;
        let mut payload = None;
        match (data, hd) {
            (Some(buf), Some(h)) if !buf.is_empty() && !h.host_to_controller => {
                let mut v = buf.into_vec();
                v.truncate(h.len);
                let lkey = match self.device.pool.lkey(&v) {
                    Some(k) => Some(k),
                    None => {
                        // Not registered memory: copy into a registered buffer.
                        match self.device.pool.take_copy_of(&v) {
                            Some((reg, k)) => {
                                stats()
                                    .payload_copies
                                    .fetch_add(v.len() as u64, Ordering::Relaxed);
                                self.queue.recycle(IoBuf::from_vec(v));
                                v = reg;
                                Some(k)
                            }
                            None => None,
                        }
                    }
                };
                match lkey {
                    Some(lkey) => {
                        stats().rdma_writes.fetch_add(1, Ordering::Relaxed);
                        payload = Some((Lent { buf: v, lkey }, h.remote));
                    }
                    None => {
                        self.queue.recycle(IoBuf::from_vec(v));
                        completion.status = Status::retryable(TRANSIENT_TRANSPORT_ERROR);
                    }
                }
            }
            (Some(buf), _) => self.queue.recycle(buf),
            (None, _) => {}
        }
        if invalidate.is_some() {
            stats().send_with_invalidate.fetch_add(1, Ordering::Relaxed);
        }
        let cqe = completion.to_bytes();
        let Some(qp) = self.id.qp() else {
            return Flow::Close;
        };
        match qp.stage_write_send(
            tag(TAG_SEND, u64::from(completion.cid)),
            payload,
            &cqe,
            invalidate,
        ) {
            Ok(()) => Flow::Continue,
            Err((e, buf)) => {
                tracing::warn!(error = %e, "cannot post a response: closing");
                if let Some(b) = buf {
                    self.queue.recycle(IoBuf::from_vec(b));
                }
                Flow::Close
            }
        }
    }

    fn drain_completions(&mut self) -> Flow {
        let mut flow = Flow::Continue;
        loop {
            let mut done = std::mem::take(&mut self.completed);
            self.signals.take_completed(&mut done);
            if done.is_empty() {
                self.completed = done;
                break;
            }
            let mut actions = std::mem::take(&mut self.actions);
            for d in done.drain(..) {
                self.queue.complete_io(d, &mut actions);
            }
            self.completed = done;
            if let Flow::Close = self.run_actions(&mut actions) {
                flow = Flow::Close;
            }
            self.actions = actions;
        }
        flow
    }

    fn on_signals(&mut self) -> Flow {
        let mut actions = std::mem::take(&mut self.actions);
        self.queue.poll_events(&mut actions);
        let mut flow = self.run_actions(&mut actions);
        self.actions = actions;
        if let Flow::Close = self.drain_completions() {
            flow = Flow::Close;
        }
        flow
    }

    fn arm_keep_alive(&mut self) {
        self.keep_alive = crate::keep_alive::admin_queue_timer(&self.queue);
    }

    fn on_keep_alive_tick(&mut self) -> Flow {
        if crate::keep_alive::still_alive(&self.queue) {
            Flow::Continue
        } else {
            Flow::Close
        }
    }

    /// Releases everything: the controller association, the device I/O still running (its
    /// buffers come back through the completions), the queue pair (its posted buffers come
    /// back once it is destroyed), the pool buffers.
    async fn close(&mut self) {
        self.queue.close();
        self.disconnect_after_posted_sends().await;
        // Wait for the device to finish what it started: its buffers belong to the pool.
        let deadline = tokio::time::Instant::now() + DRAIN_TIMEOUT;
        while self.queue.in_flight() > 0 && tokio::time::Instant::now() < deadline {
            let mut done = Vec::new();
            self.signals.take_completed(&mut done);
            if done.is_empty() {
                let _ = tokio::time::timeout(
                    Duration::from_millis(100),
                    self.signals.notify.notified(),
                )
                .await;
                continue;
            }
            let mut actions = Vec::new();
            for d in done {
                self.queue.complete_io(d, &mut actions);
            }
            for a in actions {
                if let Action::Respond(resp) = a {
                    self.host_data.remove(&resp.completion.cid);
                    if let Some(buf) = resp.data {
                        self.queue.recycle(buf);
                    }
                }
            }
        }
        if self.queue.in_flight() > 0 {
            stats()
                .abandoned_buffers
                .fetch_add(self.queue.in_flight() as u64, Ordering::Relaxed);
            tracing::warn!(
                in_flight = self.queue.in_flight(),
                "device I/O still running after the connection closed: its buffers are abandoned"
            );
        }
        // The adapter stops touching posted buffers once the QP is destroyed.
        for (_, buf) in self.id.destroy_qp() {
            self.device.give_back(buf);
        }
        // Shared receives this QP consumed and whose completions were not polled yet are
        // only known from its CQ: reap them, or their buffers would stay counted as posted.
        self.drain_destroyed_cq();
        let topped_up = self.device.replenish_srq();
        if topped_up > 0 {
            tracing::debug!(topped_up, "shared receive queue topped up");
        }
        if let Some(buf) = self.stash.lock().unwrap_or_else(|e| e.into_inner()).take() {
            self.device.give_back(buf);
        }
        self.backlog.clear();
        self.reading.clear();
        self.host_data.clear();
        stats().live_qps.fetch_sub(1, Ordering::Relaxed);
        tracing::info!(
            rdma = %stats().summary(),
            pool = %super::pool_summary(&self.device.pool),
            recv = %super::recv_summary(&self.device),
            "queue pair closed"
        );
    }
}

impl RdmaConnection {
    /// Disconnects (unless the host or the device did already) once the sends already posted
    /// have completed, so a response the core asked for just before the close (an
    /// authentication Failure2's, a failed Connect's) is not flushed by the disconnect; and
    /// not before `ESTABLISHED`. Both waits are bounded ([`super::close`]).
    async fn disconnect_after_posted_sends(&mut self) {
        let sequence = CloseSequence::new(tokio::time::Instant::now());
        loop {
            self.take_pending_events();
            let observed = Observed {
                // (no event can come once the listener dropped its end: waiting is pointless)
                established: self.established || self.events_closed,
                disconnected: self.disconnected,
                qp_usable: self.qp_usable,
                sends_in_flight: self.id.qp().map_or(0, |qp| qp.sends_in_flight()),
                now: tokio::time::Instant::now(),
            };
            match sequence.next(&observed) {
                CloseStep::WaitSends(deadline) => {
                    if self.reap_while_closing() == 0 {
                        let wake = (observed.now + CLOSE_POLL_INTERVAL).min(deadline);
                        tokio::time::sleep_until(wake).await;
                    }
                }
                CloseStep::WaitEstablished(deadline) => self.wait_established(deadline).await,
                CloseStep::Disconnect { unconfirmed } => {
                    if unconfirmed > 0 {
                        tracing::warn!(
                            unconfirmed,
                            timeout = ?super::close::SEND_DRAIN_TIMEOUT,
                            "sends still not completed when closing: the host may miss their responses"
                        );
                    }
                    if let Err(e) = self.id.disconnect() {
                        tracing::debug!(error = %e, "rdma_disconnect");
                    }
                    return;
                }
                CloseStep::Teardown => return,
            }
        }
    }

    /// Applies the connection events already queued (without waiting).
    fn take_pending_events(&mut self) {
        loop {
            match self.events.try_recv() {
                Ok(ev) => {
                    self.on_closing_event(ev);
                }
                Err(mpsc::error::TryRecvError::Empty) => return,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    self.events_closed = true;
                    return;
                }
            }
        }
    }

    /// A connection event while closing: true when it ends a wait for `ESTABLISHED`.
    fn on_closing_event(&mut self, ev: ConnEvent) -> bool {
        match ev {
            ConnEvent::Cm(CmEventKind::Established) => {
                self.established = true;
                true
            }
            ConnEvent::Cm(CmEventKind::Other(_)) => false,
            ConnEvent::QpFatal => {
                self.qp_usable = false;
                false
            }
            ConnEvent::Cm(_) | ConnEvent::DeviceRemoved => {
                self.disconnected = true;
                true
            }
        }
    }

    /// While closing: reaps the completions on the CQ without serving them (a capsule that
    /// arrives now is dropped, its receive re-posted or returned; a READ's command is not
    /// run) and returns the buffers. Returns the number of completions reaped.
    fn reap_while_closing(&mut self) -> usize {
        let mut wcs = std::mem::take(&mut self.wcs);
        let mut reaped = 0;
        loop {
            wcs.clear();
            match self.cq.poll(&mut wcs, 64) {
                Ok(0) => break,
                Ok(n) => reaped += n,
                Err(e) => {
                    tracing::debug!(error = %e, "poll_cq while closing");
                    self.qp_usable = false;
                    break;
                }
            }
            for wc in wcs.drain(..) {
                if !wc.is_ok() && !wc.is_flush() {
                    self.wc_error(&wc);
                }
                if let Some(srq) = self.device.srq.clone() {
                    if let Some((_, buf)) = srq.reap(&wc) {
                        self.device.repost_shared(buf);
                        continue;
                    }
                }
                let Some(qp) = self.id.qp() else { continue };
                let Some((tag, buf)) = qp.reap(&wc) else {
                    continue;
                };
                if tag >> TAG_SHIFT == TAG_READ {
                    self.reading
                        .remove(&((tag & ((1 << TAG_SHIFT) - 1)) as u16));
                }
                if let Some(b) = buf {
                    if tag >> TAG_SHIFT == TAG_SEND {
                        self.queue.recycle(IoBuf::from_vec(b));
                    } else {
                        self.device.give_back(b);
                    }
                }
            }
        }
        self.wcs = wcs;
        reaped
    }

    /// Waits until `deadline` for `RDMA_CM_EVENT_ESTABLISHED` (any other event that ends
    /// the connection ends the wait: it is gone anyway).
    async fn wait_established(&mut self, deadline: tokio::time::Instant) {
        loop {
            match tokio::time::timeout_at(deadline, self.events.recv()).await {
                Ok(Some(ev)) => {
                    if self.on_closing_event(ev) {
                        return;
                    }
                }
                Ok(None) => {
                    self.events_closed = true;
                    return;
                }
                Err(_elapsed) => return,
            }
        }
    }

    /// After the QP is destroyed: polls its CQ empty, returning shared receives to the SRQ.
    fn drain_destroyed_cq(&mut self) {
        let Some(srq) = self.device.srq.clone() else {
            return;
        };
        let mut wcs = Vec::with_capacity(64);
        loop {
            wcs.clear();
            match self.cq.poll(&mut wcs, 64) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            for wc in &wcs {
                if let Some((_, buf)) = srq.reap(wc) {
                    self.device.repost_shared(buf);
                }
            }
        }
    }
}
