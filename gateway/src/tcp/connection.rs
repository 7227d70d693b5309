//! One NVMe/TCP connection (one NVMe queue) on a tokio task.
//!
//! Everything protocol-shaped happens in [`crate::core::Queue`] and the PDU codec; this file
//! only moves bytes. Per loop turn it reads what the socket has, decodes every complete PDU,
//! runs the resulting actions, drains device completions that arrived meanwhile, and writes
//! all responses with one vectored write, so a burst of commands costs one read and one
//! write system call. A device that can finish an op without waiting (the in-memory one)
//! does so inside `run_actions` ([`rbd_backend::BlockDevice::complete_now`]), whose
//! completion then runs at once, with no hand-over through the completion sink.
//!
//! Device completions take a shorter way when they can. A librbd completion arrives on a
//! librbd callback thread; handing it to the task costs a cross-thread wake-up (futex, a
//! context switch, the runtime's scheduling) before the response is even encoded, which on
//! a loaded 2-core machine was the largest part of the latency the gateway adds at QD1. So
//! the completing thread takes the connection's state lock itself when it is free
//! (`try_lock`, never waiting), runs the core's `complete_io`, encodes the response and
//! writes it with a non-blocking send. Only when the task holds the lock (it is working and
//! will drain the completion list before it sleeps), when the socket cannot take all the
//! bytes, or while the connection drains or closes, does the completion go through the list
//! and the task's `Notify` as before. Responses keep their order: all output goes through one
//! queue under the same lock, and a command's response is only encoded once its device op
//! has completed.
//!
//! Data buffers count against the gateway-wide data budget ([`crate::core::budget`]). A
//! command whose buffer the budget does not admit is held in `State::held`, with no
//! buffer, no R2T and no device op, and the commands after it wait behind it; H2CData for
//! writes already asked for goes on, so their buffers come free. The next release anywhere
//! wakes the connection through its `Notify`, and every completion of its own checks again.
//!
//! Busy polling (`[gateway] tcp_busy_poll_us`, adaptive by default) takes away the other wake-up
//! on the path: the task's own, when the host's next command arrives. For that long after a
//! command came in, the task does not sleep in epoll but keeps asking the socket, on a
//! duplicate of its descriptor and without the state lock, so completing threads never wait
//! for it; adaptive polling measures whether that pays on this machine (see [`super::busy_poll`]).
//! A completing thread that answered the last commands at the device asks the task for a
//! window too, and wakes it: the wake-up then overlaps the host's turn-around instead of
//! following the host's next command (`Shared::ask_window`).

