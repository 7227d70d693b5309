//! Reservations through the core: two hosts' controllers on one namespace, each command as
//! the host sends it, the conflicts its I/O then meets, the notices the other host gets,
//! and what Identify says.

use rbd_backend::IoBuf;

use super::tests::{
    arm_aer, connect, fired_aer, fixture, get_log, identify, one, property_set_cc, run, rw,
    set_cdw, set_data_len, sqe, Fixture, CC_ENABLED, HOSTNQN, OTHER_HOST, SUBNQN,
};
use super::*;
use crate::spec::{self, io_opcode, pr, sc};

const ID_A: [u8; 16] = [0xa1; 16];
const ID_B: [u8; 16] = [0xb2; 16];

/// A host's admin queue (enabled) and I/O queue 1, connected with host ID `hostid`.
fn attach(f: &Fixture, hostnqn: &str, hostid: [u8; 16]) -> (Queue, Queue) {
    let data = |cntlid: u16| {
        let mut d = vec![0u8; 1024];
        d[0..16].copy_from_slice(&hostid);
        d[16..18].copy_from_slice(&cntlid.to_le_bytes());
        d[256..256 + SUBNQN.len()].copy_from_slice(SUBNQN.as_bytes());
        d[512..512 + hostnqn.len()].copy_from_slice(hostnqn.as_bytes());
        IoBuf::from_vec(d)
    };
    let mut admin = f.queue();
    let r = one(run(&mut admin, connect(0, 31, 0), Some(data(0xffff))));
    assert!(r.completion.status.is_success());
    assert!(property_set_cc(&mut admin, CC_ENABLED).is_success());
    let mut io = f.queue();
    let r = one(run(
        &mut io,
        connect(1, 127, 0),
        Some(data(r.completion.result as u16)),
    ));
    assert!(r.completion.status.is_success());
    (admin, io)
}

fn two_hosts() -> (Fixture, (Queue, Queue), (Queue, Queue)) {
    let f = fixture();
    let sub = f.target.subsystem(SUBNQN).expect("subsystem");
    sub.set_access(HostAccess::Only(
        [HOSTNQN.to_string(), OTHER_HOST.to_string()].into(),
    ));
    let a = attach(&f, HOSTNQN, ID_A);
    let b = attach(&f, OTHER_HOST, ID_B);
    (f, a, b)
}

/// A reservation command on namespace 1 with its key data.
fn resv(q: &mut Queue, opcode: u8, cdw10: u32, keys: &[u64]) -> Status {
    let data: Vec<u8> = keys.iter().flat_map(|k| k.to_le_bytes()).collect();
    let mut raw = sqe(opcode, 30, 1);
    set_cdw(&mut raw, 10, cdw10);
    set_data_len(&mut raw, data.len() as u32);
    one(run(
        q,
        Command::from_bytes(&raw),
        Some(IoBuf::from_vec(data)),
    ))
    .completion
    .status
}

fn register(q: &mut Queue, key: u64) -> Status {
    resv(q, io_opcode::RESV_REGISTER, pr::REGISTER_ACT_REG, &[0, key])
}

fn acquire(q: &mut Queue, action: u32, rtype: u8, key: u64, preempt: u64) -> Status {
    let cdw10 = action | (u32::from(rtype) << pr::RTYPE_SHIFT);
    resv(q, io_opcode::RESV_ACQUIRE, cdw10, &[key, preempt])
}

fn write_status(q: &mut Queue) -> Status {
    one(run(
        q,
        rw(io_opcode::WRITE, 8, 0, 1),
        Some(IoBuf::from_vec(vec![5; 512])),
    ))
    .completion
    .status
}

fn read_status(q: &mut Queue) -> Status {
    one(run(q, rw(io_opcode::READ, 9, 0, 1), None))
        .completion
        .status
}

fn report(q: &mut Queue, eds: bool) -> Response {
    let mut raw = sqe(io_opcode::RESV_REPORT, 31, 1);
    set_cdw(&mut raw, 10, 4096 / 4 - 1);
    set_cdw(&mut raw, 11, u32::from(eds));
    set_data_len(&mut raw, 4096);
    one(run(q, Command::from_bytes(&raw), None))
}

fn conflict() -> Status {
    Status::error(sc::RESERVATION_CONFLICT)
}

