//! Open RBD images (`rbd_image_t`): size, resize watches, and closing off the caller's thread.

#![allow(unsafe_code)]

use std::cell::Cell;
use std::ffi::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::null_mut;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::sys::{self, rbd_image_t, CephLib};
use super::{check, check_size, cstring, strerror, FfiError, IoCtx};

thread_local! {
    /// Set while a librbd callback runs on this thread: closing an image here would wait for
    /// this very callback to return.
    pub(super) static IN_CALLBACK: Cell<bool> = const { Cell::new(false) };
}

struct WatchState {
    handle: u64,
    /// Boxed twice so that `cb_arg` is a thin pointer.
    callback: *mut Box<dyn Fn() + Send + Sync>,
}

/// An open RBD image (`rbd_image_t`). Dropping it closes the image on a background thread
/// (`rbd_close` flushes and waits for in-flight I/O, which must not stall the dropping
/// thread); [`wait_for_closes`] waits for those.
pub struct Image {
    pub(super) lib: &'static CephLib,
    pub(super) handle: rbd_image_t,
    watch: Mutex<Option<WatchState>>,
    ioctx: Option<Arc<IoCtx>>,
}

// SAFETY: librbd image handles are used from many threads at once by design (librbd locks
// internally); the watch state is behind a Mutex.
unsafe impl Send for Image {}
unsafe impl Sync for Image {}

impl Image {
    /// `rbd_open` (blocking: reads the header, may wait for the cluster).
    pub fn open(ioctx: &Arc<IoCtx>, name: &str) -> Result<Image, FfiError> {
        let n = cstring("rbd_open", name)?;
        let mut handle: rbd_image_t = null_mut();
        // SAFETY: valid context, C string, out-pointer; NULL snapshot = the head.
        check("rbd_open", unsafe {
            ioctx
                .lib
                .rbd_open(ioctx.handle, n.as_ptr(), &mut handle, std::ptr::null())
        })?;
        Ok(Image {
            lib: ioctx.lib,
            handle,
            watch: Mutex::new(None),
            ioctx: Some(ioctx.clone()),
        })
    }

    /// `rbd_get_size`. Synchronous: may refresh the header from the cluster, so never call
    /// it from a librbd callback.
    pub fn size(&self) -> Result<u64, FfiError> {
        let mut size = 0u64;
        // SAFETY: open image, out-pointer.
        check("rbd_get_size", unsafe {
            self.lib.rbd_get_size(self.handle, &mut size)
        })?;
        Ok(size)
    }

    /// The RADOS object size (bytes per backing object, e.g. 4 MiB).
    pub fn object_size(&self) -> Result<u64, FfiError> {
        // SAFETY: plain-old-data struct, all-zero is a valid value.
        let mut info: sys::rbd_image_info_t = unsafe { std::mem::zeroed() };
        // SAFETY: open image, out-pointer with the size librbd expects.
        check("rbd_stat", unsafe {
            self.lib.rbd_stat(
                self.handle,
                &mut info,
                std::mem::size_of::<sys::rbd_image_info_t>(),
            )
        })?;
        Ok(info.obj_size)
    }

    /// Stores `value` under `key` in the omap of RADOS object `object` of the image's pool
    /// and namespace, creating the object if needed (blocking, one atomic write op). It goes
    /// through the image's own cluster client: once that client is blocklisted, the OSDs
    /// refuse it (errno 108, ESHUTDOWN/EBLOCKLISTED) and nothing is stored.
    pub fn store_record(&self, object: &str, key: &str, value: &[u8]) -> Result<(), FfiError> {
        let ioctx = self.ioctx.as_ref().ok_or(FfiError::Errno {
            call: "rados_write_op_operate",
            errno: 9, // EBADF: an image without its I/O context (never, once open)
        })?;
        ioctx.omap_write(
            object,
            Some(false),
            &[],
            &[(key.to_string(), value.to_vec())],
            &[],
        )
    }