use std::cell::Cell;
use std::collections::VecDeque;
use std::io::IoSlice;
use std::os::fd::{AsFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use rbd_backend::{IoBuf, IoCompletion, IoDone};
use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{watch, Notify};
use tracing::Instrument;

use super::busy_poll::{self, poll_socket, BusyPollConfig, Chooser, Decision, Mode, Polled};
use super::pdu::{
    encode_c2h_term_req, encode_icresp, DecoderConfig, Fes, IcResp, Pdu, PduDecoder, PduEncoder,
    PduError, PduType, Role, PFV_1_0,
};
use crate::core::cid_map::CidMap;
use crate::core::command::SQE_LEN;
use crate::core::{
    Action, Command, Completion, DataBudget, Queue, QueueNotifier, RecycledBuffers, Status, Target,
    TransportCaps, TransportType,
};
use crate::spec::sc;

/// Bytes of data a command capsule may carry on I/O and admin queues.
pub const IN_CAPSULE_DATA_SIZE: u32 = 8192;
/// Largest H2CData payload we accept: one PDU per write up to MDTS.
pub const MAX_H2C_DATA: u32 = crate::core::queue::MAX_DATA_LEN;
/// How long a queue goes without a command before it gives back what its last burst grew
/// (see `State::on_idle_tick`). Long enough that a host pausing between commands does not
/// make each one reallocate: giving the receive buffer back whenever nothing was in flight
/// made 1 MiB writes at QD1 2-3x slower (regrowing it faults its pages in again).
const IDLE_RELEASE_PERIOD: Duration = Duration::from_secs(1);
/// Slices of one vectored write at most (the kernel's limit, UIO_MAXIOV, is 1024).
const MAX_SLICES: usize = 64;
/// Queued output segments up to which a write is prepared in a small array.
const FEW_SEGMENTS: usize = 4;
/// Transient Transport Error: the host retries the command (NVMe Base, generic status 22h).
const TRANSIENT_TRANSPORT_ERROR: u16 = 0x22;
const READ_CHUNK: usize = 256 * 1024;
/// Counts and logs what adaptive busy polling decided at the end of an epoch.
fn count_decision(decision: &Decision) {
    let stats = super::stats();
    let counter = match decision.chosen {
        Mode::Poll => &stats.busy_poll_chose_poll,
        Mode::Sleep => &stats.busy_poll_chose_sleep,
    };
    counter.fetch_add(1, Ordering::Relaxed);
    if decision.switched {
        tracing::debug!(
            chosen = ?decision.chosen,
            poll_median_us = decision.poll_median.as_micros() as u64,
            sleep_median_us = decision.sleep_median.as_micros() as u64,
            "busy polling: mode changed"
        );
    }
}

/// Says at most every 10 s, gateway-wide, that commands wait for the data budget: a stalled
/// cluster or a budget too small for the load, which an admin should hear of without a
/// line per command.
fn warn_budget_spent(budget: &DataBudget) {
    static LAST: Mutex<Option<Instant>> = Mutex::new(None);
    let mut last = LAST.lock().unwrap_or_else(|e| e.into_inner());
    let now = Instant::now();
    if last.is_some_and(|at| now.duration_since(at) < Duration::from_secs(10)) {
        return;
    }
    *last = Some(now);
    let (waiting, _) = budget.held();
    tracing::warn!(
        budget_bytes = budget.limit(),
        in_use_bytes = budget.in_use(),
        waiting,
        "NVMe/TCP data budget spent: commands wait for buffers (is the cluster slow? else raise [gateway] tcp_data_budget)"
    );
}

/// Transport capabilities reported to controllers created over TCP.
pub fn tcp_caps() -> TransportCaps {
    TransportCaps {
        in_capsule_data_size: IN_CAPSULE_DATA_SIZE,
        keyed_sgls: false,
    }
}

/// A write command waiting for its data through R2T / H2CData.
struct PendingWrite {
    cmd: Command,
    buf: IoBuf,
    received: usize,
}

/// Output waiting to be written: PDU headers live in `headers`, payloads stay in their
/// buffers and go out by vectored write.
enum Segment {
    Header { start: usize, end: usize },
    Data { buf: IoBuf, digest: Option<[u8; 4]> },
}

#[derive(Default)]
struct Output {
    headers: Vec<u8>,
    segments: VecDeque<Segment>,
    /// Bytes of the front segment already written.
    front_written: usize,
}

impl Output {
    fn push_header(&mut self, encode: impl FnOnce(&mut Vec<u8>)) {
        let start = self.headers.len();
        encode(&mut self.headers);
        let end = self.headers.len();
        match self.segments.back_mut() {
            // Adjacent header bytes merge into one slice.
            Some(Segment::Header { end: e, .. }) if *e == start => *e = end,
            _ => self.segments.push_back(Segment::Header { start, end }),
        }
    }

    fn is_empty(&self) -> bool {
        self.segments.is_empty()
    }
}

enum Flow {
    Continue,
    Close,
}

/// What the connection task and the threads completing device ops share.
struct Shared {
    /// The socket's sending side; dropping it (with the last `Shared`) sends FIN.
    writer: OwnedWriteHalf,
    state: Mutex<State>,
    /// Completions that found `state` locked (by the task, or by another completing
    /// thread), or arrived while the connection drains or closes: the task takes them.
    completed: Mutex<Vec<IoDone>>,
    /// Woken for completions left in `completed`, output the socket did not take, a close
    /// asked for by a completion, a polling window asked for (below), and every controller
    /// notice.
    notify: Notify,
    /// The queue polls now (busy polling on, and the adaptive choice, or the epoch being
    /// measured, is to poll): set by the task, read by completing threads.
    polling_chosen: AtomicBool,
    /// A completion left the queue at low depth while polling is chosen: the host's next
    /// command is near, so the task opens a polling window when it wakes (see
    /// [`Shared::complete`]).
    window_asked: AtomicBool,
    span: tracing::Span,
}

/// The protocol state of one connection: the core's queue, the codec and the output.
struct State {
    queue: Queue,
    /// Completions taken from `Shared::completed`, kept to reuse its allocation.
    completed: Vec<IoDone>,
    /// Ops a device finished inside `run_actions` (see the module docs), waiting there for
    /// the queue to complete them.
    completed_inline: Vec<IoDone>,
    completion_sink: Arc<dyn IoCompletion>,
    decoder: PduDecoder,
    encoder: PduEncoder,
    /// Received bytes: `rx[rx_start..rx_end]` waits to be decoded; the rest is room to read
    /// into (kept initialized, so reading needs no unsafe code).
    rx: Vec<u8>,
    rx_start: usize,
    rx_end: usize,
    out: Output,
    actions: Vec<Action>,
    pending_writes: CidMap<PendingWrite>,
    /// What this connection's data buffers count against.
    budget: &'static DataBudget,
    /// Commands that wait for the budget to admit their data buffer, in arrival order (with
    /// their in-capsule data, if any). Commands behind one wait too, so they run in order.
    held: VecDeque<(Command, Option<IoBuf>)>,
    next_ttag: u16,
    /// A completion handled on a device thread asked to close the connection, or its write
    /// failed: the task closes at its next turn.
    close_requested: bool,
    /// Completions go through the task only: it drains for shutdown or has closed the queue.
    task_only: bool,
    /// Command capsules received (adaptive busy polling measures the time between them).
    commands_received: u64,
    /// `commands_received` at the last idle check.
    commands_at_idle_tick: u64,
    /// When the last completion that came after its command's read (from a device's
    /// thread, or handed to the task) was answered: adaptive busy polling tells the host's
    /// pauses from long device ops by it ([`busy_poll::Chooser::on_commands`]).
    responded_at: Option<Instant>,
}

/// The completion sink devices call. Weak: a device holding it after the connection ended
/// keeps nothing of the connection alive, and late completions are dropped with their buffers.
struct CompletionSink {
    shared: Weak<Shared>,
}

thread_local! {
    /// The completion sink of the connection whose state this thread holds locked while it
    /// submits a device op (null: none). See [`SubmitScope`].
    static SUBMITTING: Cell<*const ()> = const { Cell::new(std::ptr::null()) };
}

/// Marks, for the length of one `BlockDevice::submit`, that this thread holds the state of
/// the connection owning `sink` and drains its completion list before it lets go (every
/// path that submits ends in `State::drain_completions`, or closes the connection, which
/// drops what the list holds as it did before). A device that completes inside `submit`
/// (the in-memory one behind a QoS limit) then leaves its completion in that list without
/// waking the task:
/// the wake-up would only cost the task one more loop turn after the response had gone.
struct SubmitScope {
    previous: *const (),
}

impl SubmitScope {
    fn enter(sink: &Arc<dyn IoCompletion>) -> Self {
        let ours = Arc::as_ptr(sink) as *const ();
        Self {
            previous: SUBMITTING.with(|s| s.replace(ours)),
        }
    }
}

impl Drop for SubmitScope {
    fn drop(&mut self) {
        SUBMITTING.with(|s| s.set(self.previous));
    }
}

impl IoCompletion for CompletionSink {
    fn complete(&self, done: IoDone) {
        let Some(shared) = self.shared.upgrade() else {
            return;
        };
        let ours = self as *const Self as *const ();
        if SUBMITTING.with(|s| std::ptr::eq(s.get(), ours)) {
            // Completed inside our own submit: the submitting thread drains it.
            shared
                .completed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(done);
            return;
        }
        shared.complete(done);
    }
}

impl QueueNotifier for Shared {
    fn wake(&self) {
        self.notify.notify_one();
    }
}

impl Shared {
    /// The task's access to the state (it may wait for a completing thread's short turn).
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A device op finished (any thread). Handles it here when the state is free, otherwise
    /// leaves it to the task. See the module docs.
    fn complete(&self, done: IoDone) {
        let state = match self.state.try_lock() {
            Ok(guard) => Some(guard),
            Err(TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        };
        let done = match state {
            Some(mut state) if !state.task_only => {
                let _entered = self.span.enter();
                let mut flow = state.complete_one(done);
                if let Flow::Close = state.drain_completions(self) {
                    flow = Flow::Close;
                }
                let wake_task = match state.try_flush(&self.writer) {
                    Ok(all_written) => !all_written,
                    Err(e) => {
                        tracing::debug!(error = %e, "write failed");
                        flow = Flow::Close;
                        true
                    }
                };
                if let Flow::Close = flow {
                    state.close_requested = true;
                }
                let window = self.ask_window(&state);
                drop(state);
                if wake_task || window || matches!(flow, Flow::Close) {
                    self.notify.notify_one();
                }
                return;
            }
            _ => done,
        };
        self.completed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(done);
        // The task completes it; once that leaves the queue at low depth, the host's next
        // command is near just the same.
        if self.polling_chosen.load(Ordering::Relaxed) {
            self.window_asked.store(true, Ordering::Relaxed);
        }
        self.notify.notify_one();
    }

    /// Asks the task for a polling window after a completion this thread answered, if the
    /// queue polls and is now at low depth: returns whether it did (the task is to be woken).
    ///
    /// Why: a window opens when the host's bytes come in. A device op that outlasts it (an
    /// RBD op, 100 µs to ms) completes with the task asleep in epoll, so the host's next
    /// command, sent as soon as it has the response, waits for the task's wake-up. Woken
    /// now, the task wakes while the host turns around, and polls for that command.
    fn ask_window(&self, state: &State) -> bool {
        let ask = self.polling_chosen.load(Ordering::Relaxed)
            && state.at_low_depth()
            && state.out.is_empty();
        if ask {
            self.window_asked.store(true, Ordering::Relaxed);
        }
        ask
    }

    /// Reads what the socket has into the state's receive buffer: the number of bytes, 0 when
    /// the host closed. Through `AsyncRead`, which takes a short read as the socket being
    /// drained, so the next wait costs no extra `recv` that would only say EAGAIN.
    fn poll_read(
        &self,
        reader: &mut OwnedReadHalf,
        cx: &mut Context<'_>,
    ) -> Poll<std::io::Result<usize>> {
        let mut state = self.lock();
        let end = state.make_read_room();
        let mut buf = ReadBuf::new(&mut state.rx[end..]);
        match Pin::new(reader).poll_read(cx, &mut buf) {
            Poll::Ready(Ok(())) => {
                let n = buf.filled().len();
                state.rx_end += n;
                Poll::Ready(Ok(n))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }

    /// Takes the bytes a polling probe read (`polled`, 0: the host closed) into the receive
    /// buffer and, when they filled the probe's buffer, reads on what the socket has, past
    /// the runtime's readiness tracking (busy polling saw bytes before the reactor did): the
    /// number of bytes.
    fn take_polled(&self, polled: &[u8], probe: &OwnedFd) -> std::io::Result<usize> {
        let mut state = self.lock();
        let end = state.make_read_room();
        // `make_read_room` leaves at least READ_CHUNK / 4, more than a probe reads.
        state.rx[end..end + polled.len()].copy_from_slice(polled);
        state.rx_end += polled.len();
        if polled.len() < busy_poll::PROBE_BYTES {
            return Ok(polled.len());
        }
        let end = state.make_read_room();
        loop {
            match rustix::net::recv(
                probe,
                &mut state.rx[end..],
                rustix::net::RecvFlags::DONTWAIT,
            ) {
                Ok((n, _)) => {
                    state.rx_end += n;
                    return Ok(polled.len() + n);
                }
                Err(rustix::io::Errno::INTR) => continue,
                // Nothing more yet: what the probe read is handled now.
                Err(rustix::io::Errno::AGAIN) => return Ok(polled.len()),
                Err(e) => return Err(e.into()),
            }
        }
    }

    #[cfg(test)]
    fn has_completed(&self) -> bool {
        !self
            .completed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    /// Moves the completions that arrived into `out` (which must be empty). The two vectors
    /// trade places, so both keep their capacity and a busy queue does not allocate here.
    fn take_completed(&self, out: &mut Vec<IoDone>) {
        debug_assert!(out.is_empty());
        let mut completed = self.completed.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::swap(&mut *completed, out);
    }
}

pub struct Connection {
    shared: Arc<Shared>,
    /// The socket's receiving side, read by the task only.
    reader: OwnedReadHalf,
    keep_alive: Option<tokio::time::Interval>,
    busy_poll: Option<BusyPoll>,
}

/// Busy polling's settings and state (see [`super::busy_poll`]).
struct BusyPoll {
    /// How long after a command the task polls.
    window: Duration,
    /// A duplicate of the socket's descriptor, which the polling branch reads while the
    /// reading branch holds the `OwnedReadHalf`.
    probe: OwnedFd,
    /// Polling until then; `None`: sleeping in epoll.
    until: Option<Instant>,
    /// What a probe reads into ([`busy_poll::PROBE_BYTES`]): not the receive buffer, so
    /// polling never holds the state lock, which completing threads only try to take.
    scratch: Box<[u8]>,
    /// Whether to poll at all (always, unless adaptive).
    chooser: Chooser,
}

impl Connection {
    pub fn new(stream: TcpStream, target: Arc<Target>, budget: &'static DataBudget) -> Self {
        let peer = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "unknown".into());
        let local = stream.local_addr().ok().map(|a| a.ip());
        Self::with_addresses(stream, peer, local, target, budget)
    }

    /// A connection whose host is not the socket's peer: a TLS connection's queue, served
    /// over the relay's loopback socket (`tcp::tls`), names the host's address in its logs
    /// and the listener's address in its discovery log.
    pub fn with_addresses(
        stream: TcpStream,
        peer: String,
        local: Option<std::net::IpAddr>,
        target: Arc<Target>,
        budget: &'static DataBudget,
    ) -> Self {
        let _ = stream.set_nodelay(true);
        let span = tracing::info_span!("nvme-tcp", peer = %peer, cntlid = tracing::field::Empty, qid = tracing::field::Empty);
        let mut cfg = DecoderConfig::new(Role::Target);
        cfg.max_pdu_len = MAX_H2C_DATA + 4096;
        let (reader, writer) = stream.into_split();
        let shared = Arc::new_cyclic(|weak: &Weak<Shared>| {
            let notifier: Weak<dyn QueueNotifier> = weak.clone();
            let completion_sink: Arc<dyn IoCompletion> = Arc::new(CompletionSink {
                shared: weak.clone(),
            });
            Shared {
                writer,
                state: Mutex::new(State {
                    queue: {
                        let mut queue = Queue::new(target, tcp_caps(), notifier);
                        queue.set_buffer_source(Box::new(
                            RecycledBuffers::counted(&super::stats().kept_buffer_bytes)
                                .charged_to(budget),
                        ));
                        if let Some(ip) = local {
                            queue.set_local_address(TransportType::Tcp, ip);
                        }
                        queue
                    },
                    completed: Vec::new(),
                    completed_inline: Vec::new(),
                    completion_sink,
                    decoder: PduDecoder::new(cfg),
                    encoder: PduEncoder::new(false, false, 0),
                    rx: vec![0; READ_CHUNK],
                    rx_start: 0,
                    rx_end: 0,
                    out: Output::default(),
                    actions: Vec::new(),
                    pending_writes: CidMap::default(),
                    budget,
                    held: VecDeque::new(),
                    next_ttag: 0,
                    close_requested: false,
                    task_only: false,
                    commands_received: 0,
                    commands_at_idle_tick: 0,
                    responded_at: None,
                }),
                completed: Mutex::new(Vec::new()),
                notify: Notify::new(),
                polling_chosen: AtomicBool::new(false),
                window_asked: AtomicBool::new(false),
                span,
            }
        });
        Self {
            shared,
            reader,
            keep_alive: None,
            busy_poll: None,
        }
    }

    /// The connection came over a TLS handshake with this PSK identity.
    pub fn with_secure_channel(self, channel: crate::core::tls::SecureChannel) -> Self {
        self.shared.lock().queue.set_secure_channel(channel);
        self
    }

    /// Polls the socket for `window` after each command before sleeping (`None`: never).
    pub fn with_busy_poll(mut self, config: Option<BusyPollConfig>) -> Self {
        self.busy_poll = config.and_then(|config| {
            let stream: &TcpStream = self.reader.as_ref();
            match stream.as_fd().try_clone_to_owned() {
                Ok(probe) => Some(BusyPoll {
                    window: config.window,
                    probe,
                    until: None,
                    scratch: vec![0; busy_poll::PROBE_BYTES].into_boxed_slice(),
                    chooser: Chooser::new(config),
                }),
                Err(e) => {
                    tracing::warn!(error = %e, "no busy polling on this connection: cannot duplicate the socket");
                    None
                }
            }
        });
        self
    }

    /// Serves the connection until the host leaves, a fatal error, or `shutdown` fires.
    pub async fn run(self, shutdown: watch::Receiver<bool>) {
        // The span is attached to the future, not entered across awaits, so log lines of one
        // connection never carry another's span.
        let span = self.shared.span.clone();
        self.serve(shutdown).instrument(span).await
    }

    async fn serve(mut self, shutdown: watch::Receiver<bool>) {
        tracing::debug!("connection accepted");
        let stats = super::stats();
        stats.accepted.fetch_add(1, Ordering::Relaxed);
        stats.live.fetch_add(1, Ordering::Relaxed);
        self.serve_until_closed(shutdown).await;
        {
            let mut state = self.shared.lock();
            state.task_only = true;
            state.queue.close();
            let held = std::mem::take(&mut state.held);
            state.budget.note_resumed(held.len());
        }
        // The writer sends FIN when the last `Shared` goes: now, or, if a completing thread
        // holds it for a moment (it does nothing once `task_only` is set), when it lets go.
        drop(self.shared);
        stats.live.fetch_sub(1, Ordering::Relaxed);
        tracing::debug!("connection closed");
    }

    /// The connection's loop: commands, completions, timers and busy polling, until the host
    /// leaves, a fatal error, or `shutdown` fires (after a drain). What it keeps registered
    /// between turns is dropped when it returns, before the connection lets go of `Shared`.
    async fn serve_until_closed(&mut self, mut shutdown: watch::Receiver<bool>) {
        let stats = super::stats();
        let mut span_recorded = false;
        let mut idle_release = tokio::time::interval_at(
            tokio::time::Instant::now() + IDLE_RELEASE_PERIOD,
            IDLE_RELEASE_PERIOD,
        );
        idle_release.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The shutdown signal and the task's wake-up stay registered from one turn of the
        // loop to the next, instead of being made, registered and dropped again in every
        // `select!` (each a lock of a waiter list or two): keeping them saved ~530 of a QD1
        // read's ~8 900 instructions (docs/performance.md). `signals` is the wake-up's own
        // handle on the shared state, so the wake-up does not borrow `self`.
        let signals = Arc::clone(&self.shared);
        let mut shutdown_signal = std::pin::pin!(shutdown.changed());
        let mut woken = std::pin::pin!(signals.notify.notified());
        loop {
            let shared = &*self.shared;
            let polling = self.busy_poll.as_mut().and_then(|p| {
                let until = p.until?;
                Some((&p.probe, &mut p.scratch[..], until))
            });
            let is_polling = polling.is_some();
            let mut shutting_down = false;
            let mut was_woken = false;
            let flow = tokio::select! {
                biased;
                _ = shutdown_signal.as_mut() => {
                    shutting_down = true;
                    Flow::Close
                }
                _ = woken.as_mut() => {
                    was_woken = true;
                    let (flow, low_depth) = {
                        let mut state = shared.lock();
                        (state.on_signals(shared), state.at_low_depth())
                    };
                    Self::open_window_if_asked(shared, &mut self.busy_poll, low_depth);
                    flow
                }
                _ = crate::keep_alive::tick(&mut self.keep_alive) => shared.lock().on_keep_alive_tick(),
                _ = idle_release.tick() => shared.lock().on_idle_tick(),
                read = std::future::poll_fn(|cx| shared.poll_read(&mut self.reader, cx)) => {
                    Self::on_read(shared, &mut self.busy_poll, read)
                }
                polled = async {
                    match polling {
                        // Bytes: take them, and read on past tokio's readiness, which did
                        // not see them, if the probe's buffer was full.
                        Some((probe, scratch, until)) => match poll_socket(probe, scratch, until).await {
                            Polled::Read(Ok(n)) => Some(shared.take_polled(&scratch[..n], probe)),
                            Polled::Read(Err(e)) => Some(Err(e)),
                            Polled::Expired => None,
                        },
                        None => std::future::pending().await,
                    }
                }, if is_polling => match polled {
                    Some(read) => Self::on_read(shared, &mut self.busy_poll, read),
                    None => {
                        stats.busy_poll_expired.fetch_add(1, Ordering::Relaxed);
                        if let Some(p) = self.busy_poll.as_mut() {
                            p.until = None;
                        }
                        Flow::Continue
                    }
                },
            };
            if was_woken || shutting_down {
                // A completed wake-up is not polled again: a fresh one takes its place. It is
                // not registered until polled, so it leaves the drain's own wake-ups alone.
                woken.set(signals.notify.notified());
            }
            if shutting_down {
                self.drain().await;
            }
            {
                let state = self.shared.lock();
                if !span_recorded {
                    if let Some(b) = state.queue.binding() {
                        self.shared.span.record("cntlid", b.controller.cntlid);
                        self.shared.span.record("qid", b.qid);
                        span_recorded = true;
                    }
                }
                if self.keep_alive.is_none() {
                    self.keep_alive = state.keep_alive_interval();
                }
            }
            if let Err(e) = self.flush().await {
                tracing::debug!(error = %e, "write failed");
                break;
            }
            if let Flow::Close = flow {
                break;
            }
            if self.shared.lock().close_requested {
                break;
            }
        }
    }

    /// A read's outcome: bytes handled, or the connection closes. Bytes open (or extend) the
    /// busy-polling window when the queue is nearly idle, and close it when it is not.
    fn on_read(
        shared: &Shared,
        busy_poll: &mut Option<BusyPoll>,
        read: std::io::Result<usize>,
    ) -> Flow {
        // While a window is open the worker never sleeps in epoll (a polling task always has
        // a deferred wake-up), so a read then needed no wake-up, whether the probe found the
        // bytes or the runtime's readiness did while the task had yielded.
        if busy_poll.as_ref().is_some_and(|p| p.until.is_some()) {
            super::stats()
                .busy_poll_reads
                .fetch_add(1, Ordering::Relaxed);
        }
        match read {
            Ok(0) => {
                tracing::debug!("host closed the connection");
                Flow::Close
            }
            Ok(_) => {
                let mut state = shared.lock();
                let commands_before = state.commands_received;
                // Taken before this read's commands: a response to one of them is not
                // what the host waited for before sending it.
                let responded_before = state.responded_at;
                let flow = state.on_bytes(shared);
                // The host's next PDU follows what it is sent now (a response frees a slot,
                // an R2T asks for data) or completes a PDU it has begun. Otherwise its
                // commands wait at a device, and the completion opens the window.
                let host_sends_next = !state.out.is_empty() || state.rx_start < state.rx_end;
                // The responses leave now, before the bookkeeping below and the way back
                // through the loop's `select!`, which the host would otherwise wait for at
                // low depth. Whatever the socket does not take, the loop's flush waits for.
                let flow = match state.try_flush(&shared.writer) {
                    Ok(_) => flow,
                    Err(e) => {
                        tracing::debug!(error = %e, "write failed");
                        Flow::Close
                    }
                };
                if let Some(p) = busy_poll.as_mut() {
                    let low_depth = state.at_low_depth();
                    let now = Instant::now();
                    if state.commands_received != commands_before {
                        if let Some(decision) =
                            p.chooser.on_commands(now, low_depth, responded_before)
                        {
                            count_decision(&decision);
                        }
                    }
                    let polls = p.chooser.polls();
                    if shared.polling_chosen.load(Ordering::Relaxed) != polls {
                        shared.polling_chosen.store(polls, Ordering::Relaxed);
                    }
                    p.until = (low_depth && polls && host_sends_next).then(|| now + p.window);
                }
                flow
            }
            Err(e) => {
                tracing::debug!(error = %e, "read failed");
                Flow::Close
            }
        }
    }

    /// Opens a polling window if a completion asked for one ([`Shared::ask_window`]) and the
    /// queue still polls at low depth (`low_depth`, read under the lock the wake-up's
    /// signals were handled in; a completion the task drained itself asks too).
    fn open_window_if_asked(shared: &Shared, busy_poll: &mut Option<BusyPoll>, low_depth: bool) {
        if !shared.window_asked.swap(false, Ordering::Relaxed) {
            return;
        }
        let Some(p) = busy_poll.as_mut() else {
            return;
        };
        if low_depth && p.chooser.polls() {
            p.until = Some(Instant::now() + p.window);
        }
    }

    /// Planned shutdown: stop taking commands, let the ones already at a device finish and
    /// send their completions, so the host sees no I/O error, only a closed queue.
    async fn drain(&mut self) {
        const DRAIN_LIMIT: Duration = Duration::from_secs(5);
        let deadline = tokio::time::Instant::now() + DRAIN_LIMIT;
        let shared = &*self.shared;
        // From here on completions come to the task, which counts them down.
        shared.lock().task_only = true;
        loop {
            let in_flight = {
                let mut state = shared.lock();
                let _ = state.drain_completions(shared);
                state.queue.in_flight()
            };
            if in_flight == 0 {
                break;
            }
            if tokio::time::timeout_at(deadline, shared.notify.notified())
                .await
                .is_err()
            {
                tracing::warn!(in_flight, "closing with commands still at the device");
                break;
            }
        }
        let _ = shared.lock().drain_completions(shared);
    }

    /// Writes all queued output: non-blocking vectored writes, waiting for the socket to
    /// take more when it is full. Completing threads may append and write meanwhile.
    async fn flush(&self) -> std::io::Result<()> {
        loop {
            if self.shared.lock().try_flush(&self.shared.writer)? {
                return Ok(());
            }
            self.shared.writer.writable().await?;
        }
    }
}

impl State {
    /// One completion handed over directly by a completing thread.
    fn complete_one(&mut self, done: IoDone) -> Flow {
        let mut actions = std::mem::take(&mut self.actions);
        self.queue.complete_io(done, &mut actions);
        let flow = self.run_actions(&mut actions);
        self.actions = actions;
        self.responded_at = Some(Instant::now());
        match flow {
            Flow::Close => Flow::Close,
            Flow::Continue => self.resume_held_if_any(),
        }
    }

    /// A completion may have left the queue holding nothing without releasing a buffer (a
    /// flush, a write-zeroes), which lets its first held command go on.
    fn resume_held_if_any(&mut self) -> Flow {
        if self.held.is_empty() {
            Flow::Continue
        } else {
            self.resume_held()
        }
    }

    /// Once no command came for a whole [`IDLE_RELEASE_PERIOD`] and nothing is in flight,
    /// gives back what the last burst grew: data buffers beyond what an idle queue keeps, and
    /// the receive buffer, which a large H2CData PDU (up to MDTS) grew to hold it whole.
    /// Without this every connection that once had a burst of large I/O keeps its peak for
    /// as long as it stays connected.
    fn on_idle_tick(&mut self) -> Flow {
        let quiet = self.commands_received == self.commands_at_idle_tick;
        self.commands_at_idle_tick = self.commands_received;
        if quiet
            && self.rx_start == self.rx_end
            && self.pending_writes.is_empty()
            && self.held.is_empty()
            && self.queue.release_idle_buffers()
            && self.rx.len() > READ_CHUNK
        {
            self.rx_start = 0;
            self.rx_end = 0;
            self.rx.truncate(READ_CHUNK);
            self.rx.shrink_to_fit();
        }
        Flow::Continue
    }

    /// Makes sure there is room to read into, and returns where it starts. A read into no
    /// room would return 0 bytes, which looks like the host closing.
    fn make_read_room(&mut self) -> usize {
        if self.rx.len() - self.rx_end < READ_CHUNK / 4 {
            self.compact_rx();
        }
        self.rx_end
    }

    /// Moves the undecoded bytes to the front and makes room for `READ_CHUNK` more.
    fn compact_rx(&mut self) {
        if self.rx_start > 0 {
            self.rx.copy_within(self.rx_start..self.rx_end, 0);
            self.rx_end -= self.rx_start;
            self.rx_start = 0;
        }
        if self.rx.len() < self.rx_end + READ_CHUNK {
            self.rx.resize(self.rx_end + READ_CHUNK, 0);
        }
    }

    /// Decodes and handles every complete PDU in the receive buffer.
    fn on_bytes(&mut self, shared: &Shared) -> Flow {
        loop {
            let decoded = self.decoder.decode(&self.rx[self.rx_start..self.rx_end]);
            let (flow, consumed) = match decoded {
                Ok(None) => break,
                Ok(Some((pdu, consumed))) => {
                    // Copy what we need out of the receive buffer before handling, so the
                    // handler can borrow `self` mutably.
                    let base = self.rx[self.rx_start..self.rx_end].as_ptr() as usize;
                    let owned = OwnedPdu::from(pdu, base, &mut self.queue);
                    (self.on_pdu(owned), consumed)
                }
                Err(PduError::DataDigest {
                    cccid, consumed, ..
                }) => {
                    tracing::warn!(cccid, "data digest mismatch: command failed for retry");
                    super::stats()
                        .data_digest_errors
                        .fetch_add(1, Ordering::Relaxed);
                    self.pending_writes.remove(&cccid);
                    self.respond_error(cccid, Status::retryable(TRANSIENT_TRANSPORT_ERROR));
                    (Flow::Continue, consumed)
                }
                Err(e) => {
                    self.fatal(&e);
                    return Flow::Close;
                }
            };
            self.rx_start += consumed;
            if let Flow::Close = flow {
                return Flow::Close;
            }
        }
        if self.rx_start == self.rx_end {
            self.rx_start = 0;
            self.rx_end = 0;
        }
        self.drain_completions(shared)
    }

    /// Sends C2HTermReq for a fatal PDU error and closes.
    fn fatal(&mut self, e: &PduError) {
        let (fes, fei) = e.term_req_info().unwrap_or((Fes::InvalidHeaderField, 0));
        tracing::warn!(error = %e, ?fes, fei, "fatal PDU error: sending C2HTermReq and closing");
        super::stats()
            .fatal_pdu_errors
            .fetch_add(1, Ordering::Relaxed);
        let bad = &self.rx[self.rx_start..self.rx_end];
        let header = &bad[..bad.len().min(super::pdu::TERM_REQ_MAX_DATA)];
        let header = header.to_vec();
        self.out
            .push_header(|o| encode_c2h_term_req(o, fes, fei, &header));
    }

    fn on_pdu(&mut self, pdu: OwnedPdu) -> Flow {
        match pdu {
            OwnedPdu::IcReq {
                pfv,
                hpda,
                hdgst,
                ddgst,
            } => {
                if pfv != PFV_1_0 {
                    let e = PduError::UnsupportedParameter {
                        offset: super::pdu::offsets::PFV,
                        value: u32::from(pfv),
                    };
                    self.fatal(&e);
                    return Flow::Close;
                }
                self.decoder.set_digests(hdgst, ddgst);
                self.decoder.set_max_h2c_data(MAX_H2C_DATA);
                self.encoder = PduEncoder::new(hdgst, ddgst, hpda);
                let resp = IcResp {
                    pfv: PFV_1_0,
                    cpda: 0,
                    hdgst,
                    ddgst,
                    maxh2cdata: MAX_H2C_DATA,
                };
                self.out.push_header(|o| encode_icresp(o, &resp));
                Flow::Continue
            }
            OwnedPdu::Capsule { cmd, data } => self.on_capsule(cmd, data),
            OwnedPdu::H2CData {
                cccid,
                datao,
                last,
                data_range,
            } => self.on_h2c_data(cccid, datao, last, data_range),
            OwnedPdu::TermReq { fes, fei } => {
                tracing::warn!(fes, fei, "host sent H2CTermReq: closing");
                super::stats()
                    .host_term_reqs
                    .fetch_add(1, Ordering::Relaxed);
                Flow::Close
            }
        }
    }

    fn on_capsule(&mut self, cmd: Command, in_capsule: Option<IoBuf>) -> Flow {
        self.commands_received += 1;
        if self
            .queue
            .exceeds_queue_size(self.pending_writes.len() + self.held.len())
        {
            tracing::warn!(
                cid = cmd.cid(),
                in_flight = self.queue.in_flight(),
                waiting_for_data = self.pending_writes.len(),
                "the host sent more commands than twice its queue size"
            );
            self.fatal(&PduError::Sequence {
                pdu_type: PduType::CapsuleCmd,
            });
            return Flow::Close;
        }
        if let Err(completion) = self.queue.check_data_len(&cmd) {
            if let Some(buf) = in_capsule {
                self.queue.recycle(buf);
            }
            self.push_completion(&completion);
            return Flow::Continue;
        }
        if !self.held.is_empty() || !self.budget_admits(&cmd) {
            tracing::debug!(
                cid = cmd.cid(),
                data_len = cmd.data_len(),
                budget_in_use = self.budget.in_use(),
                "data budget spent: the command waits for buffers to be released"
            );
            warn_budget_spent(self.budget);
            self.budget.note_held();
            self.held.push_back((cmd, in_capsule));
            return self.resume_held();
        }
        self.start(cmd, in_capsule)
    }

    /// Whether the budget lets `cmd` take the data buffer it needs now. Commands that need
    /// none (no data, or data already here in the capsule) always may, and so may a queue
    /// that holds no buffer at the device or waiting for data: every queue makes progress
    /// whatever the others hold (its Connect too, on any queue).
    fn budget_admits(&self, cmd: &Command) -> bool {
        let needs = match cmd.data_len() as usize {
            0 => 0,
            _ if cmd.is_host_to_controller() && cmd.sgl().is_in_capsule() => 0,
            len => len,
        };
        needs == 0
            || self.budget.admits(needs)
            || (self.queue.in_flight() == 0 && self.pending_writes.is_empty())
    }

    /// Starts the held commands the budget admits now, in order. Once the first of them
    /// still does not fit, the connection asks to be woken by the next release (and checks
    /// once more, since a release may have come between).
    fn resume_held(&mut self) -> Flow {
        let mut asked_to_be_woken = false;
        while let Some((cmd, _)) = self.held.front() {
            if !self.budget_admits(cmd) {
                if asked_to_be_woken {
                    break;
                }
                self.budget.wake_on_release(self.queue.notifier.clone());
                asked_to_be_woken = true;
                continue;
            }
            let Some((cmd, in_capsule)) = self.held.pop_front() else {
                break;
            };
            self.budget.note_resumed(1);
            if let Flow::Close = self.start(cmd, in_capsule) {
                return Flow::Close;
            }
        }
        Flow::Continue
    }

    /// Runs a command the connection has admitted: asks for its data by R2T, or executes it.
    fn start(&mut self, cmd: Command, in_capsule: Option<IoBuf>) -> Flow {
        let len = cmd.data_len() as usize;
        if cmd.is_host_to_controller() && len > 0 {
            let sgl = cmd.sgl();
            if sgl.is_in_capsule() {
                return match in_capsule {
                    Some(buf)
                        if buf.len() >= len
                            && buf.len() <= IN_CAPSULE_DATA_SIZE as usize
                            && sgl.address == 0 =>
                    {
                        let mut buf = buf;
                        buf.resize(len);
                        self.execute(cmd, Some(buf))
                    }
                    other => {
                        if let Some(buf) = other {
                            self.queue.recycle(buf);
                        }
                        self.respond_error(cmd.cid(), Status::error(sc::SGL_INVALID_OFFSET));
                        Flow::Continue
                    }
                };
            }
            if let Some(buf) = in_capsule {
                self.queue.recycle(buf);
            }
            // Ask the host for the data: one R2T covering the whole transfer.
            let cid = cmd.cid();
            if self.pending_writes.contains_key(&cid) {
                self.respond_error(cid, Status::error(sc::CMDID_CONFLICT));
                return Flow::Continue;
            }
            let buf = self.queue.take_buffer(len);
            self.pending_writes.insert(
                cid,
                PendingWrite {
                    cmd,
                    buf,
                    received: 0,
                },
            );
            let ttag = self.next_ttag;
            self.next_ttag = self.next_ttag.wrapping_add(1);
            let encoder = &self.encoder;
            self.out
                .push_header(|o| encoder.r2t(o, cid, ttag, 0, len as u32));
            return Flow::Continue;
        }
        if let Some(buf) = in_capsule {
            self.queue.recycle(buf);
        }
        self.execute(cmd, None)
    }

    fn on_h2c_data(
        &mut self,
        cccid: u16,
        datao: u32,
        last: bool,
        data: std::ops::Range<usize>,
    ) -> Flow {
        let Some(pending) = self.pending_writes.get_mut(&cccid) else {
            self.fatal(&PduError::DataOutOfRange {
                offset: super::pdu::offsets::CCCID,
            });
            return Flow::Close;
        };
        let bytes = &self.rx[self.rx_start..self.rx_end][data];
        let end = datao as usize + bytes.len();
        if datao as usize != pending.received || end > pending.buf.len() {
            self.fatal(&PduError::DataOutOfRange {
                offset: super::pdu::offsets::DATAO,
            });
            return Flow::Close;
        }
        pending.buf.as_mut_slice()[datao as usize..end].copy_from_slice(bytes);
        pending.received = end;
        let complete = end == pending.buf.len();
        if complete != last && last {
            self.fatal(&PduError::DataOutOfRange {
                offset: super::pdu::offsets::DATAL,
            });
            return Flow::Close;
        }
        if complete {
            if let Some(p) = self.pending_writes.remove(&cccid) {
                return self.execute(p.cmd, Some(p.buf));
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
        flow
    }

    /// The KATO timer, once this queue is a connected admin queue with a keep-alive timeout.
    fn keep_alive_interval(&self) -> Option<tokio::time::Interval> {
        crate::keep_alive::admin_queue_timer(&self.queue)
    }

    fn on_keep_alive_tick(&mut self) -> Flow {
        if crate::keep_alive::still_alive(&self.queue) {
            Flow::Continue
        } else {
            Flow::Close
        }
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
                    let completion = &resp.completion;
                    // Without SQ flow control the host needs no SQ head, so a plain
                    // success rides on the data PDU's SUCCESS flag and no CapsuleResp
                    // follows (as Linux nvmet does).
                    let fold = self.queue.sq_flow_control_disabled()
                        && completion.status.is_success()
                        && completion.result == 0;
                    let folded = match resp.data {
                        Some(buf) => self.push_data(completion.cid, buf, fold),
                        None => false,
                    };
                    if !folded {
                        self.push_completion(completion);
                    }
                }
                Action::Submit { device, tag, op } => match device.complete_now(tag, op) {
                    Ok(done) => self.completed_inline.push(done),
                    Err(op) => {
                        let _scope = SubmitScope::enter(&self.completion_sink);
                        device.submit(tag, op, &self.completion_sink)
                    }
                },
                Action::SubmitThrottled {
                    qos,
                    device,
                    tag,
                    op,
                } => {
                    let _scope = SubmitScope::enter(&self.completion_sink);
                    crate::qos::submit(qos, device, tag, op, &self.completion_sink)
                }
                Action::Close => *flow = Flow::Close,
            }
        }
    }

    /// Queues `buf` as one C2HData PDU, with the SUCCESS flag if `success`; returns
    /// whether that PDU completes the command (an empty buffer sends nothing).
    fn push_data(&mut self, cid: u16, buf: IoBuf, success: bool) -> bool {
        if buf.is_empty() {
            self.queue.recycle(buf);
            return false;
        }
        let encoder = &self.encoder;
        let len = buf.len() as u32;
        self.out
            .push_header(|o| encoder.c2h_data_header(o, cid, 0, len, true, success));
        let digest = encoder
            .data_digest()
            .then(|| super::digest::data_digest(buf.as_slice()).to_le_bytes());
        self.out.segments.push_back(Segment::Data { buf, digest });
        success
    }

    fn push_completion(&mut self, completion: &Completion) {
        let encoder = &self.encoder;
        let cqe = completion.to_bytes();
        self.out.push_header(|o| encoder.capsule_resp(o, &cqe));
    }

    fn respond_error(&mut self, cid: u16, status: Status) {
        let completion = self.queue.completion(cid, status);
        self.push_completion(&completion);
    }

    /// Handles every completion in the shared list, and starts the held commands the budget
    /// admits once it is empty. Ends only with the list empty: completions that came inline
    /// during a submit here or before (see [`SubmitScope`]) woke nobody.
    fn drain_completions(&mut self, shared: &Shared) -> Flow {
        let mut flow = Flow::Continue;
        loop {
            let mut done = std::mem::take(&mut self.completed);
            shared.take_completed(&mut done);
            if done.is_empty() {
                self.completed = done;
                let held = self.held.len();
                if matches!(flow, Flow::Close) || held == 0 {
                    return flow;
                }
                if let Flow::Close = self.resume_held() {
                    return Flow::Close;
                }
                if self.held.len() == held {
                    return Flow::Continue;
                }
                // Commands started: the list again, for those that completed inline.
                continue;
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
            self.responded_at = Some(Instant::now());
        }
    }

    /// Few enough commands at the device that the queue may poll for the host's next one
    /// ([`busy_poll::MAX_IN_FLIGHT`]).
    fn at_low_depth(&self) -> bool {
        self.queue.in_flight() <= busy_poll::MAX_IN_FLIGHT
    }

    fn on_signals(&mut self, shared: &Shared) -> Flow {
        let mut actions = std::mem::take(&mut self.actions);
        self.queue.poll_events(&mut actions);
        let mut flow = self.run_actions(&mut actions);
        self.actions = actions;
        // A release woke us, or a notice: drain_completions starts what the budget admits.
        if let Flow::Close = self.drain_completions(shared) {
            flow = Flow::Close;
        }
        flow
    }

    /// Writes queued output with non-blocking vectored writes until it is all written
    /// (true) or the socket takes no more (false).
    fn try_flush(&mut self, stream: &OwnedWriteHalf) -> std::io::Result<bool> {
        while !self.out.is_empty() {
            // A segment is at most two slices. The usual output (a response, or a read's
            // data and response) fits the small array: making all 64 slices of the large
            // one for it cost ~440 of a QD1 read's ~8 400 instructions (callgrind).
            let written = if self.out.segments.len() <= FEW_SEGMENTS {
                self.write_some::<{ 2 * FEW_SEGMENTS }>(stream)
            } else {
                self.write_some::<MAX_SLICES>(stream)
            };
            let written = match written {
                Ok(written) => written,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e),
            };
            if written == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            self.advance_output(written);
        }
        self.out.headers.clear();
        Ok(true)
    }

    /// One vectored write of up to `N` slices of the queued output, from where the last
    /// one stopped: the bytes written.
    fn write_some<const N: usize>(&self, stream: &OwnedWriteHalf) -> std::io::Result<usize> {
        let mut slices: [IoSlice<'_>; N] = [IoSlice::new(&[]); N];
        let mut n = 0;
        let mut skip = self.out.front_written;
        'fill: for seg in &self.out.segments {
            let parts: [&[u8]; 2] = match seg {
                Segment::Header { start, end } => [&self.out.headers[*start..*end], &[]],
                Segment::Data { buf, digest } => {
                    [buf.as_slice(), digest.as_ref().map_or(&[][..], |d| &d[..])]
                }
            };
            for part in parts {
                if part.is_empty() {
                    continue;
                }
                if skip >= part.len() {
                    skip -= part.len();
                    continue;
                }
                slices[n] = IoSlice::new(&part[skip..]);
                skip = 0;
                n += 1;
                if n == N {
                    break 'fill;
                }
            }
        }
        stream.try_write_vectored(&slices[..n])
    }

    fn advance_output(&mut self, mut written: usize) {
        written += self.out.front_written;
        self.out.front_written = 0;
        while let Some(seg) = self.out.segments.front() {
            let len = match seg {
                Segment::Header { start, end } => end - start,
                Segment::Data { buf, digest } => buf.len() + digest.map_or(0, |d| d.len()),
            };
            if written < len {
                self.out.front_written = written;
                return;
            }
            written -= len;
            if let Some(Segment::Data { buf, .. }) = self.out.segments.pop_front() {
                self.queue.recycle(buf);
            }
        }
    }
}

/// A decoded PDU with its data moved out of the receive buffer (commands) or located in
/// it (H2CData, copied straight into the waiting command's buffer).
enum OwnedPdu {
    IcReq {
        pfv: u16,
        hpda: u8,
        hdgst: bool,
        ddgst: bool,
    },
    Capsule {
        cmd: Command,
        data: Option<IoBuf>,
    },
    H2CData {
        cccid: u16,
        datao: u32,
        last: bool,
        data_range: std::ops::Range<usize>,
    },
    TermReq {
        fes: u16,
        fei: u32,
    },
}

impl OwnedPdu {
    /// `base` is the address of the buffer the PDU was decoded from.
    fn from(pdu: Pdu<'_>, base: usize, queue: &mut Queue) -> OwnedPdu {
        match pdu {
            Pdu::IcReq(r) => OwnedPdu::IcReq {
                pfv: r.pfv,
                hpda: r.hpda,
                hdgst: r.hdgst,
                ddgst: r.ddgst,
            },
            Pdu::CapsuleCmd(c) => {
                let sqe: &[u8; SQE_LEN] = c.sqe;
                let data = (!c.data.is_empty()).then(|| {
                    let mut buf = queue.take_buffer(c.data.len());
                    buf.as_mut_slice().copy_from_slice(c.data);
                    buf
                });
                OwnedPdu::Capsule {
                    cmd: Command::from_bytes(sqe),
                    data,
                }
            }
            Pdu::H2CData(d) => OwnedPdu::H2CData {
                cccid: d.cccid,
                datao: d.datao,
                last: d.last,
                data_range: {
                    let start = d.data.as_ptr() as usize - base;
                    start..start + d.data.len()
                },
            },
            Pdu::H2CTermReq(t) => OwnedPdu::TermReq {
                fes: t.fes,
                fei: t.fei,
            },
            // The decoder only yields host-to-controller PDUs for the target role.
            _ => OwnedPdu::TermReq { fes: 0, fei: 0 },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::queue::InFlight;
    use crate::core::TargetIdentity;
    use rbd_backend::{BlockDevice, IoOp};

    static BUDGET: DataBudget = DataBudget::new(1 << 20);

    /// A connection over a loopback socket, and the host's end of it (kept open).
    async fn connection() -> (Connection, TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("listener address");
        let (host, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let target = Arc::new(Target::new(TargetIdentity::default()));
        let conn = Connection::new(accepted.expect("accept").0, target, &BUDGET);
        (conn, host.expect("connect"))
    }

    fn flush_done() -> IoDone {
        IoDone {
            tag: 1,
            op: IoOp::Flush,
            result: Ok(()),
        }
    }

    /// Whether the task would be woken: a `Notify` permit is waiting.
    fn woken(shared: &Shared) -> bool {
        let notified = shared.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable()
    }

    /// Queues `segments` output segments (headers, and data with and without a digest), of
    /// `data_len` bytes of data each, and returns the bytes they make on the wire.
    fn queue_output(state: &mut State, segments: usize, data_len: usize) -> Vec<u8> {
        let mut wire = Vec::new();
        for i in 0..segments {
            let fill = i as u8;
            if i % 2 == 0 {
                let header = [fill; 24];
                state.out.push_header(|o| o.extend_from_slice(&header));
                wire.extend_from_slice(&header);
            } else {
                let data = vec![fill; data_len];
                let digest = (i % 4 == 1).then_some([0xd1, 0xd2, 0xd3, fill]);
                wire.extend_from_slice(&data);
                if let Some(d) = digest {
                    wire.extend_from_slice(&d);
                }
                let buf = IoBuf::from_vec(data);
                state.out.segments.push_back(Segment::Data { buf, digest });
            }
        }
        wire
    }

    /// Flushes everything queued while the host reads it: the bytes the host got.
    async fn flush_to_host(shared: &Shared, host: &mut TcpStream, expected: usize) -> Vec<u8> {
        use tokio::io::AsyncReadExt;
        let mut got = vec![0u8; expected];
        let mut read = 0;
        let mut flushed = false;
        while read < expected {
            if !flushed {
                flushed = shared.lock().try_flush(&shared.writer).expect("flush");
            }
            let n = tokio::time::timeout(Duration::from_secs(5), host.read(&mut got[read..]))
                .await
                .expect("the host gets the output")
                .expect("read");
            assert!(n > 0, "the connection stayed open");
            read += n;
        }
        assert!(flushed || shared.lock().try_flush(&shared.writer).expect("flush"));
        assert!(shared.lock().out.is_empty(), "nothing left queued");
        got
    }

    #[tokio::test]
    async fn queued_output_reaches_the_host_whole_and_in_order_in_small_and_large_writes() {
        let (conn, mut host) = connection().await;
        let shared = &*conn.shared;
        // Few segments (the small array), many (the large one, in several writes once past
        // its 64 slices), and few but larger than the socket takes at once, so that a
        // write stops inside a segment and the next one starts from there.
        for (segments, data_len) in [(3, 4096), (FEW_SEGMENTS, 512), (100, 700), (3, 8 << 20)] {
            let wire = queue_output(&mut shared.lock(), segments, data_len);
            let got = flush_to_host(shared, &mut host, wire.len()).await;
            assert!(
                got == wire,
                "{segments} segments of {data_len} bytes arrive as queued"
            );
        }
    }

    #[tokio::test]
    async fn a_completion_inside_its_own_submit_wakes_nobody_and_waits_for_the_drain() {
        let (conn, _host) = connection().await;
        let shared = &*conn.shared;
        let sink = shared.lock().completion_sink.clone();
        {
            // As in `run_actions`: the state locked, a device completing inside its submit.
            let _state = shared.lock();
            let _scope = SubmitScope::enter(&sink);
            sink.complete(flush_done());
        }
        assert!(!woken(shared), "no wake-up for an inline completion");
        assert!(shared.has_completed(), "left in the list for the drain");
    }

    #[tokio::test]
    async fn a_read_the_device_completes_now_is_answered_without_the_completion_list() {
        let (conn, _host) = connection().await;
        let shared = &*conn.shared;
        let device = Arc::new(rbd_backend::MemoryDevice::new("inline", 1 << 20));
        let written: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
        let wrote = device.complete_now(
            0,
            IoOp::Write {
                offset: 8192,
                buf: IoBuf::from_vec(written.clone()),
                fua: false,
            },
        );
        assert!(wrote.is_ok_and(|done| done.result.is_ok()));
        let mut state = shared.lock();
        state.queue.inflight.insert(7, InFlight::Read);
        let mut actions = vec![Action::Submit {
            device,
            tag: 7,
            op: IoOp::Read {
                offset: 8192,
                buf: IoBuf::zeroed(4096),
            },
        }];
        assert!(matches!(state.run_actions(&mut actions), Flow::Continue));
        assert_eq!(
            state.queue.in_flight(),
            0,
            "the read completed in the queue"
        );
        let data: Vec<&[u8]> = state
            .out
            .segments
            .iter()
            .filter_map(|s| match s {
                Segment::Data { buf, .. } => Some(buf.as_slice()),
                Segment::Header { .. } => None,
            })
            .collect();
        assert!(
            data == [&written[..]],
            "the response carries the device's bytes"
        );
        drop(state);
        assert!(!shared.has_completed(), "nothing went through the list");
        assert!(!woken(shared), "and nobody was woken");
    }

    #[tokio::test]
    async fn a_completion_outside_a_submit_wakes_the_task_that_holds_the_state() {
        let (conn, _host) = connection().await;
        let shared = &*conn.shared;
        let sink = shared.lock().completion_sink.clone();
        {
            let _state = shared.lock();
            {
                let _scope = SubmitScope::enter(&sink);
            }
            // The submit is over (its scope ended): this is a completion from elsewhere.
            sink.complete(flush_done());
        }
        assert!(
            woken(shared),
            "the task holding the state must be woken to drain it"
        );
        assert!(shared.has_completed());
    }
}
