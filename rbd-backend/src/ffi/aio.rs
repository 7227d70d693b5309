//! Asynchronous image I/O: requests leaked into librbd as `cb_arg` and taken back once.

#![allow(unsafe_code)]

use std::ffi::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::null_mut;
use std::sync::Arc;

use crate::device::{IoCompletion, IoOp};

use super::image::IN_CALLBACK;
use super::sys::rbd_completion_t;
use super::{FfiError, Image};

/// What to start for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AioAction {
    /// The op itself: read, write, flush, write-zeroes, compare-and-write.
    Op,
    /// `rbd_aio_flush` (FUA after the write of a `Write { fua: true }`).
    Flush,
}

/// One in-flight request: owns the op (and so its buffers) until librbd completes it.
pub struct AioRequest {
    pub image: Arc<Image>,
    pub tag: u64,
    pub op: IoOp,
    pub completion: Arc<dyn IoCompletion>,
    pub action: AioAction,
    /// Set by librbd on a compare-and-write miscompare.
    pub mismatch_off: u64,
    /// Called on the librbd callback thread with the request and librbd's return value.
    pub on_done: fn(Box<AioRequest>, i64),
    /// For writes: the device's write gate, released when the request finishes.
    pub gate: Option<Arc<crate::rbd::WriteGate>>,
    /// The device the request belongs to: a blocklisted result marks its cluster client (no
    /// further op goes through it) and reports the fence to the device's event sink.
    pub device: Arc<crate::rbd::DeviceState>,
    /// When the op was submitted (for the device's statistics).
    pub started: std::time::Instant,
}

/// Starts `req` on its image. On success `req.on_done` runs later, exactly once, on a librbd
/// thread. On failure the request comes back untouched with the error.
///
/// `Discard` is started as `rbd_aio_write_zeroes`: in librbd 16.2 that is a discard with a
/// granularity of 0 that also zeroes partial objects (whole objects are deallocated), whereas
/// `rbd_aio_discard` skips ranges smaller than `rbd_discard_granularity_bytes` and leaves their
/// old data readable, which NVMe deallocate (reads return zeroes) does not allow.
#[allow(clippy::result_large_err)]
pub fn submit(req: Box<AioRequest>) -> Result<(), (Box<AioRequest>, FfiError)> {
    let lib = req.image.lib;
    let image = req.image.handle;
    if image.is_null() {
        return Err((
            req,
            FfiError::Errno {
                call: "rbd_aio",
                errno: 9, // EBADF
            },
        ));
    }
    let raw = Box::into_raw(req);
    let mut c: rbd_completion_t = null_mut();
    // SAFETY: raw is a leaked Box that the callback (or the error path below) takes back.
    let rc = unsafe { lib.rbd_aio_create_completion(raw.cast(), Some(aio_callback), &mut c) };
    if rc < 0 {
        // SAFETY: librbd did not keep raw.
        let req = unsafe { Box::from_raw(raw) };
        return Err((
            req,
            FfiError::Errno {
                call: "rbd_aio_create_completion",
                errno: -rc,
            },
        ));
    }
    // Everything librbd needs, taken from the request before the call: once the rbd_aio_*
    // call is made the callback may run (and free the request) on another thread, so no
    // reference into *raw is alive across it. The buffers are heap allocations owned by the
    // request, so these pointers stay valid until the callback.
    enum Call {
        Flush,
        Read(u64, usize, *mut c_char),
        Write(u64, usize, *const c_char),
        Zeroes(u64, usize),
        CompareAndWrite(u64, usize, *const c_char, *const c_char, *mut u64),
        TooLong,
        /// A record store is no librbd AIO (the device runs it on its records thread).
        NotAio,
    }
    let call = {
        // SAFETY: raw is valid and not yet shared with librbd.
        let r = unsafe { &mut *raw };
        let mismatch: *mut u64 = &mut r.mismatch_off;
        if r.action == AioAction::Flush {
            Call::Flush
        } else {
            match &mut r.op {
                IoOp::Read { offset, buf } => Call::Read(
                    *offset,
                    buf.len(),
                    buf.as_mut_slice().as_mut_ptr().cast::<c_char>(),
                ),
                IoOp::Write { offset, buf, .. } => {
                    Call::Write(*offset, buf.len(), buf.as_slice().as_ptr().cast::<c_char>())
                }
                IoOp::Flush => Call::Flush,
                IoOp::Discard { offset, len } | IoOp::WriteZeroes { offset, len } => {
                    match usize::try_from(*len) {
                        Ok(len) => Call::Zeroes(*offset, len),
                        Err(_) => Call::TooLong,
                    }
                }
                IoOp::CompareAndWrite {
                    offset,
                    compare,
                    write,
                } => Call::CompareAndWrite(
                    *offset,
                    write.len().min(compare.len()),
                    compare.as_slice().as_ptr().cast::<c_char>(),
                    write.as_slice().as_ptr().cast::<c_char>(),
                    mismatch,
                ),
                IoOp::StoreRecord { .. } => Call::NotAio,
            }
        }
    };
    // SAFETY: c is a fresh completion, image an open handle kept open by the request's
    // Arc<Image>, and the pointers are valid as described above.
    let (call, rc): (&'static str, i64) = unsafe {
        match call {
            Call::Flush => ("rbd_aio_flush", i64::from(lib.rbd_aio_flush(image, c))),
            Call::Read(off, len, ptr) => (
                "rbd_aio_read",
                i64::from(lib.rbd_aio_read(image, off, len, ptr, c)),
            ),
            Call::Write(off, len, ptr) => (
                "rbd_aio_write",
                i64::from(lib.rbd_aio_write(image, off, len, ptr, c)),
            ),
            Call::Zeroes(off, len) => (
                "rbd_aio_write_zeroes",
                i64::from(lib.rbd_aio_write_zeroes(image, off, len, c, 0, 0)),
            ),
            Call::CompareAndWrite(off, len, cmp, data, mismatch) => (
                "rbd_aio_compare_and_write",
                lib.rbd_aio_compare_and_write(image, off, len, cmp, data, c, mismatch, 0) as i64,
            ),
            Call::TooLong => ("rbd_aio_write_zeroes", -22),
            Call::NotAio => ("rbd_aio (record store)", -22),
        }
    };
    if rc < 0 {
        // librbd 16.2 reports errors through the completion and returns 0 here; a negative
        // return means it did not take the completion, so the callback will not run.
        // SAFETY: c is ours again; raw was not handed to a running callback.
        let req = unsafe {
            lib.rbd_aio_release(c);
            Box::from_raw(raw)
        };
        let errno = i32::try_from(rc.saturating_neg()).unwrap_or(5);
        return Err((req, FfiError::Errno { call, errno }));
    }
    Ok(())
}

unsafe extern "C" fn aio_callback(c: rbd_completion_t, arg: *mut c_void) {
    // SAFETY: arg is the request leaked in submit(); librbd calls this exactly once.
    let req = unsafe { Box::from_raw(arg.cast::<AioRequest>()) };
    let lib = req.image.lib;
    // SAFETY: c is the completion created for this request; released exactly once, here.
    let rv = unsafe {
        let rv = lib.rbd_aio_get_return_value(c);
        lib.rbd_aio_release(c);
        rv
    } as i64;
    let previous = IN_CALLBACK.with(|f| f.replace(true));
    let on_done = req.on_done;
    if catch_unwind(AssertUnwindSafe(move || on_done(req, rv))).is_err() {
        tracing::error!("panic while completing an rbd request (the request is lost)");
    }
    IN_CALLBACK.with(|f| f.set(previous));
}
