//! Compiles proto/nvmeof_control.proto with protox (pure Rust), so building needs no `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/nvmeof_control.proto");
    println!("cargo:rerun-if-changed=proto/ceph_nvmeof_gateway.proto");
    // The second file is ceph-nvmeof's API (no proto package: generated as `_.rs`).
    let fds = protox::compile(
        [
            "proto/nvmeof_control.proto",
            "proto/ceph_nvmeof_gateway.proto",
        ],
        ["proto"],
    )?;
    tonic_build::configure()
        .build_server(true)
        .build_client(true)
        // `nvmeofctl --output json` prints the replies as they are.
        .type_attribute(".nvmeof.control.v1", "#[derive(serde::Serialize)]")
        // A host's DH-HMAC-CHAP keys are never printed: not in JSON, and `Debug` (written in
        // src/lib.rs) leaves them out, so no log line can carry one.
        .field_attribute(
            ".nvmeof.control.v1.Host.dhchap_key",
            "#[serde(skip_serializing)]",
        )
        .field_attribute(
            ".nvmeof.control.v1.Host.dhchap_ctrl_key",
            "#[serde(skip_serializing)]",
        )
        .skip_debug(".nvmeof.control.v1.Host")
        // Nor is a host's TLS PSK; a host without one shows no `psk` at all.
        .field_attribute(
            ".nvmeof.control.v1.TlsPsk.key",
            "#[serde(skip_serializing)]",
        )
        .field_attribute(
            ".nvmeof.control.v1.Host.psk",
            "#[serde(skip_serializing_if = \"Option::is_none\")]",
        )
        .skip_debug(".nvmeof.control.v1.TlsPsk")
        .field_attribute(
            ".nvmeof.control.v1.SubsystemKeyRequest.dhchap_key",
            "#[serde(skip_serializing)]",
        )
        .skip_debug(".nvmeof.control.v1.SubsystemKeyRequest")
        // Raw bytes would print as a list of numbers; `namespace list` shows the UUID.
        .field_attribute(
            ".nvmeof.control.v1.NamespaceIoCounters.uuid",
            "#[serde(skip_serializing)]",
        )
        // The ceph-nvmeof API's requests that carry keys: `Debug` written in src/ceph_api.rs.
        .skip_debug(".add_host_req")
        .skip_debug(".change_host_key_req")
        .skip_debug(".create_subsystem_req")
        .skip_debug(".change_subsystem_key_req")
        .compile_fds(fds)?;
    Ok(())
}
