//! Compare-and-write: natively where librbd 16.2 can, otherwise emulated (read, compare,
//! write) behind the exclusive lock and the device's [`WriteGate`].

use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::device::{start, DeviceState};
use super::{EINVAL, EROFS, ESHUTDOWN};
use crate::device::{IoCompletion, IoError, IoOp};
use crate::ffi::AioRequest;

/// The largest aligned range librbd 16.2 compare-and-writes natively.
const CAW_SECTOR: u64 = 512;

/// Whether librbd 16.2 does this compare-and-write itself: `rbd_aio_compare_and_write` is
/// atomic on the OSD (cmpext + write in one RADOS transaction) but refuses (-EINVAL) any
/// range with `offset % 512 + len > 512`.
pub(super) fn native_compare_and_write(offset: u64, len: u64) -> bool {
    offset % CAW_SECTOR + len <= CAW_SECTOR
}

/// Orders writes against emulated compare-and-writes on one device.
///
/// A compare-and-write that librbd 16.2 cannot do natively (more than one 512-byte sector,
/// e.g. one 4 KiB block) is done as read, compare, write, and is atomic because:
/// - against other clients: the device first takes the image's exclusive lock in exclusive
///   mode (`rbd_lock_acquire`) and keeps it until the image is closed. librbd then refuses to
///   hand the lock to another client, whose writes fail (EROFS) instead of interleaving.
///   (An image without the exclusive-lock feature has no such guard; this is logged once and
///   the compare-and-write is then atomic only against I/O through this gateway.)
/// - against this gateway's own I/O: this gate. Writes (write, discard, write zeroes, native
///   compare-and-write) count themselves in while no emulated compare-and-write runs; an
///   emulated one starts only when no write is in flight, and writes arriving meanwhile queue
///   behind it in arrival order. Reads and flushes are not gated.
///
/// Nothing here blocks the submitting thread: queued ops are started by whichever completion
/// opens the gate. The read-compare-write itself runs on an `rbd-caw` thread (one per running
/// compare-and-write; at most one per device at a time) with synchronous librbd calls.
#[derive(Default)]
pub struct WriteGate {
    state: Mutex<GateState>,
}

#[derive(Default)]
struct GateState {
    writes_in_flight: usize,
    caw_running: bool,
    queue: std::collections::VecDeque<Queued>,
}

enum Queued {
    Write(Box<AioRequest>),
    Caw(CawJob),
}

pub(super) struct CawJob {
    pub(super) state: Arc<DeviceState>,
    pub(super) started: Instant,
    pub(super) tag: u64,
    pub(super) op: IoOp,
    pub(super) completion: Arc<dyn IoCompletion>,
}

impl WriteGate {
    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Returns the request if it may start now; otherwise it is queued.
    pub(super) fn admit_write(&self, req: Box<AioRequest>) -> Option<Box<AioRequest>> {
        let mut g = self.lock();
        if g.caw_running || !g.queue.is_empty() {
            g.queue.push_back(Queued::Write(req));
            return None;
        }
        g.writes_in_flight += 1;
        Some(req)
    }

    pub(super) fn admit_caw(&self, job: CawJob) -> Option<CawJob> {
        let mut g = self.lock();
        if g.caw_running || g.writes_in_flight > 0 || !g.queue.is_empty() {
            g.queue.push_back(Queued::Caw(job));
            return None;
        }
        g.caw_running = true;
        Some(job)
    }

    pub(super) fn write_done(&self) {
        let ready = {
            let mut g = self.lock();
            g.writes_in_flight = g.writes_in_flight.saturating_sub(1);
            Self::pump(&mut g)
        };
        Self::run(ready);
    }

    fn caw_done(&self) {
        let ready = {
            let mut g = self.lock();
            g.caw_running = false;
            Self::pump(&mut g)
        };
        Self::run(ready);
    }

    /// Takes from the queue what may start now (in order), marking it started.
    fn pump(g: &mut GateState) -> Vec<Queued> {
        let mut ready = Vec::new();
        while let Some(front) = g.queue.front() {
            match front {
                Queued::Write(_) if !g.caw_running => {
                    g.writes_in_flight += 1;
                }
                Queued::Caw(_) if !g.caw_running && g.writes_in_flight == 0 => {
                    g.caw_running = true;
                }
                _ => break,
            }
            if let Some(q) = g.queue.pop_front() {
                ready.push(q);
            }
        }
        ready
    }

