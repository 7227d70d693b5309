//! RADOS objects for the gateway group's state (`crate::rados`): mon commands, omap, locks,
//! watches and notifies.

#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::null_mut;
use std::sync::Arc;
use std::time::Duration;

use super::sys::{self, rados_ioctx_t, CephLib};
use super::{check, cstring, libc_e2big, strerror, FfiError, IoCtx, Rados};

/// A buffer librados allocated (`rados_buffer_free` releases it).
fn take_buffer(lib: &CephLib, ptr: *mut c_char, len: usize) -> Vec<u8> {
    if ptr.is_null() {
        return Vec::new();
    }
    // SAFETY: librados returned `len` readable bytes at `ptr`; freed exactly once here.
    let v = unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) }.to_vec();
    // SAFETY: allocated by librados for the caller.
    unsafe { lib.rados_buffer_free(ptr) };
    v
}

/// What a mon (or OSD) command answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MonReply {
    /// 0 or a negative errno.
    pub rc: i32,
    pub out: Vec<u8>,
    pub status: String,
}

impl MonReply {
    /// The reply of a mon or OSD command: its return code and the two buffers librados
    /// allocated for the output and the status text (released here).
    fn take(
        lib: &CephLib,
        rc: c_int,
        (out, out_len): (*mut c_char, usize),
        (st, st_len): (*mut c_char, usize),
    ) -> MonReply {
        let out = take_buffer(lib, out, out_len);
        let status = String::from_utf8_lossy(&take_buffer(lib, st, st_len)).into_owned();
        MonReply { rc, out, status }
    }
}

impl Rados {
    /// `rados_getaddrs`: this client's addresses, as `ceph osd blocklist add` takes them
    /// (e.g. `[v2:127.0.0.1:0/3021,v1:127.0.0.1:0/3021]`).
    pub fn getaddrs(&self) -> Result<String, FfiError> {
        let mut out: *mut c_char = null_mut();
        // SAFETY: connected handle, out-pointer.
        check("rados_getaddrs", unsafe {
            self.lib.rados_getaddrs(self.handle, &mut out)
        })?;
        if out.is_null() {
            return Ok(String::new());
        }
        // SAFETY: a NUL-terminated string librados allocated (strdup) for us.
        let s = unsafe { CStr::from_ptr(out) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: rados_buffer_free is free().
        unsafe { self.lib.rados_buffer_free(out) };
        Ok(s)
    }

    /// `rados_get_instance_id`: the client's global ID.
    pub fn instance_id(&self) -> u64 {
        // SAFETY: connected handle.
        unsafe { self.lib.rados_get_instance_id(self.handle) }
    }

    /// `rados_wait_for_latest_osdmap` (blocking): fetches the monitors' latest osdmap.
    pub fn wait_for_latest_osdmap(&self) -> Result<(), FfiError> {
        // SAFETY: connected handle.
        check("rados_wait_for_latest_osdmap", unsafe {
            self.lib.rados_wait_for_latest_osdmap(self.handle)
        })?;
        Ok(())
    }

    /// `rados_mon_command` with one JSON command (blocking).
    pub fn mon_command(&self, cmd: &str, input: &[u8]) -> Result<MonReply, FfiError> {
        let c = cstring("rados_mon_command", cmd)?;
        let mut cmds = [c.as_ptr()];
        let (mut out, mut out_len): (*mut c_char, usize) = (null_mut(), 0);
        let (mut st, mut st_len): (*mut c_char, usize) = (null_mut(), 0);
        // SAFETY: one valid C string; input valid for its length; out-pointers to locals.
        let rc = unsafe {
            self.lib.rados_mon_command(
                self.handle,
                cmds.as_mut_ptr(),
                1,
                input.as_ptr().cast::<c_char>(),
                input.len(),
                &mut out,
                &mut out_len,
                &mut st,
                &mut st_len,
            )
        };
        Ok(MonReply::take(self.lib, rc, (out, out_len), (st, st_len)))
    }

    /// `rados_osd_command` with one JSON command to OSD `osd` (blocking; with no OSD op
    /// timeout configured it waits as long as the OSD does not answer).
    pub fn osd_command(&self, osd: i32, cmd: &str) -> Result<MonReply, FfiError> {
        let c = cstring("rados_osd_command", cmd)?;
        let mut cmds = [c.as_ptr()];
        let (mut out, mut out_len): (*mut c_char, usize) = (null_mut(), 0);
        let (mut st, mut st_len): (*mut c_char, usize) = (null_mut(), 0);
        // SAFETY: one valid C string; no input; out-pointers to locals.
        let rc = unsafe {
            self.lib.rados_osd_command(
                self.handle,
                osd,
                cmds.as_mut_ptr(),
                1,
                std::ptr::null(),
                0,
                &mut out,
                &mut out_len,
                &mut st,
                &mut st_len,
            )
        };
        Ok(MonReply::take(self.lib, rc, (out, out_len), (st, st_len)))
    }

    /// `rados_watch_flush`: waits until no watch callback is running or queued.
    fn watch_flush(&self) {
        // SAFETY: connected handle.
        let rc = unsafe { self.lib.rados_watch_flush(self.handle) };
        if rc < 0 {
            tracing::warn!("rados_watch_flush: {}", strerror(-rc));
        }
    }
}

/// One omap comparison/assignment list entry.
pub type OmapEntry = (String, Vec<u8>);

/// A watch event delivered on a librados thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    /// A notify (already acknowledged) with its payload.
    Notify(Vec<u8>),
    /// The watch broke (errno); re-watch and re-read the object.
    Error(i32),
}