    /// The value [`Self::store_record`] stored under `key` in `object` (blocking); `None`
    /// when the object or the key does not exist.
    pub fn load_record(&self, object: &str, key: &str) -> Result<Option<Vec<u8>>, FfiError> {
        let ioctx = self.ioctx.as_ref().ok_or(FfiError::Errno {
            call: "rados_read_op_operate",
            errno: 9,
        })?;
        let mut after = String::new();
        loop {
            let (entries, more) = match ioctx.omap_get_vals(object, &after, 64) {
                Ok(page) => page,
                Err(e) if e.errno() == Some(2) => return Ok(None), // ENOENT: no object
                Err(e) => return Err(e),
            };
            if let Some((_, value)) = entries.iter().find(|(k, _)| k == key) {
                return Ok(Some(value.clone()));
            }
            match entries.last() {
                Some((last, _)) if more => after = last.clone(),
                _ => return Ok(None),
            }
        }
    }

    /// `rbd_resize` (blocking; used by tests and tools, the gateway never resizes).
    pub fn resize(&self, size: u64) -> Result<(), FfiError> {
        // SAFETY: open image.
        check("rbd_resize", unsafe {
            self.lib.rbd_resize(self.handle, size)
        })?;
        Ok(())
    }

    /// Synchronous `rbd_read` of `buf.len()` bytes (blocking; never on a runtime thread or in
    /// a callback). Returns the bytes read.
    pub fn read_blocking(&self, offset: u64, buf: &mut [u8]) -> Result<usize, FfiError> {
        // SAFETY: open image; buf is valid for buf.len() bytes for the whole call.
        let rc = unsafe {
            self.lib.rbd_read(
                self.handle,
                offset,
                buf.len(),
                buf.as_mut_ptr().cast::<c_char>(),
            )
        };
        check_size("rbd_read", rc)
    }

    /// Synchronous `rbd_write` (blocking, like [`Image::read_blocking`]).
    pub fn write_blocking(&self, offset: u64, data: &[u8]) -> Result<usize, FfiError> {
        // SAFETY: open image; data is valid for data.len() bytes for the whole call.
        let rc = unsafe {
            self.lib.rbd_write(
                self.handle,
                offset,
                data.len(),
                data.as_ptr().cast::<c_char>(),
            )
        };
        check_size("rbd_write", rc)
    }

    /// `rbd_lock_acquire(RBD_LOCK_MODE_EXCLUSIVE)` (blocking): this handle becomes the
    /// exclusive-lock owner and refuses to hand the lock over until the image is closed, so
    /// no other client writes meanwhile (their writes fail with EROFS). `-EINVAL`: the image
    /// has no exclusive-lock feature.
    pub fn acquire_exclusive_lock(&self) -> Result<(), FfiError> {
        // SAFETY: open image.
        check("rbd_lock_acquire", unsafe {
            self.lib
                .rbd_lock_acquire(self.handle, sys::rbd_lock_mode_t::RBD_LOCK_MODE_EXCLUSIVE)
        })?;
        Ok(())
    }

    /// Registers `callback` for header updates (`rbd_update_watch`), replacing an earlier
    /// one. It runs on a librbd thread: it must not block or call librbd synchronously.
    pub fn update_watch(&self, callback: Box<dyn Fn() + Send + Sync>) -> Result<(), FfiError> {
        let mut watch = self.watch.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = watch.take() {
            self.unwatch(old);
        }
        let arg = Box::into_raw(Box::new(callback));
        let mut handle = 0u64;
        // SAFETY: `arg` stays valid until unwatch() returned (which waits for running
        // callbacks), then it is freed.
        let rc = unsafe {
            self.lib
                .rbd_update_watch(self.handle, &mut handle, Some(update_callback), arg.cast())
        };
        if let Err(e) = check("rbd_update_watch", rc) {
            // SAFETY: librbd did not keep the pointer.
            drop(unsafe { Box::from_raw(arg) });
            return Err(e);
        }
        *watch = Some(WatchState {
            handle,
            callback: arg,
        });
        Ok(())
    }