    /// Starts what `pump` released, outside the lock (a failed start completes at once and
    /// may come back here).
    fn run(ready: Vec<Queued>) {
        for q in ready {
            match q {
                Queued::Write(req) => start(req),
                Queued::Caw(job) => spawn_caw(job),
            }
        }
    }
}

pub(super) fn spawn_caw(job: CawJob) {
    // The closure owns the job; if the spawn fails it is dropped with the closure, so the
    // op is completed from a guard instead.
    struct Guard(Option<CawJob>);
    impl Drop for Guard {
        fn drop(&mut self) {
            if let Some(job) = self.0.take() {
                let gate = job.state.gate.clone();
                job.state.deliver(
                    job.started,
                    &job.completion,
                    job.tag,
                    job.op,
                    Err(IoError::Device(
                        "compare-and-write: could not start its worker thread".into(),
                    )),
                );
                job.state.op_finished(job.started);
                gate.caw_done();
            }
        }
    }
    let mut guard = Guard(Some(job));
    let spawned = std::thread::Builder::new()
        .name("rbd-caw".into())
        .spawn(move || {
            if let Some(job) = guard.0.take() {
                let CawJob {
                    state,
                    started,
                    tag,
                    mut op,
                    completion,
                } = job;
                let result = if state.client.is_blocklisted() {
                    Err(IoError::Fenced("client blocklisted".into()))
                } else {
                    emulate_compare_and_write(&state, &mut op)
                };
                if matches!(result, Err(IoError::Fenced(_))) {
                    state.fenced();
                }
                state.deliver(started, &completion, tag, op, result);
                state.op_finished(started);
                state.gate.caw_done();
            }
        });
    if let Err(e) = spawned {
        tracing::error!("cannot spawn an rbd-caw thread: {e}");
    }
}

/// Read, compare, write, with the gate closed (see [`WriteGate`]). Blocking.
fn emulate_compare_and_write(state: &DeviceState, op: &mut IoOp) -> Result<(), IoError> {
    let IoOp::CompareAndWrite {
        offset,
        compare,
        write,
    } = op
    else {
        return Err(IoError::Device("not a compare-and-write".into()));
    };
    {
        let mut lock = state.caw_lock.lock().unwrap_or_else(|e| e.into_inner());
        if lock.is_none() {
            match state.image.acquire_exclusive_lock() {
                Ok(()) => {
                    tracing::info!(
                        image = %state.name,
                        "took the exclusive lock for multi-sector compare-and-write (held until the image closes; other clients' writes get EROFS)"
                    );
                    *lock = Some(true);
                }
                Err(e) if e.errno() == Some(EINVAL) => {
                    tracing::warn!(
                        image = %state.name,
                        "image has no exclusive-lock feature: multi-sector compare-and-write is atomic only against I/O through this gateway"
                    );
                    *lock = Some(false);
                }
                Err(e) => {
                    return Err(IoError::Device(format!(
                        "compare-and-write: cannot take the exclusive lock: {e}"
                    )));
                }
            }
        }
    }
    let mut current = vec![0u8; compare.len()];
    let n = state
        .image
        .read_blocking(*offset, &mut current)
        .map_err(|e| match e.errno() {
            Some(ESHUTDOWN) => IoError::Fenced(format!("compare-and-write (read): {e}")),
            _ => IoError::Device(format!("compare-and-write (read): {e}")),
        })?;
    if n != current.len() {
        return Err(IoError::Device(format!(
            "compare-and-write (read): {n} of {} bytes",
            current.len()
        )));
    }
    if let Some(i) = current
        .iter()
        .zip(compare.as_slice())
        .position(|(a, b)| a != b)
    {
        return Err(IoError::Miscompare {
            offset_in_range: i as u64,
        });
    }
    let n = state
        .image
        .write_blocking(*offset, write.as_slice())
        .map_err(|e| match e.errno() {
            Some(EROFS) => IoError::ReadOnly,
            Some(ESHUTDOWN) => IoError::Fenced(format!("compare-and-write (write): {e}")),
            _ => IoError::Device(format!("compare-and-write (write): {e}")),
        })?;
    if n != write.len() {
        return Err(IoError::Device(format!(
            "compare-and-write (write): {n} of {} bytes",
            write.len()
        )));
    }
    Ok(())
}