type WatchFn = Box<dyn Fn(WatchEvent) + Send + Sync>;

struct WatchCtx {
    lib: &'static CephLib,
    io: rados_ioctx_t,
    oid: CString,
    callback: WatchFn,
}

/// A registered watch; dropping it unwatches (and waits for running callbacks).
pub struct Watch {
    ioctx: Arc<IoCtx>,
    cookie: u64,
    ctx: *mut WatchCtx,
}

// SAFETY: the context is only read by callbacks (Sync) and freed in Drop after unwatch+flush.
unsafe impl Send for Watch {}
unsafe impl Sync for Watch {}

impl Drop for Watch {
    fn drop(&mut self) {
        // SAFETY: cookie from rados_watch2 on this context.
        let rc = unsafe {
            self.ioctx
                .lib
                .rados_unwatch2(self.ioctx.handle, self.cookie)
        };
        if rc < 0 {
            tracing::debug!("rados_unwatch2: {}", strerror(-rc));
        }
        // No callback may run after this: then the context can go.
        self.ioctx._rados.watch_flush();
        // SAFETY: created by Box::into_raw in IoCtx::watch; librados no longer uses it.
        drop(unsafe { Box::from_raw(self.ctx) });
    }
}

unsafe extern "C" fn watch_callback(
    arg: *mut c_void,
    notify_id: u64,
    cookie: u64,
    _notifier: u64,
    data: *mut c_void,
    len: usize,
) {
    // SAFETY: arg is the WatchCtx registered in IoCtx::watch, alive until Watch::drop, which
    // flushes callbacks before freeing it.
    let ctx = unsafe { &*arg.cast::<WatchCtx>() };
    let payload = if data.is_null() || len == 0 {
        Vec::new()
    } else {
        // SAFETY: librados passes `len` readable bytes for the duration of the call.
        unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }.to_vec()
    };
    // Acknowledge first so the notifier never waits on our processing.
    // SAFETY: the context and object name are alive (see above); an empty reply.
    let rc = unsafe {
        ctx.lib.rados_notify_ack(
            ctx.io,
            ctx.oid.as_ptr(),
            notify_id,
            cookie,
            std::ptr::null(),
            0,
        )
    };
    if rc < 0 {
        tracing::debug!("rados_notify_ack: {}", strerror(-rc));
    }
    if catch_unwind(AssertUnwindSafe(|| {
        (ctx.callback)(WatchEvent::Notify(payload))
    }))
    .is_err()
    {
        tracing::error!("panic in a RADOS watch callback (ignored)");
    }
}

unsafe extern "C" fn watch_error_callback(arg: *mut c_void, _cookie: u64, err: c_int) {
    // SAFETY: as in watch_callback.
    let ctx = unsafe { &*arg.cast::<WatchCtx>() };
    if catch_unwind(AssertUnwindSafe(|| {
        (ctx.callback)(WatchEvent::Error(err.saturating_neg()))
    }))
    .is_err()
    {
        tracing::error!("panic in a RADOS watch error callback (ignored)");
    }
}

