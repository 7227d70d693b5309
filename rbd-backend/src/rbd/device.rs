//! [`RbdDevice`]: an open image that turns [`IoOp`]s into `rbd_aio_*` calls, the state its
//! in-flight requests share, librbd's completions, and resize notifications.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::caw::{native_compare_and_write, spawn_caw, CawJob, WriteGate};
use super::cluster::{ClientHealth, ClusterPool, ShardLease};
use super::{ImageSpec, RbdError, EILSEQ, EINVAL, EIO, EROFS, ESHUTDOWN, ETIMEDOUT};
use crate::device::{
    BlockDevice, DeviceEvent, DeviceEventSink, IoCompletion, IoDone, IoError, IoOp,
};
use crate::ffi::{self, AioAction, AioRequest};
use crate::stats::{IoStats, IoStatsSnapshot};

/// The shared state of an open image (what in-flight requests hold on to).
pub struct DeviceState {
    pub(super) name: String,
    pub(super) image: Arc<ffi::Image>,
    pub(super) size: AtomicU64,
    pub(super) object_size: u64,
    pub(super) sink: Mutex<Option<Arc<dyn DeviceEventSink>>>,
    pub(super) gate: Arc<WriteGate>,
    /// Whether this handle holds the exclusive lock in exclusive mode (taken for the first
    /// emulated compare-and-write); `Some(false)`: the image has no exclusive-lock feature.
    pub(super) caw_lock: Mutex<Option<bool>>,
    /// The cluster connection the image is open on.
    pub(super) client: Arc<ClientHealth>,
    /// Whether the fence was reported to the sink already (once per device).
    pub(super) fence_reported: AtomicBool,
    /// Ops handed to librbd (or queued behind the write gate) and not completed yet.
    pub(super) in_flight: AtomicUsize,
    /// The same ops by the slice of their start: whether one has waited too long.
    pub(super) ages: crate::op_ages::OpAges,
    /// Every op's outcome, recorded just before its completion is delivered. Shared with the
    /// devices that reopen the image ([`RbdDevice::reopen_in_group`]), so a namespace's counts
    /// go on across a reopen on fresh clients instead of starting from 0.
    pub(super) stats: Arc<IoStats>,
}

impl DeviceState {
    /// An op submitted at `started` is in flight (every path that ends it calls
    /// [`Self::op_finished`] with the same instant once its completion is delivered).
    pub(super) fn op_started(&self, started: Instant) {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        self.ages.started(started);
    }

    pub(super) fn op_finished(&self, started: Instant) {
        self.ages.finished(started);
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
    }

    /// Counts the op and hands its result to the caller.
    pub(super) fn deliver(
        &self,
        started: Instant,
        completion: &Arc<dyn IoCompletion>,
        tag: u64,
        op: IoOp,
        result: Result<(), IoError>,
    ) {
        self.stats.record(&op, started, &result);
        completion.complete(IoDone { tag, op, result });
    }

    /// The connection was blocklisted: mark it (no op goes through it again) and tell the
    /// sink once, so the gateway reports the path inaccessible.
    pub(super) fn fenced(&self) {
        if self.client.mark_blocklisted() {
            tracing::error!(
                image = %self.name,
                group = self.client.group,
                "the cluster blocklisted this gateway's client for the ANA group (fenced): \
                 no more I/O through it until the group is given back on a fresh client"
            );
        }
        if !self.fence_reported.swap(true, Ordering::SeqCst) {
            let sink = self.sink.lock().unwrap_or_else(|e| e.into_inner()).clone();
            if let Some(sink) = sink {
                sink.device_event(DeviceEvent::Fenced);
            }
        }
    }

    /// Re-reads the size (blocking) and reports a change.
    fn refresh_size(&self) {
        let new_size = match self.image.size() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(image = %self.name, "cannot read the size after an update: {e}");
                return;
            }
        };
        let old = self.size.swap(new_size, Ordering::SeqCst);
        if old == new_size {
            return;
        }
        tracing::info!(image = %self.name, old, new_size, "rbd image resized");
        let sink = self.sink.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(sink) = sink {
            sink.device_event(DeviceEvent::Resized { new_size });
        }
    }
}

/// Runs on a librbd thread: only queues the work.
pub(super) fn notify_update(state: Weak<DeviceState>) {
    let tx = EVENTS.get_or_init(start_event_thread);
    if let Some(tx) = tx {
        if let Ok(tx) = tx.lock() {
            let _ = tx.send(state);
        }
    }
}

static EVENTS: OnceLock<Option<Mutex<mpsc::Sender<Weak<DeviceState>>>>> = OnceLock::new();

