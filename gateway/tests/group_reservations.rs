//! Reservations shared by a gateway group, on a real Ceph cluster: two `nvmeof-gateway`
//! processes and an in-process control plane (state in RADOS), two hosts (two host NQNs, so
//! two host IDs) driven by the Rust NVMe/TCP host.
//!
//! gw1 owns ANA group 1 (namespace 1). Host A registers and takes a Write Exclusive
//! reservation through gw1, host B registers; B's writes meet the reservation; through gw2
//! (inaccessible for group 1) reservation commands get ANA Inaccessible. gw1 is killed
//! (SIGKILL): group 1 turns optimized on gw2, which loaded the state gw1 stored, so the
//! report through gw2 shows the same generation, holder and keys, and B's writes still
//! conflict. B preempts A through gw2; gw1 restarts, group 1 fails back, and the report
//! through gw1 shows what gw2 stored. Also measures the latency of a reservation change
//! through the group's owner against a standalone gateway on the same cluster.
//!
//! Needs a cluster, so it is `#[ignore]`d in a plain `cargo test`; run it with
//! `bash rbd-backend/tests/ceph-tests.sh` or by hand:
//!
//! ```sh
//! eval "$(scripts/micro-ceph.sh start)"
//! cargo test -p nvmeof-gateway --test group_reservations -- --ignored --nocapture
//! ```

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::ceph::{ceph_conf, ceph_settings, create_image_pair, pool, remove_image};
use common::control::start_rados_control_plane;
use common::gateway_process::{
    listener_toml, spawn_group_gateway, two_group_subsystem_toml, GatewayProcess, GW1_CNTLIDS,
    GW2_CNTLIDS,
};
use common::host::{connect_within, wait_for_ana_states, Attach, HostQueues};
use common::{free_port, scratch_dir, unique_tag};
use nvmeof_gateway::host::cmd::Sqe;
use nvmeof_gateway::host::{HostConnection, Xfer};
use nvmeof_gateway::spec::{ana, io_opcode, pr, sc};
use rbd_backend::rados::Client;

const SUBNQN: &str = "nqn.2016-06.io.test:group-resv";
const HOST_A: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-00000000a001";
const HOST_B: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-00000000b002";
const BLOCK: u32 = 512;
const KEY_A: u64 = 0xa1a1;
const KEY_B: u64 = 0xb2b2;

async fn connect(port: u16, host: &str) -> HostQueues {
    connect_within(port, &Attach::new(host, SUBNQN), Duration::from_secs(30)).await
}

/// A reservation command on namespace 1; returns the status (SCT << 8 | SC).
async fn resv(io: &HostConnection, opcode: u8, cdw10: u32, keys: &[u64]) -> u16 {
    let data: Vec<u8> = keys.iter().flat_map(|k| k.to_le_bytes()).collect();
    let mut sqe = Sqe::new(opcode);
    sqe.set_nsid(1).set_cdw(10, cdw10);
    let r = io
        .submit(sqe, Xfer::Write(Bytes::from(data)))
        .await
        .expect("reservation command");
    r.cqe.status() & 0x7ff
}

fn rtype(t: u8) -> u32 {
    u32::from(t) << pr::RTYPE_SHIFT
}

/// (generation, type, [(host ID, key, holds)]) from Reservation Report (extended).
async fn report(io: &HostConnection) -> (u32, u8, Vec<([u8; 16], u64, bool)>) {
    let mut sqe = Sqe::new(io_opcode::RESV_REPORT);
    sqe.set_nsid(1)
        .set_cdw(10, 4096 / 4 - 1)
        .set_cdw(11, pr::EXTENDED_DATA_STRUCT);
    let r = io.submit(sqe, Xfer::Read(4096)).await.expect("report sent");
    assert!(r.cqe.is_success(), "report: {:#x}", r.cqe.status());
    let d = r.data;
    let count = usize::from(u16::from_le_bytes([d[5], d[6]]));
    let entries = (0..count)
        .map(|i| {
            let e = &d[64 + 64 * i..128 + 64 * i];
            let mut host = [0u8; 16];
            host.copy_from_slice(&e[16..32]);
            (
                host,
                u64::from_le_bytes(e[8..16].try_into().expect("8 bytes")),
                e[2] & 1 != 0,
            )
        })
        .collect();
    (u32::from_le_bytes([d[0], d[1], d[2], d[3]]), d[4], entries)
}

async fn write_status(io: &HostConnection, seed: u8) -> u16 {
    let mut sqe = Sqe::rw(nvmeof_gateway::host::cmd::io::WRITE, 1, 0, 8);
    sqe.set_nsid(1);
    let r = io
        .submit(
            sqe,
            Xfer::Write(Bytes::from(common::pattern(8 * BLOCK as usize, seed))),
        )
        .await
        .expect("write sent");
    r.cqe.status() & 0x7ff
}

