//! Cluster connections (`rados_t`) and pool contexts (`rados_ioctx_t`).

#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, CStr};
use std::ptr::null_mut;
use std::sync::Arc;

use super::sys::{rados_ioctx_t, rados_t, CephLib};
use super::{check, cstring, lib, libc_e2big, FfiError};

/// One cluster connection (`rados_t`): its own messenger, threads and sessions.
pub struct Rados {
    pub(super) lib: &'static CephLib,
    pub(super) handle: rados_t,
    connected: bool,
}

// SAFETY: librados handles are documented thread-safe once configured; the configuration
// methods take `&mut self`, so they cannot race with anything.
unsafe impl Send for Rados {}
unsafe impl Sync for Rados {}

impl Rados {
    /// `rados_create2(cluster_name, client_name)`; `client_name` is the full entity name
    /// (`client.admin`).
    pub fn create(cluster_name: &str, client_name: &str) -> Result<Rados, FfiError> {
        let lib = lib()?;
        let cluster = cstring("rados_create2", cluster_name)?;
        let name = cstring("rados_create2", client_name)?;
        let mut handle: rados_t = null_mut();
        // SAFETY: valid C strings and out-pointer.
        check("rados_create2", unsafe {
            lib.rados_create2(&mut handle, cluster.as_ptr(), name.as_ptr(), 0)
        })?;
        Ok(Rados {
            lib,
            handle,
            connected: false,
        })
    }

    /// Reads a ceph.conf; `None` = Ceph's default search list (honours `$CEPH_CONF`).
    pub fn conf_read_file(&mut self, path: Option<&str>) -> Result<(), FfiError> {
        let path = path
            .map(|p| cstring("rados_conf_read_file", p))
            .transpose()?;
        let ptr = path.as_ref().map_or(std::ptr::null(), |p| p.as_ptr());
        // SAFETY: NULL or a valid C string.
        check("rados_conf_read_file", unsafe {
            self.lib.rados_conf_read_file(self.handle, ptr)
        })?;
        Ok(())
    }

    /// Applies `$CEPH_ARGS`.
    pub fn conf_parse_env(&mut self) -> Result<(), FfiError> {
        // SAFETY: NULL selects CEPH_ARGS.
        check("rados_conf_parse_env", unsafe {
            self.lib.rados_conf_parse_env(self.handle, std::ptr::null())
        })?;
        Ok(())
    }

    /// Parses command-line style options (`--rbd_cache=false`, `--id admin`). Returns the
    /// arguments Ceph did not recognise.
    pub fn conf_parse_argv(&mut self, args: &[String]) -> Result<Vec<String>, FfiError> {
        // argv[0] is skipped by librados, like a program name.
        let mut owned = vec![cstring("rados_conf_parse_argv", "nvmeof-gateway")?];
        for a in args {
            owned.push(cstring("rados_conf_parse_argv", a)?);
        }
        let mut argv: Vec<*const c_char> = owned.iter().map(|s| s.as_ptr()).collect();
        let mut remainder: Vec<*const c_char> = vec![std::ptr::null(); argv.len() + 1];
        let argc = c_int::try_from(argv.len()).map_err(|_| FfiError::Errno {
            call: "rados_conf_parse_argv",
            errno: libc_e2big(),
        })?;
        // SAFETY: argv holds argc valid C strings that outlive the call; remainder has room
        // for argc pointers (librados writes the unparsed ones and a NULL after them).
        check("rados_conf_parse_argv", unsafe {
            self.lib.rados_conf_parse_argv_remainder(
                self.handle,
                argc,
                argv.as_mut_ptr(),
                remainder.as_mut_ptr(),
            )
        })?;
        let mut unknown = Vec::new();
        for &p in remainder.iter().skip(1) {
            if p.is_null() {
                break;
            }
            // SAFETY: librados stores pointers taken from our argv, still alive.
            unknown.push(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned());
        }
        Ok(unknown)
    }

    /// `rados_conf_set`: one option (`-ENOENT` for an unknown name).
    pub fn conf_set(&mut self, option: &str, value: &str) -> Result<(), FfiError> {
        let o = cstring("rados_conf_set", option)?;
        let v = cstring("rados_conf_set", value)?;
        // SAFETY: valid C strings.
        check("rados_conf_set", unsafe {
            self.lib.rados_conf_set(self.handle, o.as_ptr(), v.as_ptr())
        })?;
        Ok(())
    }