#[test]
fn a_reservation_fences_the_other_hosts_writes_until_it_is_preempted() {
    let (f, (mut a_admin, mut a), (mut b_admin, mut b)) = two_hosts();
    arm_aer(&mut a_admin, 0);
    arm_aer(&mut b_admin, 0);
    assert!(register(&mut a, 0xaaaa).is_success());
    assert!(register(&mut b, 0xbbbb).is_success());
    let we_ro = pr::WRITE_EXCLUSIVE_REG_ONLY;
    assert_eq!(
        acquire(&mut b, 0, we_ro, 0x1234, 0),
        conflict(),
        "wrong key"
    );
    assert!(acquire(&mut a, 0, we_ro, 0xaaaa, 0).is_success());
    // Registrants may write under Write Exclusive - Registrants Only.
    assert!(write_status(&mut b).is_success());

    // B preempts A (a cluster node fencing a dead one): A's registration goes, and with it
    // A's writes; A's host is told through the log page and an asynchronous event.
    let preempt = pr::ACQUIRE_ACT_PREEMPT;
    assert!(acquire(&mut b, preempt, pr::WRITE_EXCLUSIVE, 0xbbbb, 0xaaaa).is_success());
    assert_eq!(write_status(&mut a), conflict());
    assert!(
        read_status(&mut a).is_success(),
        "Write Exclusive leaves reads to all"
    );
    assert!(write_status(&mut b).is_success());
    let aen = fired_aer(&mut a_admin);
    assert_eq!(aen.result as u32 & 0x7, u32::from(spec::aer::TYPE_CSS));
    assert_eq!(
        (aen.result as u32 >> 16) & 0xff,
        u32::from(spec::log::RESERVATION)
    );
    let page = get_log(&mut a_admin, spec::log::RESERVATION, 64, 0, false)
        .data
        .expect("log page")
        .into_vec();
    assert_eq!(page[8], pr::LOG_REGISTRATION_PREEMPTED);
    assert_eq!(
        u32::from_le_bytes(page[12..16].try_into().unwrap()),
        1,
        "nsid"
    );
    let empty = get_log(&mut a_admin, spec::log::RESERVATION, 64, 0, false);
    assert_eq!(empty.data.expect("page").as_slice()[8], pr::LOG_EMPTY);

    // Report (extended structure only): B alone, holding Write Exclusive.
    assert_eq!(
        report(&mut a, false).completion.status,
        Status::error(sc::HOST_ID_INCONSIST)
    );
    let r = report(&mut a, true);
    assert!(r.completion.status.is_success());
    let page = r.data.expect("report").into_vec();
    assert_eq!(page[4], pr::WRITE_EXCLUSIVE);
    assert_eq!(u16::from_le_bytes([page[5], page[6]]), 1);
    assert_eq!(&page[64 + 16..64 + 32], &ID_B);
    assert_eq!(page[64 + 2], 1, "holder");
    drop(f);
}

#[test]
fn fused_compare_and_write_and_every_write_kind_meet_the_reservation() {
    let (_f, (_aa, mut a), (_ba, mut b)) = two_hosts();
    assert!(register(&mut a, 1).is_success());
    assert!(acquire(&mut a, 0, pr::EXCLUSIVE_ACCESS, 1, 0).is_success());
    assert_eq!(
        read_status(&mut b),
        conflict(),
        "Exclusive Access: no reads either"
    );
    let mut zeroes = sqe(io_opcode::WRITE_ZEROES, 40, 1);
    set_cdw(&mut zeroes, 12, 0);
    assert_eq!(
        one(run(&mut b, Command::from_bytes(&zeroes), None))
            .completion
            .status,
        conflict()
    );
    let flush = Command::from_bytes(&sqe(io_opcode::FLUSH, 41, 1));
    assert_eq!(one(run(&mut b, flush, None)).completion.status, conflict());
    // A fused compare-and-write from B: both halves refused.
    let mut compare = sqe(io_opcode::COMPARE, 42, 1);
    compare[1] = spec::fuse::FIRST;
    set_data_len(&mut compare, 512);
    let mut write = sqe(io_opcode::WRITE, 43, 1);
    write[1] = spec::fuse::SECOND;
    set_data_len(&mut write, 512);
    assert!(run(
        &mut b,
        Command::from_bytes(&compare),
        Some(IoBuf::from_vec(vec![0; 512]))
    )
    .is_empty());
    let answers = run(
        &mut b,
        Command::from_bytes(&write),
        Some(IoBuf::from_vec(vec![1; 512])),
    );
    assert_eq!(answers.len(), 2);
    assert_eq!(answers[0].completion.status, conflict());
    // A still writes; after A releases, B writes again.
    assert!(write_status(&mut a).is_success());
    let release = u32::from(pr::EXCLUSIVE_ACCESS) << pr::RTYPE_SHIFT;
    assert!(resv(&mut a, io_opcode::RESV_RELEASE, release, &[1]).is_success());
    assert!(write_status(&mut b).is_success());
}