fn start_event_thread() -> Option<Mutex<mpsc::Sender<Weak<DeviceState>>>> {
    let (tx, rx) = mpsc::channel::<Weak<DeviceState>>();
    let spawned = std::thread::Builder::new()
        .name("rbd-events".into())
        .spawn(move || {
            while let Ok(state) = rx.recv() {
                if let Some(state) = state.upgrade() {
                    state.refresh_size();
                }
            }
        });
    match spawned {
        Ok(_) => Some(Mutex::new(tx)),
        Err(e) => {
            tracing::error!("cannot start the rbd-events thread ({e}); resizes go unnoticed");
            None
        }
    }
}

/// An open RBD image serving one namespace.
pub struct RbdDevice {
    pub(super) state: Arc<DeviceState>,
    pub(super) _lease: ShardLease,
    pub(super) pool: Arc<ClusterPool>,
    pub(super) spec: ImageSpec,
    pub(super) group: u32,
}

impl std::fmt::Debug for RbdDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RbdDevice")
            .field("image", &self.state.name)
            .field("size", &self.size_bytes())
            .finish()
    }
}

impl RbdDevice {
    /// The RADOS object size of the image.
    pub fn object_size(&self) -> u64 {
        self.state.object_size
    }

    /// The image this device serves.
    pub fn spec(&self) -> &ImageSpec {
        &self.spec
    }

    /// The ANA group whose connections the image is open on.
    pub fn group(&self) -> u32 {
        self.group
    }

    /// The connection the image is open on.
    pub fn client(&self) -> &Arc<ClientHealth> {
        &self.state.client
    }

    /// Opens the same image again on `group`'s current connections (blocking): after
    /// [`ClusterPool::retire_group`] that is a fresh client; after a namespace moved to
    /// another ANA group, that group's clients.
    pub fn reopen_in_group(&self, group: u32) -> Result<RbdDevice, RbdError> {
        self.pool
            .open_with_stats(&self.spec, group, self.state.stats.clone())
    }

    /// Re-reads the size from the cluster now (blocking), reporting a change like a watch
    /// notification would.
    pub fn refresh_size(&self) {
        self.state.refresh_size();
    }

    /// Checks that can fail before librbd sees the op.
    fn precheck(&self, op: &IoOp) -> Result<(), IoError> {
        let size = self.size_bytes();
        let range = |offset: u64, len: u64| match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(IoError::OutOfRange { offset, len, size }),
        };
        match op {
            IoOp::Read { offset, buf } | IoOp::Write { offset, buf, .. } => {
                range(*offset, buf.len() as u64)
            }
            IoOp::Flush => Ok(()),
            IoOp::Discard { offset, len } | IoOp::WriteZeroes { offset, len } => {
                range(*offset, *len)
            }
            IoOp::CompareAndWrite {
                offset,
                compare,
                write,
            } => {
                if compare.len() != write.len() {
                    return Err(IoError::Device(format!(
                        "compare ({}) and write ({}) lengths differ",
                        compare.len(),
                        write.len()
                    )));
                }
                range(*offset, write.len() as u64)?;
                Ok(())
            }
            IoOp::StoreRecord { .. } => Ok(()),
        }
    }
}

/// The RADOS object (in the image's pool and namespace) whose omap holds the records the
/// gateway stores with an image ([`IoOp::StoreRecord`]): one object per image, named after
/// it, so the records of every image stay apart and `rados ls` shows whose they are.
pub fn record_object(image: &str) -> String {
    format!("nvmeof_records.{image}")
}

/// A record store waiting for the `rbd-records` thread.
struct RecordJob {
    state: Arc<DeviceState>,
    object: String,
    started: Instant,
    tag: u64,
    op: IoOp,
    completion: Arc<dyn IoCompletion>,
}

static RECORDS: OnceLock<Option<Mutex<mpsc::Sender<RecordJob>>>> = OnceLock::new();

/// One thread runs every record store (blocking librados calls, which must not run on the
/// submitting thread), in submission order.
fn start_records_thread() -> Option<Mutex<mpsc::Sender<RecordJob>>> {
    let (tx, rx) = mpsc::channel::<RecordJob>();
    let spawned = std::thread::Builder::new()
        .name("rbd-records".into())
        .spawn(move || {
            while let Ok(job) = rx.recv() {
                run_record_job(job);
            }
        });
    match spawned {
        Ok(_) => Some(Mutex::new(tx)),
        Err(e) => {
            tracing::error!("cannot start the rbd-records thread ({e}); records cannot be stored");
            None
        }
    }
}

fn run_record_job(job: RecordJob) {
    let RecordJob {
        state,
        object,
        started,
        tag,
        op,
        completion,
    } = job;
    let result = match &op {
        IoOp::StoreRecord { key, value } if !state.client.is_blocklisted() => state
            .image
            .store_record(&object, key, value)
            .map_err(|e| record_error("store", &state, &e)),
        IoOp::StoreRecord { .. } => {
            state.fenced();
            Err(IoError::Fenced("client blocklisted".into()))
        }
        _ => Err(IoError::Device("not a record store".into())),
    };
    state.deliver(started, &completion, tag, op, result);
    state.op_finished(started);
}