/// Median and max of `n` Register-Replace commands (each a change of the state).
async fn replace_latency(io: &HostConnection, key: u64, n: usize) -> (Duration, Duration) {
    let mut times = Vec::with_capacity(n);
    let mut current = key;
    for i in 0..n {
        let next = key + 1 + (i as u64 % 2);
        let started = Instant::now();
        let status = resv(
            io,
            io_opcode::RESV_REGISTER,
            pr::REGISTER_ACT_REPLACE,
            &[current, next],
        )
        .await;
        times.push(started.elapsed());
        assert_eq!(status, 0, "replace {i}");
        current = next;
    }
    // Back to the original key.
    assert_eq!(
        resv(
            io,
            io_opcode::RESV_REGISTER,
            pr::REGISTER_ACT_REPLACE,
            &[current, key]
        )
        .await,
        0
    );
    times.sort();
    (times[n / 2], times[n - 1])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Ceph cluster: bash rbd-backend/tests/ceph-tests.sh"]
async fn reservations_survive_the_owner_s_kill_and_failback() {
    ceph_conf();
    let name = format!("group-resv-{}", unique_tag());
    let images = create_image_pair(&name, "16M");
    let dir = scratch_dir(&name);
    let control = start_rados_control_plane(&name, 500).await;
    let (cp, cp_addr, oid) = (control.cp, control.addr, control.state_oid);

    let gw1 = spawn_group_gateway(&dir, "gw1", 1, GW1_CNTLIDS, &cp_addr, SUBNQN, &images);
    let gw2 = spawn_group_gateway(&dir, "gw2", 2, GW2_CNTLIDS, &cp_addr, SUBNQN, &images);
    eprintln!("gateway logs: {} {}", gw1.log.display(), gw2.log.display());
    let a1 = connect(gw1.port, HOST_A).await;
    let b1 = connect(gw1.port, HOST_B).await;
    let b2 = connect(gw2.port, HOST_B).await;
    let steady = Duration::from_secs(20);
    wait_for_ana_states(&a1.admin, &[(1, ana::OPTIMIZED)], steady).await;
    wait_for_ana_states(&b2.admin, &[(1, ana::INACCESSIBLE)], steady).await;
    let ctrl = a1.admin.identify_controller().await.expect("identify");
    assert_ne!(
        ctrl.raw[520] & (nvmeof_gateway::spec::ctrl::ONCS_RESERVATIONS as u8),
        0,
        "a gateway of a group announces reservations"
    );

    // Through the owner: A and B register, A reserves Write Exclusive.
    assert_eq!(
        resv(
            &a1.io,
            io_opcode::RESV_REGISTER,
            pr::REGISTER_ACT_REG,
            &[0, KEY_A]
        )
        .await,
        0
    );
    assert_eq!(
        resv(
            &b1.io,
            io_opcode::RESV_REGISTER,
            pr::REGISTER_ACT_REG,
            &[0, KEY_B]
        )
        .await,
        0
    );
    assert_eq!(
        resv(
            &a1.io,
            io_opcode::RESV_ACQUIRE,
            pr::ACQUIRE_ACT_ACQUIRE | rtype(pr::WRITE_EXCLUSIVE),
            &[KEY_A, 0]
        )
        .await,
        0
    );
    assert_eq!(
        write_status(&b1.io, 1).await,
        sc::RESERVATION_CONFLICT,
        "B is no holder"
    );
    assert_eq!(write_status(&a1.io, 2).await, 0);
    // The other gateway is no owner: it sends the host to the optimized path.
    assert_eq!(
        resv(
            &b2.io,
            io_opcode::RESV_REGISTER,
            pr::REGISTER_ACT_REG,
            &[0, KEY_B]
        )
        .await,
        sc::ANA_INACCESSIBLE
    );
    let before = report(&a1.io).await;
    assert_eq!(before.1, pr::WRITE_EXCLUSIVE);
    assert_eq!(before.2.len(), 2);
    eprintln!("before the kill: generation {}, {:?}", before.0, before.2);

    let (group_p50, group_max) = replace_latency(&a1.io, KEY_A, 50).await;
    let before = report(&a1.io).await;

    // kill -9 of the owner: gw2 takes group 1 over with the state gw1 stored.
    let killed = Instant::now();
    gw1.signal("-KILL");
    wait_for_ana_states(&b2.admin, &[(1, ana::OPTIMIZED)], Duration::from_secs(30)).await;
    eprintln!(
        "group 1 optimized on gw2 {} ms after gw1 was killed",
        killed.elapsed().as_millis()
    );
    let log = gw2.log_text();
    let loaded = log
        .lines()
        .find(|l| l.contains("reservation state loaded") && l.contains("nsid=1"))
        .expect("gw2 turned optimized without loading the reservations");
    eprintln!("gw2: {loaded}");
    let a2 = connect(gw2.port, HOST_A).await;
    assert_eq!(report(&b2.io).await, before, "same state through gw2");
    assert_eq!(
        write_status(&b2.io, 3).await,
        sc::RESERVATION_CONFLICT,
        "the reservation still holds"
    );
    assert_eq!(write_status(&a2.io, 4).await, 0, "the holder writes");

    // B preempts A (a cluster fencing a dead node) through gw2, aborting A's commands.
    assert_eq!(
        resv(
            &b2.io,
            io_opcode::RESV_ACQUIRE,
            pr::ACQUIRE_ACT_PREEMPT_AND_ABORT | rtype(pr::WRITE_EXCLUSIVE_ALL_REGS),
            &[KEY_B, KEY_A]
        )
        .await,
        0
    );
    assert_eq!(write_status(&a2.io, 5).await, sc::RESERVATION_CONFLICT);
    let preempted = report(&b2.io).await;
    assert_eq!(preempted.1, pr::WRITE_EXCLUSIVE_ALL_REGS);
    assert_eq!(preempted.2.len(), 1);
    assert_eq!(preempted.2[0].1, KEY_B);

    // gw1 restarts; group 1 fails back to it, with the state gw2 stored.
    drop((a1, b1));
    drop(gw1);
    let gw1 = spawn_group_gateway(&dir, "gw1", 1, GW1_CNTLIDS, &cp_addr, SUBNQN, &images);
    let a1 = connect(gw1.port, HOST_A).await;
    wait_for_ana_states(&a1.admin, &[(1, ana::OPTIMIZED)], Duration::from_secs(30)).await;
    wait_for_ana_states(
        &b2.admin,
        &[(1, ana::INACCESSIBLE)],
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(
        report(&a1.io).await,
        preempted,
        "same state after the failback"
    );
    assert_eq!(write_status(&a1.io, 6).await, sc::RESERVATION_CONFLICT);
    // A registers again: under Write Exclusive - All Registrants it may write again.
    assert_eq!(
        resv(
            &a1.io,
            io_opcode::RESV_REGISTER,
            pr::REGISTER_ACT_REG,
            &[0, KEY_A]
        )
        .await,
        0
    );
    assert_eq!(write_status(&a1.io, 7).await, 0);

    // Standalone gateway on the same cluster (its own image), for the latency figure.
    let port = free_port();
    let solo_images = create_image_pair(&format!("{name}-solo"), "16M");
    let config = format!(
        "[gateway]\nworker_threads = 1\n{listener}{subsystem}\n[ceph]\nconf = \"{conf}\"\n",
        listener = listener_toml(port),
        subsystem = two_group_subsystem_toml(SUBNQN, &solo_images),
        conf = ceph_conf(),
    );
    let solo = GatewayProcess::spawn(&dir, "solo", port, &config);
    let s = connect(port, HOST_A).await;
    assert_eq!(
        resv(
            &s.io,
            io_opcode::RESV_REGISTER,
            pr::REGISTER_ACT_REG,
            &[0, KEY_A]
        )
        .await,
        0
    );
    let (solo_p50, solo_max) = replace_latency(&s.io, KEY_A, 50).await;
    eprintln!(
        "reservation change latency (Register-Replace, 50 commands, Rust host over loopback TCP): \
         standalone p50 {} us max {} us; group owner (stored first) p50 {} us max {} us",
        solo_p50.as_micros(),
        solo_max.as_micros(),
        group_p50.as_micros(),
        group_max.as_micros()
    );

    drop((s, a1, a2, b2));
    drop((solo, gw1, gw2));
    let (settings, p) = (ceph_settings(), pool());
    let addrs: Vec<String> = cp
        .state()
        .map
        .map(|m| m.gateways.values().flat_map(|g| g.addrs.clone()).collect())
        .unwrap_or_default();
    let mut all_images: Vec<String> = images.to_vec();
    all_images.extend(solo_images.iter().cloned());
    let objects: Vec<String> = all_images
        .iter()
        .map(|i| rbd_backend::rbd::record_object(i))
        .collect();
    tokio::task::spawn_blocking(move || {
        if let Ok(c) = Client::connect(&settings) {
            for a in &addrs {
                let _ = c.blocklist_rm(a);
            }
            if let Ok(pl) = c.pool(&p, None) {
                let _ = pl.remove(&oid);
                for o in &objects {
                    let _ = pl.remove(o);
                }
            }
        }
    })
    .await
    .expect("cleanup");
    for i in &all_images {
        remove_image(i);
    }
    let _ = std::fs::remove_dir_all(dir);
}