#[test]
fn registrations_belong_to_the_host_and_outlive_its_controller() {
    let (f, (a_admin, mut a), (_ba, mut b)) = two_hosts();
    assert!(register(&mut a, 7).is_success());
    assert!(acquire(&mut a, 0, pr::WRITE_EXCLUSIVE, 7, 0).is_success());
    drop(a);
    drop(a_admin); // the host disconnects: its reservation stays
    assert_eq!(write_status(&mut b), conflict());
    // The same host (same host ID) on a new controller, another path, holds it still.
    let (_a2_admin, mut a2) = attach(&f, HOSTNQN, ID_A);
    assert!(write_status(&mut a2).is_success());
    let unregister = pr::REGISTER_ACT_UNREG;
    assert!(resv(&mut a2, io_opcode::RESV_REGISTER, unregister, &[7, 0]).is_success());
    assert!(
        write_status(&mut b).is_success(),
        "unregistering released it"
    );
}

#[test]
fn identify_reports_the_capabilities_and_a_gateway_without_reservations_offers_none() {
    let (f, (mut a_admin, _a), _) = two_hosts();
    let ctrl = identify(&mut a_admin, spec::cns::CTRL, 0)
        .data
        .expect("id-ctrl")
        .into_vec();
    let oncs = u16::from_le_bytes([ctrl[520], ctrl[521]]);
    assert_ne!(oncs & spec::ctrl::ONCS_RESERVATIONS, 0);
    let ns = identify(&mut a_admin, spec::cns::NS, 1)
        .data
        .expect("id-ns")
        .into_vec();
    assert_eq!(ns[31], 0b1111_1110, "types 1-6 and IEKEY, no PTPL");
    let effects = get_log(&mut a_admin, spec::log::CMD_EFFECTS, 4096, 0, false)
        .data
        .expect("effects")
        .into_vec();
    let io = |op: u8| {
        u32::from_le_bytes(
            effects[1024 + 4 * usize::from(op)..][..4]
                .try_into()
                .unwrap(),
        )
    };
    assert_ne!(io(io_opcode::RESV_ACQUIRE) & spec::effects::CSUPP, 0);
    drop(f);

    let mut f = fixture();
    let target = std::sync::Arc::try_unwrap(f.target).expect("only the fixture holds it");
    f.target = std::sync::Arc::new(target.with_reservations(false));
    let (mut admin, mut io_q) = attach(&f, HOSTNQN, ID_A);
    let ctrl = identify(&mut admin, spec::cns::CTRL, 0)
        .data
        .expect("id-ctrl")
        .into_vec();
    assert_eq!(
        u16::from_le_bytes([ctrl[520], ctrl[521]]) & spec::ctrl::ONCS_RESERVATIONS,
        0
    );
    let ns = identify(&mut admin, spec::cns::NS, 1)
        .data
        .expect("id-ns")
        .into_vec();
    assert_eq!(ns[31], 0);
    assert_eq!(register(&mut io_q, 1), Status::error(sc::INVALID_OPCODE));
}

#[test]
fn masked_notices_are_not_logged() {
    let (_f, (mut a_admin, mut a), (_ba, mut b)) = two_hosts();
    let mut mask = sqe(spec::admin_opcode::SET_FEATURES, 50, spec::NSID_ALL);
    set_cdw(&mut mask, 10, u32::from(spec::feat::RESV_MASK));
    set_cdw(&mut mask, 11, pr::NOTIFY_MASK_REG_PREEMPTED);
    assert!(one(run(&mut a_admin, Command::from_bytes(&mask), None))
        .completion
        .status
        .is_success());
    assert!(register(&mut a, 1).is_success());
    assert!(register(&mut b, 2).is_success());
    assert!(acquire(&mut b, pr::ACQUIRE_ACT_PREEMPT, pr::WRITE_EXCLUSIVE, 2, 1).is_success());
    let page = get_log(&mut a_admin, spec::log::RESERVATION, 64, 0, false)
        .data
        .expect("page")
        .into_vec();
    assert_eq!(page[8], pr::LOG_EMPTY, "the preemption notice was masked");
}