    fn unwatch(&self, state: WatchState) {
        // SAFETY: handle from rbd_update_watch; librbd waits for in-flight callbacks before
        // returning, so freeing the callback afterwards is safe.
        let rc = unsafe { self.lib.rbd_update_unwatch(self.handle, state.handle) };
        if rc < 0 {
            // The callback may still be referenced: leak it rather than risk a dangling call.
            tracing::warn!(
                errno = -rc,
                "rbd_update_unwatch failed; leaking the callback"
            );
            return;
        }
        // SAFETY: created by Box::into_raw in update_watch, no longer referenced by librbd.
        drop(unsafe { Box::from_raw(state.callback) });
    }

    /// Closes now, on this thread (blocking). Used by the background closer.
    fn close_blocking(&mut self) {
        let watch = self
            .watch
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(w) = watch {
            self.unwatch(w);
        }
        if !self.handle.is_null() {
            // SAFETY: open handle; no request holds it (each holds an Arc<Image>).
            let rc = unsafe { self.lib.rbd_close(self.handle) };
            if rc < 0 {
                tracing::warn!("rbd_close: {}", strerror(-rc));
            }
            self.handle = null_mut();
        }
        self.ioctx = None;
    }
}

unsafe extern "C" fn update_callback(arg: *mut c_void) {
    // SAFETY: arg is the Box<Box<dyn Fn>> registered in update_watch, alive until unwatch.
    let callback = unsafe { &*arg.cast::<Box<dyn Fn() + Send + Sync>>() };
    let previous = IN_CALLBACK.with(|f| f.replace(true));
    if catch_unwind(AssertUnwindSafe(callback)).is_err() {
        tracing::error!("panic in the rbd update-watch callback (ignored)");
    }
    IN_CALLBACK.with(|f| f.set(previous));
}

/// Closes images in the background and counts closes still running.
struct Closer {
    pending: Mutex<usize>,
    done: Condvar,
}

static CLOSER: Closer = Closer {
    pending: Mutex::new(0),
    done: Condvar::new(),
};

impl Drop for Image {
    fn drop(&mut self) {
        if self.handle.is_null() {
            return;
        }
        // Move the handle into a fresh Image that a closer thread owns.
        let moved = Image {
            lib: self.lib,
            handle: std::mem::replace(&mut self.handle, null_mut()),
            watch: Mutex::new(
                self.watch
                    .get_mut()
                    .unwrap_or_else(|e| e.into_inner())
                    .take(),
            ),
            ioctx: self.ioctx.take(),
        };
        *CLOSER.pending.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        let spawned = std::thread::Builder::new()
            .name("rbd-close".into())
            .spawn(move || {
                let mut image = moved;
                image.close_blocking();
                drop(image);
                let mut n = CLOSER.pending.lock().unwrap_or_else(|e| e.into_inner());
                *n = n.saturating_sub(1);
                CLOSER.done.notify_all();
            });
        if let Err(e) = spawned {
            // No thread to close on: leak the handle (librbd cleans up at process exit; the
            // exclusive lock expires with the watch) rather than block or crash here.
            tracing::error!("cannot spawn an rbd-close thread ({e}); image left open");
            let mut n = CLOSER.pending.lock().unwrap_or_else(|e| e.into_inner());
            *n = n.saturating_sub(1);
        }
    }
}

/// Waits until every image dropped so far is closed (exclusive locks released, watches gone),
/// at most `timeout`. Returns whether all closes finished. Call at shutdown.
pub fn wait_for_closes(timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    let mut n = CLOSER.pending.lock().unwrap_or_else(|e| e.into_inner());
    while *n > 0 {
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        n = CLOSER
            .done
            .wait_timeout(n, deadline - now)
            .map(|(g, _)| g)
            .unwrap_or_else(|e| e.into_inner().0);
    }
    true
}
