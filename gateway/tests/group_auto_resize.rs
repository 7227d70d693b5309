//! Auto-resize off, on a cluster: a namespace the control plane froze (`namespace set
//! --auto-resize false`) keeps the size the host sees when its image grows outside (`rbd
//! resize`), through a gateway restart too; `namespace resize` changes it (the host sees the
//! new size); auto-resize on again shows the image's size.
//!
//! Needs a cluster, so it is `#[ignore]`d in a plain `cargo test`; run it with
//! `bash rbd-backend/tests/ceph-tests.sh` or by hand:
//!
//! ```sh
//! eval "$(scripts/micro-ceph.sh start)"
//! cargo test -p nvmeof-gateway --test group_auto_resize -- --ignored --nocapture
//! ```

mod common;

use std::time::Duration;

use common::ceph::{ceph_conf, create_image, image_spec, pool, rbd, remove_image};
use common::control::{
    add_namespace_once_its_group_exists, admin_client, start_rados_control_plane,
};
use common::gateway_process::spawn_gw1_configured_by;
use common::host::{connect_within, wait_for_namespaces, Attach, HostQueues};
use common::{free_port, poll_until, scratch_dir, unique_tag};
use control_plane::proto;
use nvmeof_gateway::host::{HostConnection, HostError};
use nvmeof_gateway::spec::sc;

const SUBNQN: &str = "nqn.2016-06.io.test:autoresize";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000f7";
const MIB: u64 = 1 << 20;

async fn connect(port: u16) -> HostQueues {
    connect_within(port, &Attach::new(HOSTNQN, SUBNQN), Duration::from_secs(30)).await
}

/// Waits until the host's Identify Namespace reports `bytes` (512-byte blocks).
async fn wait_for_size(h: &HostConnection, bytes: u64, what: &str) {
    poll_until(
        Duration::from_secs(15),
        Duration::from_millis(100),
        async || {
            let nsze = h.identify_namespace(1).await.expect("identify").nsze();
            if nsze == bytes / 512 {
                Ok(())
            } else {
                Err(format!("{what}: NSZE {nsze}, not {}", bytes / 512))
            }
        },
    )
    .await;
}

/// Holds for `within`: the host keeps seeing `bytes`.
async fn stays_at(h: &HostConnection, bytes: u64, within: Duration, what: &str) {
    let until = std::time::Instant::now() + within;
    while std::time::Instant::now() < until {
        let nsze = h.identify_namespace(1).await.expect("identify").nsze();
        assert_eq!(nsze, bytes / 512, "{what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A read of the block at `slba` is refused as LBA Out of Range.
async fn out_of_range(io: &HostConnection, slba: u64) {
    match io.read(1, slba, 1, 512).await {
        Err(HostError::Nvme(c)) => assert_eq!(
            (u16::from(c.sct()) << 8) | u16::from(c.sc()),
            sc::LBA_RANGE,
            "{c:?}"
        ),
        other => panic!("a read at LBA {slba} beyond the frozen size: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Ceph cluster"]
async fn a_frozen_namespace_keeps_its_size_through_rbd_resize_and_a_restart() {
    ceph_conf();
    let name = format!("autoresize-{}", unique_tag());
    let image = format!("{name}-img");
    create_image(&image, "16M");
    let dir = scratch_dir(&name);
    let control = start_rados_control_plane(&name, 200).await;
    let cp_addr = control.addr;
    let port = free_port();
    let gw = spawn_gw1_configured_by(&dir, port, &cp_addr);
    let mut admin = admin_client(&cp_addr).await;
    admin
        .subsystem_add(proto::SubsystemAddRequest {
            nqn: SUBNQN.into(),
            allow_any_host: true,
            ..Default::default()
        })
        .await
        .expect("subsystem");
    add_namespace_once_its_group_exists(
        &mut admin,
        proto::NamespaceAddRequest {
            subsystem_nqn: SUBNQN.into(),
            nsid: 1,
            pool: pool(),
            image: image.clone(),
            ana_group: 1,
            ..Default::default()
        },
    )
    .await;
    let HostQueues { admin: h, io } = connect(port).await;
    wait_for_namespaces(&h, &[1]).await;
    wait_for_size(&h, 16 * MIB, "added").await;

    let set = |auto_resize: bool| proto::NamespaceSetRequest {
        subsystem_nqn: SUBNQN.into(),
        nsid: 1,
        auto_resize: Some(auto_resize),
        ..Default::default()
    };
    admin
        .namespace_set(set(false))
        .await
        .expect("auto-resize off");
    // The image grows outside: the host keeps seeing 16 MiB, and the blocks beyond are out
    // of range.
    rbd(&["resize", "--size", "32M", &image_spec(&image)]);
    stays_at(
        &h,
        16 * MIB,
        Duration::from_secs(3),
        "after rbd resize while frozen",
    )
    .await;
    io.read(1, 16 * MIB / 512 - 1, 1, 512)
        .await
        .expect("the last frozen block");
    out_of_range(&io, 16 * MIB / 512).await;

    // A restart: the gateway reopens the image (32 MiB) and gets the frozen size pushed.
    drop((h, io));
    let mut gw = gw;
    gw.signal("-TERM");
    let status = gw
        .exit_within(Duration::from_secs(10), "the gateway did not stop")
        .await;
    assert!(status.success(), "{status}");
    drop(gw);
    let gw = spawn_gw1_configured_by(&dir, port, &cp_addr);
    let HostQueues { admin: h, io } = connect(port).await;
    wait_for_namespaces(&h, &[1]).await;
    stays_at(
        &h,
        16 * MIB,
        Duration::from_secs(2),
        "after a gateway restart",
    )
    .await;
    out_of_range(&io, 16 * MIB / 512).await;

    // An explicit resize of the frozen namespace: the host sees it (the image, larger, is
    // left alone).
    admin
        .namespace_resize(proto::NamespaceResizeRequest {
            subsystem_nqn: SUBNQN.into(),
            nsid: 1,
            size_bytes: 24 * MIB,
        })
        .await
        .expect("resize while frozen");
    wait_for_size(&h, 24 * MIB, "resized while frozen").await;
    io.read(1, 24 * MIB / 512 - 1, 1, 512)
        .await
        .expect("the last block of the new size");
    out_of_range(&io, 24 * MIB / 512).await;

    // Auto-resize on: the image's size.
    admin
        .namespace_set(set(true))
        .await
        .expect("auto-resize on");
    wait_for_size(&h, 32 * MIB, "auto-resize on again").await;
    io.read(1, 32 * MIB / 512 - 1, 1, 512)
        .await
        .expect("the image's last block");

    drop((h, io));
    drop(gw);
    remove_image(&image);
}