/// A fixture whose target stores every reservation change (a gateway of a group), with
/// both hosts allowed.
fn group_fixture() -> Fixture {
    let mut f = fixture();
    let target = std::sync::Arc::try_unwrap(f.target).expect("only the fixture holds it");
    f.target = std::sync::Arc::new(target.with_persisted_reservations(true));
    f.target
        .subsystem(SUBNQN)
        .expect("subsystem")
        .set_access(HostAccess::Only(
            [HOSTNQN.to_string(), OTHER_HOST.to_string()].into(),
        ));
    f
}

/// Starts a reservation command without running the device ops it asks for.
fn start_resv(q: &mut Queue, opcode: u8, cdw10: u32, keys: &[u64], cid: u16) -> Vec<Action> {
    let data: Vec<u8> = keys.iter().flat_map(|k| k.to_le_bytes()).collect();
    let mut raw = sqe(opcode, cid, 1);
    set_cdw(&mut raw, 10, cdw10);
    set_data_len(&mut raw, data.len() as u32);
    let mut actions = Vec::new();
    q.execute(
        Command::from_bytes(&raw),
        Some(IoBuf::from_vec(data)),
        &mut actions,
    );
    actions
}

/// The single record store among `actions`: (tag, the state it stores).
fn the_store(actions: &[Action]) -> (u64, pr_state::ReservationState) {
    assert_eq!(
        actions.len(),
        1,
        "only the store, no completion: {actions:?}"
    );
    match &actions[0] {
        Action::Submit {
            tag,
            op: rbd_backend::IoOp::StoreRecord { key, value },
            ..
        } => {
            assert_eq!(key, pr_state::RECORD_KEY);
            (
                *tag,
                pr_state::ReservationState::decode(value).expect("a record"),
            )
        }
        other => panic!("expected a record store, got {other:?}"),
    }
}

fn stored_record(f: &Fixture) -> Option<pr_state::ReservationState> {
    let ns = f
        .target
        .subsystem(SUBNQN)
        .and_then(|s| s.namespace(1))
        .expect("namespace 1");
    ns.device
        .load_record(pr_state::RECORD_KEY)
        .expect("load")
        .map(|r| pr_state::ReservationState::decode(&r).expect("a record"))
}

use super::pr as pr_state;

#[test]
fn in_a_group_a_change_completes_only_after_its_store_and_takes_effect_then() {
    let f = group_fixture();
    let sub = f.target.subsystem(SUBNQN).expect("subsystem");
    let (_a_admin, mut a) = attach(&f, HOSTNQN, ID_A);
    let (mut b_admin, mut b) = attach(&f, OTHER_HOST, ID_B);
    arm_aer(&mut b_admin, 0);
    assert!(
        register(&mut b, 0xbbbb).is_success(),
        "stored and completed"
    );
    let actions = start_resv(&mut a, io_opcode::RESV_REGISTER, 0, &[0, 0xaaaa], 40);
    let (_, stored) = the_store(&actions);
    assert_eq!(
        stored.registrants.len(),
        2,
        "the store carries the new state"
    );
    assert_eq!(
        sub.reservations.state(1).registrants.len(),
        1,
        "not in effect before the store completes"
    );
    let done = super::tests::settle(&mut a, actions);
    assert!(one(done).completion.status.is_success());
    assert_eq!(sub.reservations.state(1), stored, "in effect once stored");
    assert_eq!(stored_record(&f), Some(stored));

    // A takes a Write Exclusive reservation: B's writes meet it only once it is stored.
    let actions = start_resv(
        &mut a,
        io_opcode::RESV_ACQUIRE,
        u32::from(pr::WRITE_EXCLUSIVE) << pr::RTYPE_SHIFT,
        &[0xaaaa, 0],
        41,
    );
    the_store(&actions);
    assert!(write_status(&mut b).is_success(), "not reserved yet");
    assert!(one(super::tests::settle(&mut a, actions))
        .completion
        .status
        .is_success());
    assert_eq!(write_status(&mut b), conflict(), "reserved now");

    // A changes the type (a preempt of itself): B is told the reservation was released,
    // and only once the change is stored.
    let actions = start_resv(
        &mut a,
        io_opcode::RESV_ACQUIRE,
        pr::ACQUIRE_ACT_PREEMPT | (u32::from(pr::EXCLUSIVE_ACCESS) << pr::RTYPE_SHIFT),
        &[0xaaaa, 0xaaaa],
        42,
    );
    the_store(&actions);
    let mut early = Vec::new();
    b_admin.poll_events(&mut early);
    assert!(early.is_empty(), "no notice before the store: {early:?}");
    assert!(one(super::tests::settle(&mut a, actions))
        .completion
        .status
        .is_success());
    let aen = fired_aer(&mut b_admin);
    assert_eq!(
        (aen.result as u32 >> 16) & 0xff,
        u32::from(spec::log::RESERVATION)
    );
    assert_eq!(
        stored_record(&f).map(|s| s.holder),
        Some(Some((ID_A, pr::EXCLUSIVE_ACCESS)))
    );
}