    /// The current value of an option.
    pub fn conf_get(&self, option: &str) -> Result<String, FfiError> {
        let o = cstring("rados_conf_get", option)?;
        let mut buf = vec![0u8; 4096];
        // SAFETY: buf has buf.len() writable bytes; librados NUL-terminates within them.
        check("rados_conf_get", unsafe {
            self.lib.rados_conf_get(
                self.handle,
                o.as_ptr(),
                buf.as_mut_ptr().cast::<c_char>(),
                buf.len(),
            )
        })?;
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
    }

    /// Connects (blocks up to `client_mount_timeout`).
    pub fn connect(&mut self) -> Result<(), FfiError> {
        // SAFETY: configured handle.
        check("rados_connect", unsafe {
            self.lib.rados_connect(self.handle)
        })?;
        self.connected = true;
        Ok(())
    }
}

impl Drop for Rados {
    fn drop(&mut self) {
        // SAFETY: every IoCtx/Image holds an Arc of this handle, so none is left.
        unsafe { self.lib.rados_shutdown(self.handle) };
        tracing::debug!(connected = self.connected, "rados handle shut down");
    }
}

// ------------------------------------------------------------------ pool context

/// An I/O context: one pool (and RADOS namespace) on one connection.
pub struct IoCtx {
    pub(super) lib: &'static CephLib,
    pub(super) handle: rados_ioctx_t,
    pub(super) _rados: Arc<Rados>,
}

// SAFETY: the context is configured (namespace) before it is shared, and librados contexts
// may be used from several threads after that.
unsafe impl Send for IoCtx {}
unsafe impl Sync for IoCtx {}

impl IoCtx {
    /// Opens `pool`, optionally in RADOS namespace `namespace`.
    pub fn create(
        rados: &Arc<Rados>,
        pool: &str,
        namespace: Option<&str>,
    ) -> Result<IoCtx, FfiError> {
        let p = cstring("rados_ioctx_create", pool)?;
        let ns = namespace
            .map(|n| cstring("rados_ioctx_set_namespace", n))
            .transpose()?;
        let mut handle: rados_ioctx_t = null_mut();
        // SAFETY: connected handle, valid C string, out-pointer.
        check("rados_ioctx_create", unsafe {
            rados
                .lib
                .rados_ioctx_create(rados.handle, p.as_ptr(), &mut handle)
        })?;
        let ctx = IoCtx {
            lib: rados.lib,
            handle,
            _rados: rados.clone(),
        };
        if let Some(ns) = ns {
            // SAFETY: fresh context not shared yet; librados copies the string.
            unsafe { ctx.lib.rados_ioctx_set_namespace(ctx.handle, ns.as_ptr()) };
        }
        Ok(ctx)
    }

    /// `rbd_create`: a new image of `size` bytes with the cluster's default features.
    pub fn create_image(&self, name: &str, size: u64) -> Result<(), FfiError> {
        let n = cstring("rbd_create", name)?;
        let mut order: c_int = 0;
        // SAFETY: valid context, C string, out-pointer.
        check("rbd_create", unsafe {
            self.lib
                .rbd_create(self.handle, n.as_ptr(), size, &mut order)
        })?;
        Ok(())
    }

    /// `rbd_remove`: deletes an image (blocks while it has watchers' locks to break).
    pub fn remove_image(&self, name: &str) -> Result<(), FfiError> {
        let n = cstring("rbd_remove", name)?;
        // SAFETY: valid context and C string.
        check("rbd_remove", unsafe {
            self.lib.rbd_remove(self.handle, n.as_ptr())
        })?;
        Ok(())
    }

    /// `rbd_trash_move` with no delay: moves an image to the pool's RBD trash (`rbd trash
    /// ls`, restorable with `rbd trash restore` until purged). Refused while a client has it
    /// open.
    pub fn trash_image(&self, name: &str) -> Result<(), FfiError> {
        let n = cstring("rbd_trash_move", name)?;
        // SAFETY: valid context and C string.
        check("rbd_trash_move", unsafe {
            self.lib.rbd_trash_move(self.handle, n.as_ptr(), 0)
        })?;
        Ok(())
    }
}

impl Drop for IoCtx {
    fn drop(&mut self) {
        // SAFETY: images opened from this context hold an Arc of it, so none is left.
        unsafe { self.lib.rados_ioctx_destroy(self.handle) };
    }
}
