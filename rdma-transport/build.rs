//! The crate loads librdmacm at run time (`dlopen("librdmacm.so.1")`, which pulls in
//! `libibverbs.so.1`), so building needs neither the rdma-core headers nor its libraries, and
//! a gateway without RDMA listeners runs on a machine without rdma-core.
//!
//! The bindings in `src/ffi/bindings.rs` are checked in. To regenerate them from the system
//! headers (needs `libibverbs-dev librdmacm-dev libclang-dev`):
//!
//! ```sh
//! cargo build -p rdma-transport --features bindgen
//! cp "$(ls -t target/debug/build/rdma-transport-*/out/bindings.rs | head -1)" rdma-transport/src/ffi/bindings.rs
//! ```
//!
//! The verbs that rdma-core defines `static inline` in `verbs.h` (`ibv_post_send`,
//! `ibv_post_recv`, `ibv_poll_cq`, `ibv_req_notify_cq`) are not exported symbols; `ffi` calls
//! them as `verbs.h` does, through the provider's `struct ibv_context_ops` function pointers.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=wrapper.h");
    #[cfg(feature = "bindgen")]
    generate();
}

#[cfg(feature = "bindgen")]
fn generate() {
    // Only what the crate calls: keeps the checked-in file reviewable.
    const FUNCTIONS: &[&str] = &[
        "ibv_alloc_pd",
        "ibv_dealloc_pd",
        "ibv_reg_mr",
        "ibv_dereg_mr",
        "ibv_create_comp_channel",
        "ibv_destroy_comp_channel",
        "ibv_create_cq",
        "ibv_destroy_cq",
        "ibv_get_cq_event",
        "ibv_ack_cq_events",
        "ibv_query_device",
        "ibv_create_srq",
        "ibv_destroy_srq",
        "ibv_get_async_event",
        "ibv_ack_async_event",
        "ibv_event_type_str",
        "ibv_wc_status_str",
        "rdma_create_event_channel",
        "rdma_destroy_event_channel",
        "rdma_create_id",
        "rdma_destroy_id",
        "rdma_bind_addr",
        "rdma_listen",
        "rdma_get_cm_event",
        "rdma_ack_cm_event",
        "rdma_accept",
        "rdma_reject",
        "rdma_disconnect",
        "rdma_create_qp",
        "rdma_destroy_qp",
        "rdma_event_str",
        "rdma_resolve_addr",
        "rdma_resolve_route",
        "rdma_connect",
        "rdma_get_devices",
        "rdma_free_devices",
    ];
    const TYPES: &[&str] = &[
        "ibv_send_wr",
        "ibv_recv_wr",
        "ibv_sge",
        "ibv_wc",
        "ibv_context_ops",
        "ibv_qp_init_attr",
        "ibv_device_attr",
        "ibv_srq_init_attr",
        "ibv_async_event",
        "ibv_event_type",
        "rdma_cm_event",
        "rdma_conn_param",
        "ibv_wr_opcode",
        "ibv_wc_opcode",
        "ibv_wc_status",
        "ibv_wc_flags",
        "ibv_send_flags",
        "ibv_access_flags",
        "rdma_cm_event_type",
        "rdma_port_space",
        "ibv_qp_type",
    ];
    let out =
        std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("bindings.rs");
    let mut b = bindgen::Builder::default()
        .header("wrapper.h")
        .dynamic_library_name("RdmaLib")
        .dynamic_link_require_all(true)
        .layout_tests(false)
        .generate_comments(false)
        .derive_default(true)
        .prepend_enum_name(false);
    for f in FUNCTIONS {
        b = b.allowlist_function(f);
    }
    for t in TYPES {
        b = b.allowlist_type(t);
    }
    b.generate()
        .expect("bindgen failed (are libclang-dev, libibverbs-dev and librdmacm-dev installed?)")
        .write_to_file(&out)
        .expect("write bindings");
}