#[test]
fn in_a_group_a_failed_store_fails_the_command_and_leaves_the_state() {
    let f = group_fixture();
    let sub = f.target.subsystem(SUBNQN).expect("subsystem");
    let (_a_admin, mut a) = attach(&f, HOSTNQN, ID_A);
    let (_b_admin, mut b) = attach(&f, OTHER_HOST, ID_B);
    assert!(register(&mut a, 0xaaaa).is_success());
    let before = sub.reservations.state(1);
    let we = u32::from(pr::WRITE_EXCLUSIVE) << pr::RTYPE_SHIFT;
    for (error, status) in [
        (
            rbd_backend::IoError::Device("osd timeout".into()),
            Status::retryable(sc::INTERNAL),
        ),
        (
            rbd_backend::IoError::Fenced("blocklisted".into()),
            Status::retryable(sc::ANA_INACCESSIBLE),
        ),
    ] {
        let actions = start_resv(&mut a, io_opcode::RESV_ACQUIRE, we, &[0xaaaa, 0], 42);
        let (tag, _) = the_store(&actions);
        let Some(Action::Submit { op, .. }) = actions.into_iter().next() else {
            unreachable!()
        };
        let mut out = Vec::new();
        a.complete_io(
            rbd_backend::IoDone {
                tag,
                op,
                result: Err(error),
            },
            &mut out,
        );
        let responses = super::tests::settle(&mut a, out);
        assert_eq!(one(responses).completion.status, status);
        assert_eq!(sub.reservations.state(1), before, "state unchanged");
        assert!(
            write_status(&mut b).is_success(),
            "no reservation in effect"
        );
    }
    // The namespace is free for the next change: it is stored and takes effect.
    let acquire_we = acquire(&mut a, 0, pr::WRITE_EXCLUSIVE, 0xaaaa, 0);
    assert!(acquire_we.is_success());
    assert_eq!(write_status(&mut b), conflict());
}

#[test]
fn in_a_group_a_second_change_waits_for_the_store_in_progress() {
    let f = group_fixture();
    let sub = f.target.subsystem(SUBNQN).expect("subsystem");
    let (_a_admin, mut a) = attach(&f, HOSTNQN, ID_A);
    let (_b_admin, mut b) = attach(&f, OTHER_HOST, ID_B);
    let a_store = start_resv(&mut a, io_opcode::RESV_REGISTER, 0, &[0, 0xaaaa], 43);
    the_store(&a_store);
    let parked = start_resv(&mut b, io_opcode::RESV_REGISTER, 0, &[0, 0xbbbb], 44);
    assert!(parked.is_empty(), "B waits: {parked:?}");
    let mut nothing = Vec::new();
    b.poll_events(&mut nothing);
    assert!(nothing.is_empty(), "still waiting while A's store runs");
    assert!(one(super::tests::settle(&mut a, a_store))
        .completion
        .status
        .is_success());
    let mut retried = Vec::new();
    b.poll_events(&mut retried);
    let (_, stored) = the_store(&retried);
    assert_eq!(
        stored.registrants.len(),
        2,
        "B's change is computed from the state A's store left"
    );
    assert!(one(super::tests::settle(&mut b, retried))
        .completion
        .status
        .is_success());
    assert_eq!(sub.reservations.state(1).generation, 2);

    // A queue that goes away with its store in flight frees the namespace; the change it
    // carried never takes effect.
    let orphan = start_resv(
        &mut a,
        io_opcode::RESV_REGISTER,
        pr::REGISTER_ACT_UNREG,
        &[0xaaaa, 0],
        45,
    );
    the_store(&orphan);
    drop(orphan);
    drop(a);
    assert_eq!(sub.reservations.state(1).registrants.len(), 2);
    assert!(
        acquire(&mut b, 0, pr::WRITE_EXCLUSIVE, 0xbbbb, 0).is_success(),
        "not left waiting behind a store nobody completes"
    );
}