/// A record store's or load's librados error: a blocklisted client is the fence.
fn record_error(what: &str, state: &DeviceState, e: &ffi::FfiError) -> IoError {
    match e.errno() {
        Some(ESHUTDOWN) => {
            state.fenced();
            IoError::Fenced(format!("record {what}: this client was blocklisted ({e})"))
        }
        _ => IoError::Device(format!("record {what}: {e}")),
    }
}

/// Maps librbd's result for `req` to the op's result.
fn op_result(req: &AioRequest, rv: i64) -> Result<(), IoError> {
    if rv >= 0 {
        if let IoOp::Read { buf, .. } = &req.op {
            if req.action == AioAction::Op && rv as u64 != buf.len() as u64 {
                return Err(IoError::Device(format!(
                    "rbd_aio_read returned {rv} of {} bytes",
                    buf.len()
                )));
            }
        }
        return Ok(());
    }
    let errno = i32::try_from(rv.saturating_neg()).unwrap_or(EIO);
    let what = match (&req.op, req.action) {
        (_, AioAction::Flush) | (IoOp::Flush, _) => "flush",
        (IoOp::Read { .. }, _) => "read",
        (IoOp::Write { .. }, _) => "write",
        (IoOp::Discard { .. }, _) => "discard",
        (IoOp::WriteZeroes { .. }, _) => "write zeroes",
        (IoOp::CompareAndWrite { .. }, _) => "compare-and-write",
        (IoOp::StoreRecord { .. }, _) => "record store",
    };
    Err(match (&req.op, errno) {
        (IoOp::CompareAndWrite { offset, write, .. }, EILSEQ) => IoError::Miscompare {
            offset_in_range: mismatch_in_range(req.mismatch_off, *offset, write.len() as u64),
        },
        (_, EROFS) => IoError::ReadOnly,
        (_, ESHUTDOWN) => IoError::Fenced(format!(
            "{what}: this client was blocklisted by the cluster (errno {errno})"
        )),
        (_, ETIMEDOUT) => IoError::Device(format!(
            "{what}: the cluster did not answer in time (rados_osd_op_timeout; errno {errno})"
        )),
        (_, EINVAL) => IoError::Device(format!(
            "{what}: librbd refused the request (errno {errno})"
        )),
        _ => IoError::Device(format!("{what}: {} (errno {errno})", ffi::strerror(errno))),
    })
}

/// librbd 16.2 reports the mismatch relative to the request (seen: 100 for a difference at
/// byte 100 of a compare at image offset 65536); later releases may report the image offset.
/// Accept both: a value inside `offset..offset+len` is an image offset.
fn mismatch_in_range(mismatch_off: u64, offset: u64, len: u64) -> u64 {
    if mismatch_off >= offset && mismatch_off - offset < len && mismatch_off >= len {
        mismatch_off - offset
    } else {
        mismatch_off.min(len.saturating_sub(1))
    }
}

/// Completion of one librbd request, on the librbd callback thread.
fn on_aio_done(mut req: Box<AioRequest>, rv: i64) {
    let result = op_result(&req, rv);
    if matches!(result, Err(IoError::Fenced(_))) {
        // Before the host hears of it: the path is reported inaccessible first.
        req.device.fenced();
    }
    if result.is_ok()
        && req.action == AioAction::Op
        && matches!(req.op, IoOp::Write { fua: true, .. })
    {
        // FUA: the write is done; make it durable before completing. (With rbd_cache=false
        // an acknowledged write is already on the OSDs and this flush returns at once.)
        req.action = AioAction::Flush;
        match ffi::submit(req) {
            Ok(()) => return,
            Err((r, e)) => {
                req = r;
                let err = match e.errno() {
                    Some(ESHUTDOWN) => {
                        req.device.fenced();
                        IoError::Fenced(format!("FUA flush: {e}"))
                    }
                    _ => IoError::Device(format!("FUA flush: {e}")),
                };
                return finish(req, Err(err));
            }
        }
    }
    if let Err(e) = &result {
        if !matches!(e, IoError::Miscompare { .. }) {
            tracing::debug!(tag = req.tag, error = %e, "rbd request failed");
        }
    }
    finish(req, result);
}

#[allow(clippy::boxed_local)] // the request arrives boxed from librbd
fn finish(req: Box<AioRequest>, result: Result<(), IoError>) {
    let AioRequest {
        tag,
        op,
        completion,
        gate,
        device,
        started,
        ..
    } = *req;
    device.deliver(started, &completion, tag, op, result);
    device.op_finished(started);
    if let Some(gate) = gate {
        gate.write_done();
    }
}

