//! The crate loads librbd at run time (dlopen of `librbd.so.1`, which pulls in
//! `librados.so.2`), so building needs neither Ceph headers nor Ceph libraries.
//!
//! The bindings in `src/ffi/bindings.rs` are checked in. To regenerate them from the system
//! headers (needs `librbd-dev librados-dev libclang-dev`):
//!
//! ```sh
//! cargo build -p rbd-backend --features bindgen
//! cp "$(ls -t target/debug/build/rbd-backend-*/out/bindings.rs | head -1)" rbd-backend/src/ffi/bindings.rs
//! ```
//! (`rbd-backend/regen-bindings.sh` does both.)

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=wrapper.h");
    #[cfg(feature = "bindgen")]
    generate();
}

#[cfg(feature = "bindgen")]
fn generate() {
    // Only what the backend calls: keeps the checked-in file reviewable.
    const FUNCTIONS: &[&str] = &[
        "rados_create2",
        "rados_conf_read_file",
        "rados_conf_parse_env",
        "rados_conf_parse_argv",
        "rados_conf_parse_argv_remainder",
        "rados_conf_set",
        "rados_conf_get",
        "rados_connect",
        "rados_shutdown",
        "rados_version",
        "rados_ioctx_create",
        "rados_ioctx_destroy",
        "rados_ioctx_set_namespace",
        "rbd_version",
        "rbd_create",
        "rbd_remove",
        "rbd_trash_move",
        "rbd_open",
        "rbd_close",
        "rbd_get_size",
        "rbd_stat",
        "rbd_resize",
        "rbd_aio_create_completion",
        "rbd_aio_release",
        "rbd_aio_get_return_value",
        "rbd_aio_read",
        "rbd_aio_write",
        "rbd_aio_flush",
        "rbd_aio_discard",
        "rbd_aio_write_zeroes",
        "rbd_read",
        "rbd_write",
        "rbd_lock_acquire",
        "rbd_lock_release",
        "rbd_aio_compare_and_write",
        "rbd_update_watch",
        "rbd_update_unwatch",
        // RADOS objects, omap, locks, watch/notify, mon commands (crate::rados)
        "rados_buffer_free",
        "rados_getaddrs",
        "rados_get_instance_id",
        "rados_wait_for_latest_osdmap",
        "rados_mon_command",
        "rados_osd_command",
        "rados_create_write_op",
        "rados_release_write_op",
        "rados_write_op_create",
        "rados_write_op_omap_cmp",
        "rados_write_op_omap_set",
        "rados_write_op_omap_rm_keys",
        "rados_write_op_operate",
        "rados_create_read_op",
        "rados_release_read_op",
        "rados_read_op_omap_get_vals2",
        "rados_read_op_operate",
        "rados_omap_get_next",
        "rados_omap_get_end",
        "rados_lock_exclusive",
        "rados_unlock",
        "rados_watch2",
        "rados_unwatch2",
        "rados_watch_flush",
        "rados_notify2",
        "rados_notify_ack",
        "rados_remove",
    ];
    let out =
        std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("bindings.rs");
    let mut b = bindgen::Builder::default()
        .header("wrapper.h")
        .dynamic_library_name("CephLib")
        .dynamic_link_require_all(true)
        .layout_tests(false)
        .generate_comments(false)
        .allowlist_var("LIBRBD_VER_.*")
        .allowlist_var("LIBRADOS_VER_.*")
        .allowlist_var("LIBRADOS_LOCK_FLAG_RENEW")
        .allowlist_var("LIBRADOS_CREATE_.*")
        .allowlist_var("LIBRADOS_CMPXATTR_OP_EQ")
        .allowlist_var("LIBRADOS_OPERATION_NOFLAG")
        .allowlist_type("rbd_lock_mode_t")
        .rustified_enum("rbd_lock_mode_t");
    for f in FUNCTIONS {
        b = b.allowlist_function(f);
    }
    b.generate()
        .expect("bindgen failed (are libclang-dev, librbd-dev and librados-dev installed?)")
        .write_to_file(&out)
        .expect("write bindings");
}