#[test]
fn in_a_group_only_the_optimized_path_runs_reservation_commands() {
    let f = group_fixture();
    let sub = f.target.subsystem(SUBNQN).expect("subsystem");
    let (_a_admin, mut a) = attach(&f, HOSTNQN, ID_A);
    assert!(register(&mut a, 1).is_success());
    sub.set_ana_state(1, spec::ana::NON_OPTIMIZED);
    let path = Status::retryable(sc::ANA_INACCESSIBLE);
    assert_eq!(register(&mut a, 2), path);
    assert_eq!(report(&mut a, true).completion.status, path);
    // Standalone, a non-optimized path runs them as before.
    let f = fixture();
    f.target
        .subsystem(SUBNQN)
        .expect("subsystem")
        .set_ana_state(1, spec::ana::NON_OPTIMIZED);
    let (_admin, mut q) = attach(&f, HOSTNQN, ID_A);
    assert!(register(&mut q, 1).is_success());
}

/// What a new owner does before its path turns optimized: the state the old owner stored
/// becomes the state, conflicts and all.
#[test]
fn a_loaded_record_becomes_the_state() {
    let f = group_fixture();
    let sub = f.target.subsystem(SUBNQN).expect("subsystem");
    let (_a_admin, mut a) = attach(&f, HOSTNQN, ID_A);
    let (_b_admin, mut b) = attach(&f, OTHER_HOST, ID_B);
    assert!(register(&mut a, 0xaaaa).is_success());
    assert!(acquire(&mut a, 0, pr::EXCLUSIVE_ACCESS, 0xaaaa, 0).is_success());
    let record = stored_record(&f).expect("stored");
    sub.reservations.forget(1);
    assert!(read_status(&mut b).is_success(), "forgotten");
    sub.reservations.load(1, record.clone());
    assert_eq!(
        read_status(&mut b),
        conflict(),
        "loaded: B is excluded again"
    );
    assert_eq!(sub.reservations.state(1), record);
}

/// Preempt and Abort completes only after a Flush of the device submitted once the
/// preemption is in effect (standalone: at once; in a group: after the store).
#[test]
fn preempt_and_abort_completes_after_a_barrier_at_the_device() {
    for group in [false, true] {
        let f = if group {
            group_fixture()
        } else {
            two_hosts().0
        };
        let sub = f.target.subsystem(SUBNQN).expect("subsystem");
        if !group {
            sub.set_access(HostAccess::AnyHost);
        }
        let (_a_admin, mut a) = attach(&f, HOSTNQN, ID_A);
        let (_b_admin, mut b) = attach(&f, OTHER_HOST, ID_B);
        assert!(register(&mut a, 0xaaaa).is_success());
        assert!(register(&mut b, 0xbbbb).is_success());
        assert!(acquire(&mut a, 0, pr::WRITE_EXCLUSIVE, 0xaaaa, 0).is_success());
        let cdw10 =
            pr::ACQUIRE_ACT_PREEMPT_AND_ABORT | (u32::from(pr::WRITE_EXCLUSIVE) << pr::RTYPE_SHIFT);
        let mut actions = start_resv(
            &mut b,
            io_opcode::RESV_ACQUIRE,
            cdw10,
            &[0xbbbb, 0xaaaa],
            46,
        );
        if group {
            // The store first; its completion brings the barrier, not the response.
            the_store(&actions);
            let Some(Action::Submit { device, tag, op }) = actions.pop() else {
                unreachable!()
            };
            let sink = std::sync::Arc::new(Sink::default());
            let dyn_sink: std::sync::Arc<dyn rbd_backend::IoCompletion> = sink.clone();
            device.submit(tag, op, &dyn_sink);
            let done = sink.0.lock().unwrap().pop().expect("store done");
            b.complete_io(done, &mut actions);
        }
        assert_eq!(actions.len(), 1, "group {group}: {actions:?}");
        assert!(
            matches!(
                actions[0],
                Action::Submit {
                    op: rbd_backend::IoOp::Flush,
                    ..
                }
            ),
            "group {group}: a Flush before the completion: {actions:?}"
        );
        assert_eq!(
            write_status(&mut a),
            conflict(),
            "in effect before the barrier"
        );
        let done = super::tests::settle(&mut b, actions);
        assert!(one(done).completion.status.is_success(), "group {group}");
    }
}

#[derive(Default)]
struct Sink(std::sync::Mutex<Vec<rbd_backend::IoDone>>);
impl rbd_backend::IoCompletion for Sink {
    fn complete(&self, done: rbd_backend::IoDone) {
        self.0.lock().unwrap().push(done);
    }
}
