//! In-band authentication (DH-HMAC-CHAP) configured through the control plane: `nvmeofctl
//! host add --dhchap-key-file` gives a host keys, the group's gateway (a process with no
//! subsystem in its file) enforces them: the host with its keys connects (the gateway
//! proving itself too) and does I/O, a wrong key or none is refused; after `nvmeofctl host
//! change-key` the new key works for a new connection, the old one no longer does, and the
//! connection made before the change keeps working; cleared, the host connects without a key.
//! The gateway's log says the keys changed and never shows one.
//!
//! Needs a cluster, so it is `#[ignore]`d in a plain `cargo test`; run it with
//! `bash rbd-backend/tests/ceph-tests.sh` or by hand:
//!
//! ```sh
//! eval "$(scripts/micro-ceph.sh start)"
//! cargo build -p control-plane --bin nvmeofctl
//! cargo test -p nvmeof-gateway --test group_auth -- --ignored --nocapture
//! ```

mod common;

use std::time::Duration;

use common::ceph::{ceph_conf, create_image, pool, remove_image};
use common::control::{nvmeofctl, start_rados_control_plane};
use common::gateway_process::spawn_gw1_configured_by;
use common::host::{connect_within, try_connect, wait_for_ana_states, wait_for_namespaces, Attach};
use common::{free_port, loopback, pattern, poll_until, scratch_dir, unique_tag};
use nvmeof_gateway::auth::{DhchapSecret, HashFunction};
use nvmeof_gateway::host::HostError;

const SUBNQN: &str = "nqn.2016-06.io.test:group-auth";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000d1";

fn secret(byte: u8, transform: Option<HashFunction>) -> DhchapSecret {
    DhchapSecret::from_bytes(&[byte; 32], transform).expect("32 bytes")
}

fn attach(secret: Option<&DhchapSecret>, ctrl: Option<&DhchapSecret>) -> Attach {
    let mut a = Attach::new(HOST, SUBNQN);
    a.command_timeout = Duration::from_secs(30);
    a.dhchap_secret = secret.cloned();
    a.dhchap_ctrl_secret = ctrl.cloned();
    a
}

/// Connects (admin and one I/O queue, each authenticated when the gateway asks), writes and
/// reads back 8 KiB at block `lba`.
async fn round_trip(port: u16, a: &Attach, lba: u64, seed: u8) -> Result<(), HostError> {
    let host = try_connect(loopback(port), a).await?;
    let data = pattern(8192, seed);
    host.io.write(1, lba, data.clone(), 512).await?;
    assert_eq!(host.io.read(1, lba, 16, 512).await?, data);
    Ok(())
}

/// `nvmeofctl ARGS` must succeed; returns its output.
fn ctl_ok(addr: &str, args: &[&str]) -> String {
    let (rc, out, err) = nvmeofctl(addr, args);
    assert_eq!(rc, 0, "nvmeofctl {args:?}: exit {rc}: {err}");
    out
}