impl IoCtx {
    /// One page of an object's omap: up to `max` entries after `start_after` (blocking).
    /// Returns the entries and whether more follow. `-ENOENT`: no such object.
    pub fn omap_get_vals(
        &self,
        oid: &str,
        start_after: &str,
        max: u64,
    ) -> Result<(Vec<OmapEntry>, bool), FfiError> {
        let o = cstring("rados_read_op_operate", oid)?;
        let after = cstring("rados_read_op_omap_get_vals2", start_after)?;
        // SAFETY: plain constructor.
        let op = unsafe { self.lib.rados_create_read_op() };
        if op.is_null() {
            return Err(FfiError::Errno {
                call: "rados_create_read_op",
                errno: 12,
            });
        }
        let mut iter: sys::rados_omap_iter_t = null_mut();
        let mut more: u8 = 0;
        let mut prval: c_int = 0;
        // SAFETY: op is valid; the strings and out-pointers outlive the synchronous operate.
        let rc = unsafe {
            self.lib.rados_read_op_omap_get_vals2(
                op,
                after.as_ptr(),
                c"".as_ptr(),
                max,
                &mut iter,
                &mut more,
                &mut prval,
            );
            self.lib
                .rados_read_op_operate(op, self.handle, o.as_ptr(), 0)
        };
        let mut entries = Vec::new();
        if rc >= 0 && prval >= 0 && !iter.is_null() {
            loop {
                let mut k: *mut c_char = null_mut();
                let mut v: *mut c_char = null_mut();
                let mut len = 0usize;
                // SAFETY: iter from a successful operate; the pointers stay valid until
                // rados_omap_get_end and are copied at once.
                let r = unsafe { self.lib.rados_omap_get_next(iter, &mut k, &mut v, &mut len) };
                if r < 0 || k.is_null() {
                    break;
                }
                // SAFETY: k is NUL-terminated, v has len bytes (or is NULL when len is 0).
                let key = unsafe { CStr::from_ptr(k) }.to_string_lossy().into_owned();
                let val = if v.is_null() || len == 0 {
                    Vec::new()
                } else {
                    unsafe { std::slice::from_raw_parts(v.cast::<u8>(), len) }.to_vec()
                };
                entries.push((key, val));
            }
        }
        // SAFETY: iter (if any) and op are ours, released once.
        unsafe {
            if !iter.is_null() {
                self.lib.rados_omap_get_end(iter);
            }
            self.lib.rados_release_read_op(op);
        }
        check("rados_read_op_operate", rc)?;
        check("rados_read_op_omap_get_vals2", prval)?;
        Ok((entries, more != 0))
    }

    /// One atomic write op on `oid` (blocking): optionally create the object, compare omap
    /// values (all must be equal; a missing key compares as empty), set and remove keys.
    /// `-ECANCELED`: a comparison failed and nothing was written.
    pub fn omap_write(
        &self,
        oid: &str,
        create: Option<bool>,
        cmp: &[OmapEntry],
        set: &[OmapEntry],
        remove: &[String],
    ) -> Result<(), FfiError> {
        let call = "rados_write_op_operate";
        let o = cstring(call, oid)?;
        let cmp_keys: Vec<CString> = cmp
            .iter()
            .map(|(k, _)| cstring(call, k))
            .collect::<Result<_, _>>()?;
        let set_keys: Vec<CString> = set
            .iter()
            .map(|(k, _)| cstring(call, k))
            .collect::<Result<_, _>>()?;
        let rm_keys: Vec<CString> = remove
            .iter()
            .map(|k| cstring(call, k))
            .collect::<Result<_, _>>()?;
        let set_key_ptrs: Vec<*const c_char> = set_keys.iter().map(|k| k.as_ptr()).collect();
        let set_val_ptrs: Vec<*const c_char> = set
            .iter()
            .map(|(_, v)| v.as_ptr().cast::<c_char>())
            .collect();
        let set_lens: Vec<usize> = set.iter().map(|(_, v)| v.len()).collect();
        let rm_ptrs: Vec<*const c_char> = rm_keys.iter().map(|k| k.as_ptr()).collect();
        let mut prvals: Vec<c_int> = vec![0; cmp.len()];
        // SAFETY: plain constructor.
        let op = unsafe { self.lib.rados_create_write_op() };
        if op.is_null() {
            return Err(FfiError::Errno {
                call: "rados_create_write_op",
                errno: 12,
            });
        }
        // SAFETY: op is valid; every pointer (keys, values, lengths, prvals) points into
        // vectors that live until after the synchronous operate and the release.
        let rc = unsafe {
            if let Some(exclusive) = create {
                let mode = if exclusive {
                    sys::LIBRADOS_CREATE_EXCLUSIVE
                } else {
                    sys::LIBRADOS_CREATE_IDEMPOTENT
                };
                self.lib
                    .rados_write_op_create(op, mode as c_int, std::ptr::null());
            }
            for (i, (_, v)) in cmp.iter().enumerate() {
                self.lib.rados_write_op_omap_cmp(
                    op,
                    cmp_keys[i].as_ptr(),
                    sys::LIBRADOS_CMPXATTR_OP_EQ as u8,
                    v.as_ptr().cast::<c_char>(),
                    v.len(),
                    &mut prvals[i],
                );
            }
            if !set.is_empty() {
                self.lib.rados_write_op_omap_set(
                    op,
                    set_key_ptrs.as_ptr(),
                    set_val_ptrs.as_ptr(),
                    set_lens.as_ptr(),
                    set.len(),
                );
            }
            if !remove.is_empty() {
                self.lib
                    .rados_write_op_omap_rm_keys(op, rm_ptrs.as_ptr(), rm_ptrs.len());
            }
            let rc = self.lib.rados_write_op_operate(
                op,
                self.handle,
                o.as_ptr(),
                null_mut(),
                sys::LIBRADOS_OPERATION_NOFLAG as c_int,
            );
            self.lib.rados_release_write_op(op);
            rc
        };
        check(call, rc)?;
        Ok(())
    }