/// Hands a request to librbd; a request librbd refuses completes with the error.
pub(super) fn start(req: Box<AioRequest>) {
    if req.device.client.is_blocklisted() {
        // Queued behind the gate before the fence was seen: never sent.
        req.device.fenced();
        return finish(req, Err(IoError::Fenced("client blocklisted".into())));
    }
    if let Err((req, e)) = ffi::submit(req) {
        tracing::warn!(tag = req.tag, "cannot start an rbd request: {e}");
        let err = match e.errno() {
            Some(ESHUTDOWN) => {
                req.device.fenced();
                IoError::Fenced(e.to_string())
            }
            _ => IoError::Device(e.to_string()),
        };
        finish(req, Err(err));
    }
}

impl BlockDevice for RbdDevice {
    fn name(&self) -> &str {
        &self.state.name
    }

    fn size_bytes(&self) -> u64 {
        self.state.size.load(Ordering::SeqCst)
    }

    fn submit(&self, tag: u64, op: IoOp, completion: &Arc<dyn IoCompletion>) {
        let started = Instant::now();
        if self.state.client.is_blocklisted() {
            // Fenced: nothing goes through this client again, not even a read.
            self.state.fenced();
            return self.state.deliver(
                started,
                completion,
                tag,
                op,
                Err(IoError::Fenced("client blocklisted".into())),
            );
        }
        if let Err(e) = self.precheck(&op) {
            return self.state.deliver(started, completion, tag, op, Err(e));
        }
        let empty = match &op {
            IoOp::Read { buf, .. } | IoOp::Write { buf, .. } => buf.is_empty(),
            IoOp::Discard { len, .. } | IoOp::WriteZeroes { len, .. } => *len == 0,
            IoOp::CompareAndWrite { write, .. } => write.is_empty(),
            IoOp::Flush | IoOp::StoreRecord { .. } => false,
        };
        if empty {
            return self.state.deliver(started, completion, tag, op, Ok(()));
        }
        // Counted down when the completion has been delivered (`finish`, the caw worker,
        // the records thread).
        self.state.op_started(started);
        if let IoOp::StoreRecord { .. } = &op {
            let job = RecordJob {
                state: self.state.clone(),
                object: record_object(&self.spec.image),
                started,
                tag,
                op,
                completion: completion.clone(),
            };
            let sent = match RECORDS.get_or_init(start_records_thread) {
                Some(tx) => tx
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .send(job)
                    .map_err(|e| e.0),
                None => Err(job),
            };
            if let Err(job) = sent {
                job.state.deliver(
                    job.started,
                    &job.completion,
                    job.tag,
                    job.op,
                    Err(IoError::Device("no rbd-records thread".into())),
                );
                self.state.op_finished(started);
            }
            return;
        }
        if let IoOp::CompareAndWrite { offset, write, .. } = &op {
            if !native_compare_and_write(*offset, write.len() as u64) {
                let job = CawJob {
                    state: self.state.clone(),
                    started,
                    tag,
                    op,
                    completion: completion.clone(),
                };
                if let Some(job) = self.state.gate.admit_caw(job) {
                    spawn_caw(job);
                }
                return;
            }
        }
        let is_write = matches!(
            op,
            IoOp::Write { .. }
                | IoOp::Discard { .. }
                | IoOp::WriteZeroes { .. }
                | IoOp::CompareAndWrite { .. }
        );
        let req = Box::new(AioRequest {
            image: self.state.image.clone(),
            tag,
            op,
            completion: completion.clone(),
            action: AioAction::Op,
            mismatch_off: 0,
            on_done: on_aio_done,
            gate: is_write.then(|| self.state.gate.clone()),
            device: self.state.clone(),
            started,
        });
        if is_write {
            if let Some(req) = self.state.gate.admit_write(req) {
                start(req);
            }
        } else {
            start(req);
        }
    }

    fn set_event_sink(&self, sink: Arc<dyn DeviceEventSink>) {
        *self.state.sink.lock().unwrap_or_else(|e| e.into_inner()) = Some(sink);
    }

    fn in_flight(&self) -> usize {
        self.state.in_flight.load(Ordering::SeqCst)
    }

    fn has_op_older_than(&self, now: Instant, age: Duration) -> bool {
        self.state.ages.any_older_than(now, age)
    }

    fn io_stats(&self) -> Option<IoStatsSnapshot> {
        Some(self.state.stats.snapshot())
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn load_record(&self, key: &str) -> Result<Option<Vec<u8>>, IoError> {
        if self.state.client.is_blocklisted() {
            return Err(IoError::Fenced("client blocklisted".into()));
        }
        self.state
            .image
            .load_record(&record_object(&self.spec.image), key)
            .map_err(|e| record_error("load", &self.state, &e))
    }
}