fn assert_refused(result: Result<(), HostError>, what: &str) {
    match result {
        Err(HostError::Authentication(_)) => {}
        other => panic!("{what}: expected an authentication failure, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Ceph cluster: bash rbd-backend/tests/ceph-tests.sh"]
async fn keys_given_with_nvmeofctl_are_enforced_by_the_groups_gateway() {
    ceph_conf();
    let name = format!("group-auth-{}", unique_tag());
    let image = format!("{name}-1");
    create_image(&image, "16M");
    let dir = scratch_dir(&name);
    let control = start_rados_control_plane(&name, 200).await;
    let cp = control.addr.clone();
    let port = free_port();
    let mut gw = spawn_gw1_configured_by(&dir, port, &cp);

    let (k1, c1, k2) = (
        secret(0x11, Some(HashFunction::Sha256)),
        secret(0x22, None),
        secret(0x33, Some(HashFunction::Sha512)),
    );
    let key_file = |file: &str, key: &DhchapSecret| {
        let path = dir.join(file);
        std::fs::write(&path, format!("{}\n", key.to_representation().as_str())).expect("key file");
        path.to_string_lossy().into_owned()
    };
    let (k1_file, c1_file, k2_file) = (
        key_file("host1.key", &k1),
        key_file("ctrl1.key", &c1),
        key_file("host2.key", &k2),
    );

    ctl_ok(&cp, &["subsystem", "add", "--nqn", SUBNQN]);
    let out = ctl_ok(
        &cp,
        &[
            "host",
            "add",
            "-n",
            SUBNQN,
            "--host",
            HOST,
            "--dhchap-key-file",
            &k1_file,
            "--dhchap-ctrl-key-file",
            &c1_file,
        ],
    );
    assert!(out.contains("(DH-HMAC-CHAP: bidirectional)"), "{out}");
    ctl_ok(
        &cp,
        &[
            "listener",
            "add",
            "-n",
            SUBNQN,
            "-g",
            "gw1",
            "-a",
            "127.0.0.1",
            "-p",
            &port.to_string(),
        ],
    );
    // ANA group 1 exists once gw1 has beaconed.
    poll_until(
        Duration::from_secs(20),
        Duration::from_millis(200),
        async || {
            let args = [
                "namespace",
                "add",
                "-n",
                SUBNQN,
                "--pool",
                &pool(),
                "--image",
                &image,
                "--nsid",
                "1",
                "--ana-group",
                "1",
            ];
            match nvmeofctl(&cp, &args) {
                (0, _, _) => Ok(()),
                (1, _, err) if err.contains("has no gateway") => Err(err),
                (rc, _, err) => panic!("namespace add: exit {rc}: {err}"),
            }
        },
    )
    .await;

    // The host with its keys (asking the gateway to prove itself): served, I/O works.
    let with_k1 = attach(Some(&k1), Some(&c1));
    let before = connect_within(port, &with_k1, Duration::from_secs(30)).await;
    // Served once the image is open and its group optimized here.
    wait_for_namespaces(&before.admin, &[1]).await;
    wait_for_ana_states(
        &before.admin,
        &[(1, nvmeof_gateway::spec::ana::OPTIMIZED)],
        Duration::from_secs(20),
    )
    .await;
    let data = pattern(4096, 7);
    before
        .io
        .write(1, 0, data.clone(), 512)
        .await
        .expect("write with the key");
    assert_eq!(before.io.read(1, 0, 8, 512).await.expect("read"), data);
    round_trip(port, &with_k1, 8, 1)
        .await
        .expect("a second connection with the key");

    // A wrong key, a wrong controller key, none: refused.
    let wrong = secret(0x44, None);
    assert_refused(
        round_trip(port, &attach(Some(&wrong), None), 8, 2).await,
        "a wrong host key",
    );
    assert_refused(
        round_trip(port, &attach(Some(&k1), Some(&wrong)), 8, 2).await,
        "a wrong controller key",
    );
    assert_refused(round_trip(port, &attach(None, None), 8, 2).await, "no key");

    // The key changed: a new connection needs the new key (the gateway follows within a
    // push); the controller connected before keeps working.
    let out = ctl_ok(
        &cp,
        &[
            "host",
            "change-key",
            "-n",
            SUBNQN,
            "--host",
            HOST,
            "--dhchap-key-file",
            &k2_file,
        ],
    );
    assert!(out.contains("changed (DH-HMAC-CHAP: host)"), "{out}");
    let with_k2 = attach(Some(&k2), None);
    poll_until(
        Duration::from_secs(15),
        Duration::from_millis(200),
        async || {
            round_trip(port, &with_k2, 16, 3)
                .await
                .map_err(|e| format!("the new key is not taken: {e}"))
        },
    )
    .await;
    assert_refused(
        round_trip(port, &attach(Some(&k1), None), 16, 4).await,
        "the old key",
    );
    assert_eq!(
        before
            .io
            .read(1, 0, 8, 512)
            .await
            .expect("the old controller reads"),
        data
    );

    // Cleared: the host connects without a key.
    let out = ctl_ok(&cp, &["host", "change-key", "-n", SUBNQN, "--host", HOST]);
    assert!(out.contains("cleared"), "{out}");
    poll_until(
        Duration::from_secs(15),
        Duration::from_millis(200),
        async || {
            round_trip(port, &attach(None, None), 24, 5)
                .await
                .map_err(|e| format!("still asked for a key: {e}"))
        },
    )
    .await;

    let out = ctl_ok(&cp, &["host", "list", "-n", SUBNQN]);
    assert!(
        // SUBSYSTEM HOST AUTH TLS-PSK: no DH-HMAC-CHAP key left.
        out.lines()
            .any(|l| l.contains(HOST) && l.split_whitespace().nth(2) == Some("none")),
        "{out}"
    );
    let log = gw.log_text();
    assert!(
        log.contains("DH-HMAC-CHAP keys changed in the control plane"),
        "the gateway logs the change:\n{log}"
    );
    for key in [&k1, &c1, &k2] {
        let text = key.to_representation();
        assert!(
            !log.contains(&text[10..text.len() - 1]),
            "a key in the gateway's log:\n{log}"
        );
    }
    drop(before);
    // Stopped, not killed: its image is closed, so removing it does not wait for a dead
    // client's watch to time out.
    gw.terminate();
    remove_image(&image);
    let _ = std::fs::remove_dir_all(dir);
}