    /// `rados_remove` (blocking).
    pub fn remove_object(&self, oid: &str) -> Result<(), FfiError> {
        let o = cstring("rados_remove", oid)?;
        // SAFETY: valid context and C string.
        check("rados_remove", unsafe {
            self.lib.rados_remove(self.handle, o.as_ptr())
        })?;
        Ok(())
    }

    /// `rados_lock_exclusive` (blocking): `duration` None = until unlocked; `renew` renews a
    /// lock this (name, cookie) holds. `-EBUSY`: another holder; `-EEXIST`: held by us
    /// (without `renew`).
    pub fn lock_exclusive(
        &self,
        oid: &str,
        name: &str,
        cookie: &str,
        description: &str,
        duration: Option<Duration>,
        renew: bool,
    ) -> Result<(), FfiError> {
        let call = "rados_lock_exclusive";
        let (o, n, c, d) = (
            cstring(call, oid)?,
            cstring(call, name)?,
            cstring(call, cookie)?,
            cstring(call, description)?,
        );
        let mut tv = duration.map(|d| sys::timeval {
            tv_sec: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
            tv_usec: i64::from(d.subsec_micros()),
        });
        let tv_ptr = tv.as_mut().map_or(null_mut(), |t| t as *mut sys::timeval);
        let flags = if renew {
            sys::LIBRADOS_LOCK_FLAG_RENEW as u8
        } else {
            0
        };
        // SAFETY: valid context, C strings and (optional) timeval for the synchronous call.
        check(call, unsafe {
            self.lib.rados_lock_exclusive(
                self.handle,
                o.as_ptr(),
                n.as_ptr(),
                c.as_ptr(),
                d.as_ptr(),
                tv_ptr,
                flags,
            )
        })?;
        Ok(())
    }

    /// `rados_unlock` (blocking). `-ENOENT`: not held by (name, cookie).
    pub fn unlock(&self, oid: &str, name: &str, cookie: &str) -> Result<(), FfiError> {
        let call = "rados_unlock";
        let (o, n, c) = (
            cstring(call, oid)?,
            cstring(call, name)?,
            cstring(call, cookie)?,
        );
        // SAFETY: valid context and C strings.
        check(call, unsafe {
            self.lib
                .rados_unlock(self.handle, o.as_ptr(), n.as_ptr(), c.as_ptr())
        })?;
        Ok(())
    }

    /// `rados_watch2` (blocking): `callback` runs on a librados thread for every notify
    /// (acknowledged before it runs) and when the watch breaks. It must not block.
    pub fn watch(self: &Arc<Self>, oid: &str, callback: WatchFn) -> Result<Watch, FfiError> {
        let o = cstring("rados_watch2", oid)?;
        let ctx = Box::into_raw(Box::new(WatchCtx {
            lib: self.lib,
            io: self.handle,
            oid: o.clone(),
            callback,
        }));
        let mut cookie = 0u64;
        // SAFETY: ctx stays valid until Watch::drop (unwatch + flush); o outlives the call.
        let rc = unsafe {
            self.lib.rados_watch2(
                self.handle,
                o.as_ptr(),
                &mut cookie,
                Some(watch_callback),
                Some(watch_error_callback),
                ctx.cast(),
            )
        };
        if let Err(e) = check("rados_watch2", rc) {
            // SAFETY: librados did not keep ctx.
            drop(unsafe { Box::from_raw(ctx) });
            return Err(e);
        }
        Ok(Watch {
            ioctx: self.clone(),
            cookie,
            ctx,
        })
    }

    /// `rados_notify2` (blocking up to `timeout`): wakes every watcher of `oid`.
    pub fn notify(&self, oid: &str, data: &[u8], timeout: Duration) -> Result<(), FfiError> {
        let o = cstring("rados_notify2", oid)?;
        let len = c_int::try_from(data.len()).map_err(|_| FfiError::Errno {
            call: "rados_notify2",
            errno: libc_e2big(),
        })?;
        let (mut reply, mut reply_len): (*mut c_char, usize) = (null_mut(), 0);
        // SAFETY: valid context, C string, data for len bytes, out-pointers to locals.
        let rc = unsafe {
            self.lib.rados_notify2(
                self.handle,
                o.as_ptr(),
                data.as_ptr().cast::<c_char>(),
                len,
                u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
                &mut reply,
                &mut reply_len,
            )
        };
        drop(take_buffer(self.lib, reply, reply_len));
        check("rados_notify2", rc)?;
        Ok(())
    }
}
