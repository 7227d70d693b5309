//! Byte-level tests of the core: commands in, actions out, no socket.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, Weak};

use rbd_backend::{BlockDevice, IoBuf, IoCompletion, IoDone, MemoryDevice};

use super::*;
use crate::spec::{self, admin_opcode, fabrics, io_opcode, sc};

pub(crate) const SUBNQN: &str = "nqn.2016-06.io.test:sub";
pub(crate) const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:host-a";
pub(crate) const OTHER_HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:host-b";
const NS_BYTES: u64 = 8 << 20;
/// CC as the Linux host writes it to enable a controller: EN with the NVM command set's
/// entry sizes.
pub(crate) const CC_ENABLED: u32 = spec::cc::ENABLE
    | (spec::cc::NVM_IOSQES << spec::cc::IOSQES_SHIFT)
    | (spec::cc::NVM_IOCQES << spec::cc::IOCQES_SHIFT);
/// CC.SHN: normal shutdown.
const CC_SHUTDOWN: u32 = 1 << spec::cc::SHN_SHIFT;

struct Wakes(Mutex<u32>);
impl QueueNotifier for Wakes {
    fn wake(&self) {
        *self.0.lock().unwrap() += 1;
    }
}

#[derive(Default)]
struct Collect(Mutex<Vec<IoDone>>);
impl IoCompletion for Collect {
    fn complete(&self, done: IoDone) {
        self.0.lock().unwrap().push(done);
    }
}

pub(crate) struct Fixture {
    pub(crate) target: Arc<Target>,
    device: Arc<MemoryDevice>,
    notifier: Arc<Wakes>,
}

pub(crate) fn fixture() -> Fixture {
    let target = Arc::new(Target::new(TargetIdentity::default()));
    let sub = Arc::new(Subsystem::new(
        SubsystemKind::Nvm,
        SubsystemSpec {
            nqn: SUBNQN.into(),
            serial: "SN123".into(),
            model: "test model".into(),
            access: HostAccess::Only(BTreeSet::from([HOSTNQN.to_string()])),
            cntlid_min: 10,
            cntlid_max: 12,
        },
    ));
    let device = Arc::new(MemoryDevice::new("mem", NS_BYTES));
    sub.add_namespace(Arc::new(Namespace {
        nsid: 1,
        device: device.clone(),
        lba_shift: 9,
        nguid: [1; 16],
        uuid: [2; 16],
        ana_group: 1,
        read_only: false,
        qos: Default::default(),
        frozen_size: Default::default(),
    }));
    device.set_event_sink(Arc::new(crate::events::NamespaceEvents::new(&sub, 1)));
    target.add_subsystem(sub);
    target.add_listener(ListenerInfo {
        transport: TransportType::Tcp,
        address: "127.0.0.1".into(),
        port: 4420,
        port_id: 1,
    });
    Fixture {
        target,
        device,
        notifier: Arc::new(Wakes(Mutex::new(0))),
    }
}

fn caps() -> TransportCaps {
    TransportCaps {
        in_capsule_data_size: 8192,
        keyed_sgls: false,
    }
}

impl Fixture {
    pub(crate) fn queue(&self) -> Queue {
        let strong: Arc<dyn QueueNotifier> = self.notifier.clone();
        let weak: Weak<dyn QueueNotifier> = Arc::downgrade(&strong);
        // Keep the notifier alive through the fixture's Arc, not this temporary.
        std::mem::forget(strong);
        Queue::new(self.target.clone(), caps(), weak)
    }
}

pub(crate) fn sqe(opcode: u8, cid: u16, nsid: u32) -> [u8; 64] {
    let mut raw = [0u8; 64];
    raw[0] = opcode;
    raw[2..4].copy_from_slice(&cid.to_le_bytes());
    raw[4..8].copy_from_slice(&nsid.to_le_bytes());
    raw
}

pub(crate) fn set_cdw(raw: &mut [u8; 64], n: usize, v: u32) {
    raw[n * 4..n * 4 + 4].copy_from_slice(&v.to_le_bytes());
}

pub(crate) fn set_data_len(raw: &mut [u8; 64], len: u32) {
    raw[32..36].copy_from_slice(&len.to_le_bytes());
    raw[39] = 0x5a; // transport SGL data block
}

pub(crate) fn connect(qid: u16, sqsize: u16, kato: u32) -> Command {
    let mut raw = sqe(fabrics::OPCODE, 100 + qid, 0);
    raw[4] = fabrics::CONNECT;
    set_data_len(&mut raw, 1024);
    raw[42..44].copy_from_slice(&qid.to_le_bytes());
    raw[44..46].copy_from_slice(&sqsize.to_le_bytes());
    raw[48..52].copy_from_slice(&kato.to_le_bytes());
    Command::from_bytes(&raw)
}

pub(crate) fn connect_data(subnqn: &str, hostnqn: &str, cntlid: u16) -> IoBuf {
    let mut d = vec![0u8; 1024];
    d[0..16].copy_from_slice(&[7; 16]);
    d[16..18].copy_from_slice(&cntlid.to_le_bytes());
    d[256..256 + subnqn.len()].copy_from_slice(subnqn.as_bytes());
    d[512..512 + hostnqn.len()].copy_from_slice(hostnqn.as_bytes());
    IoBuf::from_vec(d)
}

/// Runs a command to completion, executing device ops synchronously.
pub(crate) fn run(q: &mut Queue, cmd: Command, data: Option<IoBuf>) -> Vec<Response> {
    let mut actions = Vec::new();
    q.execute(cmd, data, &mut actions);
    settle(q, actions)
}

pub(crate) fn settle(q: &mut Queue, mut actions: Vec<Action>) -> Vec<Response> {
    let mut responses = Vec::new();
    while !actions.is_empty() {
        let mut next = Vec::new();
        for a in actions {
            match a {
                Action::Respond(r) => responses.push(r),
                Action::Submit { device, tag, op }
                | Action::SubmitThrottled {
                    device, tag, op, ..
                } => {
                    let sink = Arc::new(Collect::default());
                    let dyn_sink: Arc<dyn IoCompletion> = sink.clone();
                    device.submit(tag, op, &dyn_sink);
                    for done in sink.0.lock().unwrap().drain(..) {
                        q.complete_io(done, &mut next);
                    }
                }
                Action::Close => responses.push(Response {
                    completion: Completion::new(0xffff, Status::from_raw(0x7ff)),
                    data: None,
                }),
            }
        }
        actions = next;
    }
    responses
}

pub(crate) fn one(mut responses: Vec<Response>) -> Response {
    assert_eq!(responses.len(), 1, "{responses:?}");
    responses.remove(0)
}

pub(crate) fn property_set_cc(q: &mut Queue, value: u32) -> Status {
    let mut raw = sqe(fabrics::OPCODE, 1, 0);
    raw[4] = fabrics::PROPERTY_SET;
    set_cdw(&mut raw, 11, spec::reg::CC);
    set_cdw(&mut raw, 12, value);
    one(run(q, Command::from_bytes(&raw), None))
        .completion
        .status
}

fn property_get(q: &mut Queue, offset: u32, eight: bool) -> Response {
    let mut raw = sqe(fabrics::OPCODE, 2, 0);
    raw[4] = fabrics::PROPERTY_GET;
    raw[40] = u8::from(eight);
    set_cdw(&mut raw, 11, offset);
    one(run(q, Command::from_bytes(&raw), None))
}

/// Admin queue connected and enabled; returns the controller ID.
fn admin_ready(q: &mut Queue, kato: u32) -> u16 {
    let r = one(run(
        q,
        connect(0, 31, kato),
        Some(connect_data(SUBNQN, HOSTNQN, 0xffff)),
    ));
    assert!(
        r.completion.status.is_success(),
        "{:?}",
        r.completion.status
    );
    assert!(property_set_cc(q, CC_ENABLED).is_success());
    r.completion.result as u16
}

/// An admin queue connected and enabled, and I/O queue 1 of the same controller.
pub(crate) fn admin_and_io(f: &Fixture) -> (Queue, Queue) {
    let mut admin = f.queue();
    let cntlid = admin_ready(&mut admin, 0);
    let io = io_ready(f, cntlid, 1);
    (admin, io)
}

/// A discovery controller for `host` on `q`: Connect to the well-known discovery NQN (any
/// host may), then CC.EN.
pub(crate) fn discovery_ready(q: &mut Queue, host: &str) {
    let r = one(run(
        q,
        connect(0, 31, 0),
        Some(connect_data(spec::DISCOVERY_NQN, host, 0xffff)),
    ));
    assert!(
        r.completion.status.is_success(),
        "any host may discover: {:?}",
        r.completion.status
    );
    assert!(property_set_cc(q, CC_ENABLED).is_success());
}

/// The discovery log page (its first `len` bytes).
fn discovery_log(q: &mut Queue, len: u32) -> Vec<u8> {
    get_log(q, spec::log::DISC, len, 0, false)
        .data
        .unwrap()
        .into_vec()
}

pub(crate) fn io_ready(f: &Fixture, cntlid: u16, qid: u16) -> Queue {
    let mut q = f.queue();
    let r = one(run(
        &mut q,
        connect(qid, 127, 0),
        Some(connect_data(SUBNQN, HOSTNQN, cntlid)),
    ));
    assert!(
        r.completion.status.is_success(),
        "{:?}",
        r.completion.status
    );
    q
}

pub(crate) fn identify(q: &mut Queue, cns: u8, nsid: u32) -> Response {
    let mut raw = sqe(admin_opcode::IDENTIFY, 5, nsid);
    set_cdw(&mut raw, 10, u32::from(cns));
    set_data_len(&mut raw, 4096);
    one(run(q, Command::from_bytes(&raw), None))
}

pub(crate) fn get_log(q: &mut Queue, lid: u8, len: u32, offset: u64, rae: bool) -> Response {
    let mut raw = sqe(admin_opcode::GET_LOG_PAGE, 6, spec::NSID_ALL);
    let numd = len / 4 - 1;
    set_cdw(
        &mut raw,
        10,
        u32::from(lid) | (u32::from(rae) << 15) | ((numd & 0xffff) << 16),
    );
    set_cdw(&mut raw, 11, numd >> 16);
    set_cdw(&mut raw, 12, offset as u32);
    set_cdw(&mut raw, 13, (offset >> 32) as u32);
    set_data_len(&mut raw, len);
    one(run(q, Command::from_bytes(&raw), None))
}

pub(crate) fn rw(opcode: u8, cid: u16, slba: u64, blocks: u32) -> Command {
    let mut raw = sqe(opcode, cid, 1);
    set_cdw(&mut raw, 10, slba as u32);
    set_cdw(&mut raw, 11, (slba >> 32) as u32);
    set_cdw(&mut raw, 12, blocks - 1);
    set_data_len(&mut raw, blocks * 512);
    Command::from_bytes(&raw)
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// NUMREC of a discovery log page.
fn numrec(page: &[u8]) -> u64 {
    le64(page, 8)
}

/// A write of `data` at `slba` that must succeed.
pub(crate) fn write_ok(q: &mut Queue, cid: u16, slba: u64, data: Vec<u8>) {
    let blocks = (data.len() / 512) as u32;
    let w = one(run(
        q,
        rw(io_opcode::WRITE, cid, slba, blocks),
        Some(IoBuf::from_vec(data)),
    ));
    assert!(
        w.completion.status.is_success(),
        "{:?}",
        w.completion.status
    );
}

#[test]
fn identify_controller_satisfies_the_linux_host_checks() {
    let f = fixture();
    let mut q = f.queue();
    let cntlid = admin_ready(&mut q, 5000);
    assert_eq!(cntlid, 10, "first ID of the configured range");
    let r = identify(&mut q, spec::cns::CTRL, 0);
    let id = r.data.unwrap().into_vec();
    assert_eq!(id.len(), 4096);
    assert_eq!(le16(&id, 78), cntlid, "CNTLID equals Connect's");
    assert_ne!(le16(&id, 320), 0, "KAS != 0");
    assert!(le32(&id, 1792) >= 4, "IOCCSZ >= 4");
    assert!(le32(&id, 1796) >= 1, "IORCSZ >= 1");
    assert_eq!(id[76], 0b1011, "CMIC: multi-port, multi-controller, ANA");
    let (nn, mnan) = (le32(&id, 516), le32(&id, 540));
    assert!(mnan > 0 && mnan <= nn);
    assert_eq!(&id[768..768 + SUBNQN.len()], SUBNQN.as_bytes());
    assert_eq!(id[768 + SUBNQN.len()], 0);
    assert_eq!(&id[4..9], b"SN123");
    assert_eq!(id[111], 1, "I/O controller");
    assert_eq!(le16(&id, 522) & 1, 1, "fused compare-and-write advertised");
    assert_ne!(le16(&id, 266), 0, "WCTEMP");
}

#[test]
fn capabilities_report_a_timeout_and_enable_sets_ready() {
    let f = fixture();
    let mut q = f.queue();
    let r = one(run(
        &mut q,
        connect(0, 31, 0),
        Some(connect_data(SUBNQN, HOSTNQN, 0xffff)),
    ));
    assert!(r.completion.status.is_success());
    let cap = property_get(&mut q, spec::reg::CAP, true).completion.result;
    assert_ne!((cap >> 24) & 0xff, 0, "CAP.TO");
    assert_eq!(cap & 0xffff, 1023, "CAP.MQES");
    assert_eq!(
        property_get(&mut q, spec::reg::CSTS, false)
            .completion
            .result
            & 1,
        0
    );
    // Admin commands wait for CC.EN.
    let early = identify(&mut q, spec::cns::CTRL, 0);
    assert_eq!(early.completion.status.code(), sc::CMD_SEQ_ERROR);
    assert!(property_set_cc(&mut q, CC_ENABLED).is_success());
    assert_eq!(
        property_get(&mut q, spec::reg::CSTS, false)
            .completion
            .result
            & 1,
        1
    );
    assert!(property_set_cc(&mut q, CC_ENABLED | CC_SHUTDOWN).is_success());
    let csts = property_get(&mut q, spec::reg::CSTS, false)
        .completion
        .result as u32;
    assert_eq!(
        csts & spec::csts::SHST_MASK,
        spec::csts::SHST_CMPLT,
        "shutdown completes"
    );
    let vs = property_get(&mut q, spec::reg::VS, false).completion.result;
    assert_eq!(vs, 0x10400);
    // A 4-byte read of CAP is refused.
    assert_eq!(
        property_get(&mut q, spec::reg::CAP, false)
            .completion
            .status
            .code(),
        sc::INVALID_FIELD
    );
}

#[test]
fn connect_refuses_unknown_subsystems_and_hosts_with_the_spec_status() {
    let f = fixture();
    let mut q = f.queue();
    let r = one(run(
        &mut q,
        connect(0, 31, 0),
        Some(connect_data("nqn.2016-06.io.test:nope", HOSTNQN, 0xffff)),
    ));
    assert_eq!(r.completion.status.code(), sc::CONNECT_INVALID_PARAM);
    assert!(r.completion.status.dnr());
    assert_eq!(
        r.completion.result,
        (1 << 16) | 256,
        "IATTR=data, IPO=SUBNQN"
    );
    let r = one(run(
        &mut q,
        connect(0, 31, 0),
        Some(connect_data(SUBNQN, OTHER_HOST, 0xffff)),
    ));
    assert_eq!(r.completion.status.code(), sc::CONNECT_INVALID_HOST);
    assert_eq!(r.completion.result, (1 << 16) | 512, "IPO=HOSTNQN");
    let r = one(run(
        &mut q,
        connect(0, 0, 0),
        Some(connect_data(SUBNQN, HOSTNQN, 0xffff)),
    ));
    assert_eq!(
        r.completion.status.code(),
        sc::CONNECT_INVALID_PARAM,
        "SQSIZE 0"
    );
    let r = one(run(&mut q, connect(0, 31, 0), None));
    assert_eq!(
        r.completion.status.code(),
        sc::SGL_INVALID_DATA,
        "no connect data"
    );
    // The queue is still usable after refusals.
    assert_eq!(admin_ready(&mut q, 0), 10);
}

#[test]
fn commands_before_connect_are_a_sequence_error() {
    let f = fixture();
    let mut q = f.queue();
    let r = identify(&mut q, spec::cns::CTRL, 0);
    assert_eq!(r.completion.status.code(), sc::CMD_SEQ_ERROR);
    let r = one(run(&mut q, rw(io_opcode::READ, 1, 0, 1), None));
    assert_eq!(r.completion.status.code(), sc::CMD_SEQ_ERROR);
}

#[test]
fn io_queues_write_read_and_refuse_duplicates_and_bad_ranges() {
    let f = fixture();
    let mut admin = f.queue();
    let cntlid = admin_ready(&mut admin, 0);
    let mut q = io_ready(&f, cntlid, 1);
    let mut dup = f.queue();
    let r = one(run(
        &mut dup,
        connect(1, 127, 0),
        Some(connect_data(SUBNQN, HOSTNQN, cntlid)),
    ));
    assert_eq!(
        r.completion.status.code(),
        sc::CMD_SEQ_ERROR,
        "duplicate QID"
    );
    let mut wrong = f.queue();
    let r = one(run(
        &mut wrong,
        connect(2, 127, 0),
        Some(connect_data(SUBNQN, HOSTNQN, 999)),
    ));
    assert_eq!(
        r.completion.status.code(),
        sc::CONNECT_INVALID_PARAM,
        "unknown CNTLID"
    );

    let data: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
    let w = one(run(
        &mut q,
        rw(io_opcode::WRITE, 7, 8, 8),
        Some(IoBuf::from_vec(data.clone())),
    ));
    assert!(w.completion.status.is_success());
    assert_eq!(w.completion.sq_id, 1);
    let r = one(run(&mut q, rw(io_opcode::READ, 8, 8, 8), None));
    assert!(r.completion.status.is_success());
    assert_eq!(r.data.unwrap().into_vec(), data);

    let last = NS_BYTES / 512;
    let r = one(run(&mut q, rw(io_opcode::READ, 9, last - 1, 2), None));
    assert_eq!(r.completion.status.code(), sc::LBA_RANGE);
    let mut bad_ns = rw(io_opcode::READ, 10, 0, 1).as_bytes().to_owned();
    bad_ns[4..8].copy_from_slice(&9u32.to_le_bytes());
    let r = one(run(&mut q, Command::from_bytes(&bad_ns), None));
    assert_eq!(r.completion.status.code(), sc::INVALID_NS);
    let r = one(run(
        &mut q,
        rw(io_opcode::WRITE, 11, 0, 2),
        Some(IoBuf::zeroed(512)),
    ));
    assert_eq!(
        r.completion.status.code(),
        sc::SGL_INVALID_DATA,
        "data shorter than the blocks"
    );
    let r = one(run(&mut q, Command::from_bytes(&sqe(0x7e, 12, 1)), None));
    assert_eq!(r.completion.status.code(), sc::INVALID_OPCODE);
}

#[test]
fn fused_compare_and_write_is_all_or_nothing() {
    let f = fixture();
    let (_admin, mut q) = admin_and_io(&f);
    write_ok(&mut q, 1, 0, vec![5; 512]);

    let fused = |cid: u16, opcode: u8, flag: u8| {
        let mut raw = *rw(opcode, cid, 0, 1).as_bytes();
        raw[1] = flag;
        Command::from_bytes(&raw)
    };
    // Miscompare: nothing written, compare fails, write aborted.
    let first = run(
        &mut q,
        fused(2, io_opcode::COMPARE, 1),
        Some(IoBuf::from_vec(vec![6; 512])),
    );
    assert!(first.is_empty(), "first half waits for its partner");
    let both = run(
        &mut q,
        fused(3, io_opcode::WRITE, 2),
        Some(IoBuf::from_vec(vec![7; 512])),
    );
    assert_eq!(both.len(), 2);
    assert_eq!(
        (both[0].completion.cid, both[0].completion.status.code()),
        (2, sc::COMPARE_FAILED)
    );
    assert_eq!(
        (both[1].completion.cid, both[1].completion.status.code()),
        (3, sc::FUSED_FAIL)
    );
    let r = one(run(&mut q, rw(io_opcode::READ, 4, 0, 1), None));
    assert_eq!(r.data.unwrap().into_vec(), vec![5; 512]);
    // Match: both succeed and the write lands.
    assert!(run(
        &mut q,
        fused(5, io_opcode::COMPARE, 1),
        Some(IoBuf::from_vec(vec![5; 512]))
    )
    .is_empty());
    let both = run(
        &mut q,
        fused(6, io_opcode::WRITE, 2),
        Some(IoBuf::from_vec(vec![7; 512])),
    );
    assert!(
        both.iter().all(|r| r.completion.status.is_success()),
        "{both:?}"
    );
    let r = one(run(&mut q, rw(io_opcode::READ, 7, 0, 1), None));
    assert_eq!(r.data.unwrap().into_vec(), vec![7; 512]);
    // A first half followed by an unrelated command is aborted as missing its partner.
    assert!(run(
        &mut q,
        fused(8, io_opcode::COMPARE, 1),
        Some(IoBuf::from_vec(vec![7; 512]))
    )
    .is_empty());
    let rs = run(&mut q, rw(io_opcode::READ, 9, 0, 1), None);
    assert_eq!(
        (rs[0].completion.cid, rs[0].completion.status.code()),
        (8, sc::FUSED_MISSING)
    );
    assert!(rs[1].completion.status.is_success());
    // Plain Compare.
    let mut cmp = *rw(io_opcode::COMPARE, 10, 0, 1).as_bytes();
    cmp[1] = 0;
    let r = one(run(
        &mut q,
        Command::from_bytes(&cmp),
        Some(IoBuf::from_vec(vec![8; 512])),
    ));
    assert_eq!(r.completion.status.code(), sc::COMPARE_FAILED);
}

#[test]
fn write_zeroes_and_deallocate_read_back_zero() {
    let f = fixture();
    let (_admin, mut q) = admin_and_io(&f);
    write_ok(&mut q, 1, 0, vec![9; 8192]);
    let mut wz = *rw(io_opcode::WRITE_ZEROES, 2, 0, 4).as_bytes();
    wz[32..40].fill(0);
    assert!(one(run(&mut q, Command::from_bytes(&wz), None))
        .completion
        .status
        .is_success());
    let mut dsm = sqe(io_opcode::DSM, 3, 1);
    set_cdw(&mut dsm, 10, 1); // two ranges
    set_cdw(&mut dsm, 11, spec::rw::DSM_AD);
    set_data_len(&mut dsm, 32);
    let mut ranges = vec![0u8; 32];
    ranges[4..8].copy_from_slice(&4u32.to_le_bytes());
    ranges[8..16].copy_from_slice(&4u64.to_le_bytes());
    ranges[20..24].copy_from_slice(&2u32.to_le_bytes());
    ranges[24..32].copy_from_slice(&12u64.to_le_bytes());
    let r = one(run(
        &mut q,
        Command::from_bytes(&dsm),
        Some(IoBuf::from_vec(ranges)),
    ));
    assert!(r.completion.status.is_success());
    let back = one(run(&mut q, rw(io_opcode::READ, 4, 0, 16), None))
        .data
        .unwrap()
        .into_vec();
    let blocks: Vec<u8> = back.chunks(512).map(|b| b[0]).collect();
    assert_eq!(blocks, [0, 0, 0, 0, 0, 0, 0, 0, 9, 9, 9, 9, 0, 0, 9, 9]);
}

#[test]
fn log_pages_validate_their_input() {
    let f = fixture();
    let mut q = f.queue();
    admin_ready(&mut q, 0);
    assert_eq!(
        get_log(&mut q, 0x42, 512, 0, false)
            .completion
            .status
            .code(),
        sc::INVALID_LOG_PAGE
    );
    assert_eq!(
        get_log(&mut q, spec::log::SMART, 512, 4096, false)
            .completion
            .status
            .code(),
        sc::INVALID_FIELD
    );
    let supported = get_log(&mut q, spec::log::SUPPORTED, 1024, 0, false)
        .data
        .unwrap()
        .into_vec();
    for lid in [0u8, 1, 2, 3, 4, 5, 0x0c] {
        assert_eq!(
            le32(&supported, usize::from(lid) * 4) & 1,
            1,
            "LID {lid:#x} listed"
        );
    }
    assert_eq!(
        le32(&supported, 0x70 * 4),
        0,
        "no discovery log on an I/O controller"
    );
    let ana = get_log(&mut q, spec::log::ANA, 4096, 0, false)
        .data
        .unwrap()
        .into_vec();
    assert_eq!(le16(&ana, 8), 1, "one ANA group");
    assert_eq!(le32(&ana, 16), 1, "group 1");
    assert_eq!(le32(&ana, 20), 1, "one namespace");
    assert_eq!(ana[32], spec::ana::OPTIMIZED);
    assert_eq!(le32(&ana, 48), 1, "NSID 1");
    // A window into the page: offset 16 starts at the first descriptor.
    let window = get_log(&mut q, spec::log::ANA, 8, 16, false)
        .data
        .unwrap()
        .into_vec();
    assert_eq!(window, ana[16..24]);
}

/// Get Log Page's NUMD may ask for 16 GiB; the host gets its buffer's worth. Any host may
/// connect to the discovery controller, so building the page at NUMD's size would let
/// anyone make the gateway allocate and zero 16 GiB.
#[test]
fn a_log_page_longer_than_the_host_buffer_is_cut_to_the_buffer() {
    let f = fixture();
    for discovery in [false, true] {
        let mut q = f.queue();
        let lid = if discovery {
            discovery_ready(&mut q, OTHER_HOST);
            spec::log::DISC
        } else {
            admin_ready(&mut q, 0);
            spec::log::ANA
        };
        let whole = get_log(&mut q, lid, 4096, 0, true).data.unwrap().into_vec();
        let mut raw = sqe(admin_opcode::GET_LOG_PAGE, 7, spec::NSID_ALL);
        set_cdw(&mut raw, 10, u32::from(lid) | (1 << 15) | (0xffff << 16));
        set_cdw(&mut raw, 11, 0xffff);
        set_data_len(&mut raw, 4096);
        let r = one(run(&mut q, Command::from_bytes(&raw), None));
        assert!(
            r.completion.status.is_success(),
            "{:?}",
            r.completion.status
        );
        assert_eq!(r.data.unwrap().into_vec(), whole, "discovery: {discovery}");
    }
}

#[test]
fn namespace_identity_is_reported_everywhere() {
    let f = fixture();
    let mut q = f.queue();
    admin_ready(&mut q, 0);
    let ns = identify(&mut q, spec::cns::NS, 1).data.unwrap().into_vec();
    assert_eq!(le64(&ns, 0), NS_BYTES / 512);
    assert_eq!(ns[30] & 1, 1, "NMIC shared");
    assert_eq!(le32(&ns, 92), 1, "ANAGRPID");
    assert_eq!(&ns[104..120], &[1; 16], "NGUID");
    assert_eq!(ns[130], 9, "512-byte LBA");
    let desc = identify(&mut q, spec::cns::NS_DESC_LIST, 1)
        .data
        .unwrap()
        .into_vec();
    assert_eq!((desc[0], desc[1]), (spec::nidt::NGUID, 16));
    assert_eq!((desc[20], desc[21]), (spec::nidt::UUID, 16));
    assert_eq!(&desc[24..40], &[2; 16]);
    assert_eq!((desc[40], desc[41], desc[44]), (spec::nidt::CSI, 1, 0));
    let list = identify(&mut q, spec::cns::NS_ACTIVE_LIST, 0)
        .data
        .unwrap()
        .into_vec();
    assert_eq!((le32(&list, 0), le32(&list, 4)), (1, 0));
    let inactive = identify(&mut q, spec::cns::NS, 5).data.unwrap().into_vec();
    assert!(
        inactive.iter().all(|&b| b == 0),
        "inactive NSID reads as zeroes"
    );
    assert_eq!(
        identify(&mut q, spec::cns::NS, 5000)
            .completion
            .status
            .code(),
        sc::INVALID_NS
    );
}

#[test]
fn resize_completes_an_aer_and_fills_the_changed_namespace_list() {
    let f = fixture();
    let mut q = f.queue();
    admin_ready(&mut q, 0);
    let mut aec = sqe(admin_opcode::SET_FEATURES, 20, 0);
    set_cdw(&mut aec, 10, u32::from(spec::feat::ASYNC_EVENT));
    set_cdw(
        &mut aec,
        11,
        spec::aer::CFG_NS_ATTR | spec::aer::CFG_ANA_CHANGE,
    );
    assert!(one(run(&mut q, Command::from_bytes(&aec), None))
        .completion
        .status
        .is_success());
    assert!(run(
        &mut q,
        Command::from_bytes(&sqe(admin_opcode::ASYNC_EVENT, 21, 0)),
        None
    )
    .is_empty());
    let wakes_before = *f.notifier.0.lock().unwrap();
    f.device.resize(16 << 20);
    assert!(
        *f.notifier.0.lock().unwrap() > wakes_before,
        "the transport was woken"
    );
    let mut actions = Vec::new();
    q.poll_events(&mut actions);
    let aer = one(settle(&mut q, actions));
    assert_eq!(aer.completion.cid, 21);
    assert_eq!(
        aer.completion.result as u32, 0x04_00_02,
        "notice, NS attribute changed, log 04h"
    );
    let list = get_log(&mut q, spec::log::CHANGED_NS, 4096, 0, false)
        .data
        .unwrap()
        .into_vec();
    assert_eq!((le32(&list, 0), le32(&list, 4)), (1, 0));
    let again = get_log(&mut q, spec::log::CHANGED_NS, 4096, 0, false)
        .data
        .unwrap()
        .into_vec();
    assert_eq!(le32(&again, 0), 0, "read with RAE=0 cleared the list");
    let ns = identify(&mut q, spec::cns::NS, 1).data.unwrap().into_vec();
    assert_eq!(le64(&ns, 0), (16 << 20) / 512);
    // Too many AERs.
    for cid in 30..34 {
        assert!(run(
            &mut q,
            Command::from_bytes(&sqe(admin_opcode::ASYNC_EVENT, cid, 0)),
            None
        )
        .is_empty());
    }
    let r = one(run(
        &mut q,
        Command::from_bytes(&sqe(admin_opcode::ASYNC_EVENT, 34, 0)),
        None,
    ));
    assert_eq!(r.completion.status.code(), sc::ASYNC_LIMIT);
}

fn property_get_cc(cid: u16) -> Command {
    let mut raw = sqe(fabrics::OPCODE, cid, 0);
    raw[4] = fabrics::PROPERTY_GET;
    set_cdw(&mut raw, 11, spec::reg::CC);
    Command::from_bytes(&raw)
}

/// Every response the queue has to send now, events included.
fn poll_all(q: &mut Queue) -> Vec<Response> {
    let mut actions = Vec::new();
    q.poll_events(&mut actions);
    settle(q, actions)
}

/// A host reusing a parked AER's CID gave that AER up (SPDK's detach: it completes its AER
/// itself and reads CC with the same CID): the new command runs, the AER is dropped and
/// never completed, even when an event comes later, and the next AER gets that event.
#[test]
fn a_command_reusing_a_parked_aers_cid_drops_the_aer_and_runs() {
    let f = fixture();
    let mut q = f.queue();
    admin_ready(&mut q, 0);
    arm_aer(&mut q, spec::aer::CFG_NS_ATTR);
    let cc = one(run(&mut q, property_get_cc(21), None));
    assert_eq!(cc.completion.cid, 21);
    assert_eq!(cc.completion.status, Status::SUCCESS);
    assert_eq!(
        cc.completion.result as u32, CC_ENABLED,
        "CC as the host set it"
    );
    f.device.resize(16 << 20);
    assert!(
        poll_all(&mut q).is_empty(),
        "no completion for the dropped AER"
    );
    assert!(run(
        &mut q,
        Command::from_bytes(&sqe(admin_opcode::ASYNC_EVENT, 22, 0)),
        None
    )
    .is_empty());
    let next = poll_all(&mut q);
    let done = one(next).completion;
    assert_eq!((done.cid, done.status), (22, Status::SUCCESS));
    assert_eq!(done.result as u32, 0x04_00_02, "the event, on the next AER");
    assert!(poll_all(&mut q).is_empty(), "and nothing more");
}

/// An AER whose event is ready but whose completion is not sent yet is dropped the same way
/// when its CID is reused; its event waits for the next AER.
#[test]
fn reusing_the_cid_of_an_aer_with_a_ready_completion_keeps_the_event_for_the_next() {
    let f = fixture();
    let mut q = f.queue();
    admin_ready(&mut q, 0);
    arm_aer(&mut q, spec::aer::CFG_NS_ATTR);
    f.device.resize(16 << 20);
    let keep_alive = one(run(
        &mut q,
        Command::from_bytes(&sqe(admin_opcode::KEEP_ALIVE, 21, 0)),
        None,
    ));
    assert_eq!(
        (keep_alive.completion.cid, keep_alive.completion.status),
        (21, Status::SUCCESS)
    );
    assert!(
        poll_all(&mut q).is_empty(),
        "the dropped AER never completes"
    );
    assert!(run(
        &mut q,
        Command::from_bytes(&sqe(admin_opcode::ASYNC_EVENT, 23, 0)),
        None
    )
    .is_empty());
    let done = one(poll_all(&mut q)).completion;
    assert_eq!(
        (done.cid, done.result as u32),
        (23, 0x04_00_02),
        "the event is not lost"
    );
}

/// A CID in flight at a device stays refused as a conflict: the op completes under it.
#[test]
fn a_command_reusing_the_cid_of_an_op_at_a_device_is_a_conflict() {
    let f = fixture();
    let (_admin, mut io) = admin_and_io(&f);
    let mut held = Vec::new();
    io.execute(rw(io_opcode::READ, 40, 0, 1), None, &mut held);
    assert!(
        matches!(held.as_slice(), [Action::Submit { .. }]),
        "{held:?}"
    );
    let reuse = one(run(&mut io, rw(io_opcode::READ, 40, 0, 1), None));
    assert_eq!(
        (reuse.completion.cid, reuse.completion.status.code()),
        (40, sc::CMDID_CONFLICT)
    );
    let read = one(settle(&mut io, held));
    assert_eq!(
        (read.completion.cid, read.completion.status),
        (40, Status::SUCCESS)
    );
}

#[test]
fn discovery_log_lists_allowed_subsystems_on_every_listener() {
    let f = fixture();
    for (host, expected) in [(HOSTNQN, 2u64), (OTHER_HOST, 1)] {
        let mut q = f.queue();
        discovery_ready(&mut q, host);
        let id = identify(&mut q, spec::cns::CTRL, 0)
            .data
            .unwrap()
            .into_vec();
        assert_eq!(id[111], 2, "discovery controller");
        let page = discovery_log(&mut q, 4096);
        assert_eq!(numrec(&page), expected);
        if expected == 2 {
            let entry = &page[2048..3072];
            assert_eq!(entry[0], spec::disc::TRTYPE_TCP);
            assert_eq!(entry[2], spec::disc::SUBTYPE_NVME);
            // no secure channel on offer (libnvme would ask for TLS), SQ flow control
            // can be disabled
            assert_eq!(entry[3], 0b100, "TREQ");
            assert_eq!(&entry[32..36], b"4420");
            assert_eq!(&entry[256..256 + SUBNQN.len()], SUBNQN.as_bytes());
            assert_eq!(&entry[512..521], b"127.0.0.1");
        }
        assert_eq!(
            identify(&mut q, spec::cns::NS, 1).completion.status.code(),
            sc::INVALID_FIELD
        );
    }
}

/// An admin queue of SQSIZE 3 (four entries) connected with Connect attributes `cattr`,
/// and the SQHD of the Connect response and of five Property Gets after it.
fn sq_heads_after_connect(cattr: u8) -> (Queue, Vec<u16>) {
    let f = fixture();
    let mut q = f.queue();
    let mut cmd = *connect(0, 3, 0).as_bytes();
    cmd[46] = cattr;
    let connected = one(run(
        &mut q,
        Command::from_bytes(&cmd),
        Some(connect_data(SUBNQN, HOSTNQN, 0xffff)),
    ));
    assert!(connected.completion.status.is_success());
    let mut heads = vec![connected.completion.sq_head];
    for _ in 0..5 {
        heads.push(
            property_get(&mut q, spec::reg::VS, false)
                .completion
                .sq_head,
        );
    }
    (q, heads)
}

#[test]
fn completions_report_the_sq_head_modulo_the_queue_size() {
    let (q, heads) = sq_heads_after_connect(0);
    assert_eq!(heads, vec![0, 1, 2, 3, 0, 1]);
    assert!(!q.sq_flow_control_disabled());
}

#[test]
fn a_host_may_disable_sq_flow_control_at_connect() {
    let (q, heads) = sq_heads_after_connect(fabrics::CONNECT_DISABLE_SQFLOW);
    assert_eq!(
        heads,
        vec![fabrics::SQHD_FLOW_CONTROL_DISABLED, 0, 0, 0, 0, 0],
        "FFFFh acknowledges the request, then SQHD is reserved"
    );
    assert!(q.sq_flow_control_disabled(), "the transport is told");
}

/// TRADDR of each discovery log record, in order.
fn discovery_traddrs(page: &[u8]) -> Vec<String> {
    let records = numrec(page) as usize;
    (0..records)
        .map(|i| {
            let entry = &page[1024 * (i + 1)..1024 * (i + 2)];
            String::from_utf8_lossy(&entry[512..768])
                .trim_end_matches(['\0', ' '])
                .to_string()
        })
        .collect()
}

#[test]
fn a_wildcard_listener_is_listed_with_the_address_the_host_dialled() {
    let f = fixture();
    f.target.add_listener(ListenerInfo {
        transport: TransportType::Tcp,
        address: "0.0.0.0".into(),
        port: 4421,
        port_id: 2,
    });
    f.target.add_listener(ListenerInfo {
        transport: TransportType::Rdma,
        address: "::".into(),
        port: 4420,
        port_id: 3,
    });
    let discover = |local: Option<&str>| {
        let mut q = f.queue();
        if let Some(ip) = local {
            q.set_local_address(TransportType::Tcp, ip.parse().unwrap());
        }
        discovery_ready(&mut q, HOSTNQN);
        let page = discovery_log(&mut q, 8192);
        (discovery_traddrs(&page), page)
    };
    // The host reached us at 10.0.2.15 over TCP: the TCP wildcard becomes that address, a
    // listener with its own address keeps it, and the RDMA wildcard (another transport, whose
    // local address this connection does not know) stays as configured.
    let (addrs, page) = discover(Some("10.0.2.15"));
    assert_eq!(
        addrs,
        [
            "127.0.0.1",
            "10.0.2.15",
            "::",
            "127.0.0.1",
            "10.0.2.15",
            "::"
        ],
        "discovery entries (3 listeners) then the subsystem's (3 listeners)"
    );
    assert_eq!(page[1024 * 2 + 1], spec::disc::ADRFAM_IP4);
    assert_eq!(page[1024 * 3 + 1], spec::disc::ADRFAM_IP6);
    // An IPv4-mapped IPv6 local address (a dual-stack socket) is listed as plain IPv4.
    let (addrs, _) = discover(Some("::ffff:192.168.1.7"));
    assert_eq!(addrs[1], "192.168.1.7");
    // Without a local address the listener's own address is all there is.
    let (addrs, _) = discover(None);
    assert_eq!(addrs[1], "0.0.0.0");
}

#[test]
fn ipv6_listeners_are_listed_with_adrfam_ipv6_and_canonical_traddr() {
    let f = fixture();
    // A pushed listener as the control plane may spell it (uncompressed, bracketed), and a
    // dual-stack wildcard.
    f.target.add_listener(ListenerInfo {
        transport: TransportType::Tcp,
        address: "[0:0:0:0:0:0:0:1]".into(),
        port: 4430,
        port_id: 2,
    });
    f.target.add_listener(ListenerInfo {
        transport: TransportType::Tcp,
        address: "::".into(),
        port: 4431,
        port_id: 3,
    });
    let page_for = |local: &str| {
        let mut q = f.queue();
        q.set_local_address(TransportType::Tcp, local.parse().unwrap());
        discovery_ready(&mut q, HOSTNQN);
        discovery_log(&mut q, 8192)
    };
    // (ADRFAM byte, TRSVCID field, TRADDR field) of record `i` (1-based: 0 is the header).
    let record = |page: &[u8], i: usize| {
        let e = page[1024 * i..1024 * (i + 1)].to_vec();
        (e[1], e[32..64].to_vec(), e[512..768].to_vec())
    };
    let field = |text: &str, len: usize| {
        let mut f = text.as_bytes().to_vec();
        f.resize(len, 0);
        f
    };

    // Dialled at ::1 over IPv6.
    let page = page_for("::1");
    assert_eq!(
        numrec(&page),
        6,
        "NUMREC: 3 listeners x (discovery + the NVM subsystem)"
    );
    for base in [0, 3] {
        assert_eq!(
            record(&page, base + 1),
            (
                spec::disc::ADRFAM_IP4,
                field("4420", 32),
                field("127.0.0.1", 256)
            )
        );
        assert_eq!(
            record(&page, base + 2),
            (spec::disc::ADRFAM_IP6, field("4430", 32), field("::1", 256)),
            "no brackets, compressed"
        );
        assert_eq!(
            record(&page, base + 3),
            (spec::disc::ADRFAM_IP6, field("4431", 32), field("::1", 256)),
            "the wildcard [::] listed as the address dialled"
        );
    }
    // Dialled at a global IPv6 address.
    let page = page_for("fd00:0:0:0::15");
    assert_eq!(
        record(&page, 3),
        (
            spec::disc::ADRFAM_IP6,
            field("4431", 32),
            field("fd00::15", 256)
        )
    );
    // Dialled over IPv4 through the dual-stack [::] socket: IPv4 and its dotted address.
    let page = page_for("::ffff:127.0.0.1");
    assert_eq!(
        record(&page, 3),
        (
            spec::disc::ADRFAM_IP4,
            field("4431", 32),
            field("127.0.0.1", 256)
        )
    );
}

#[test]
fn keep_alive_expiry_tears_down_one_controller_and_its_queues() {
    let f = fixture();
    let mut admin_a = f.queue();
    let a = admin_ready(&mut admin_a, 1000);
    let mut io_a = io_ready(&f, a, 1);
    let mut admin_b = f.queue();
    let b = admin_ready(&mut admin_b, 1000);
    let ctrl_a = admin_a.controller().unwrap().clone();
    assert!(ctrl_a.take_keep_alive(), "traffic since connect");
    assert!(!ctrl_a.take_keep_alive(), "nothing since the last check");
    ctrl_a.teardown(TeardownReason::KeepAliveExpired);
    let mut actions = Vec::new();
    io_a.poll_events(&mut actions);
    assert!(matches!(actions.as_slice(), [Action::Close]), "{actions:?}");
    let sub = f.target.subsystem(SUBNQN).unwrap();
    assert!(sub.controller(a).is_none());
    assert!(sub.controller(b).is_some(), "the other controller lives on");
    let r = identify(&mut admin_b, spec::cns::CTRL, 0);
    assert!(r.completion.status.is_success());
    // The freed ID is reused within the range: 10, 11 taken → next 12, then 10 again.
    let mut admin_c = f.queue();
    assert_eq!(admin_ready(&mut admin_c, 0), 12);
    let mut admin_d = f.queue();
    assert_eq!(admin_ready(&mut admin_d, 0), 10);
    let mut admin_e = f.queue();
    let r = one(run(
        &mut admin_e,
        connect(0, 31, 0),
        Some(connect_data(SUBNQN, HOSTNQN, 0xffff)),
    ));
    assert_eq!(
        r.completion.status.code(),
        sc::CONNECT_CTRL_BUSY,
        "range exhausted"
    );
}

#[test]
fn features_required_by_the_host_answer() {
    let f = fixture();
    let mut q = f.queue();
    admin_ready(&mut q, 5000);
    let mut nq = sqe(admin_opcode::SET_FEATURES, 40, 0);
    set_cdw(&mut nq, 10, u32::from(spec::feat::NUM_QUEUES));
    set_cdw(&mut nq, 11, (3 << 16) | 3);
    assert_eq!(
        one(run(&mut q, Command::from_bytes(&nq), None))
            .completion
            .result,
        (3 << 16) | 3
    );
    let mut get = sqe(admin_opcode::GET_FEATURES, 41, 0);
    set_cdw(&mut get, 10, u32::from(spec::feat::KATO));
    assert_eq!(
        one(run(&mut q, Command::from_bytes(&get), None))
            .completion
            .result,
        5000
    );
    let mut hostid = sqe(admin_opcode::GET_FEATURES, 42, 0);
    set_cdw(&mut hostid, 10, u32::from(spec::feat::HOST_ID));
    set_cdw(&mut hostid, 11, 1);
    set_data_len(&mut hostid, 16);
    let r = one(run(&mut q, Command::from_bytes(&hostid), None));
    assert_eq!(r.data.unwrap().into_vec(), vec![7; 16]);
    for fid in [1u8, 2, 4, 5, 6, 8, 0x0a] {
        let mut g = sqe(admin_opcode::GET_FEATURES, 43, 0);
        set_cdw(&mut g, 10, u32::from(fid));
        assert!(
            one(run(&mut q, Command::from_bytes(&g), None))
                .completion
                .status
                .is_success(),
            "feature {fid:#x}"
        );
    }
    let mut save = sqe(admin_opcode::SET_FEATURES, 44, 0);
    set_cdw(
        &mut save,
        10,
        u32::from(spec::feat::ARBITRATION) | (1 << 31),
    );
    assert_eq!(
        one(run(&mut q, Command::from_bytes(&save), None))
            .completion
            .status
            .code(),
        sc::FEATURE_NOT_SAVEABLE
    );
    let mut unknown = sqe(admin_opcode::GET_FEATURES, 45, 0);
    set_cdw(&mut unknown, 10, 0x7d);
    assert_eq!(
        one(run(&mut q, Command::from_bytes(&unknown), None))
            .completion
            .status
            .code(),
        sc::INVALID_FIELD
    );
    let abort = one(run(
        &mut q,
        Command::from_bytes(&sqe(admin_opcode::ABORT, 46, 0)),
        None,
    ));
    assert_eq!(abort.completion.result & 1, 1, "not aborted");
}

/// Enables the given asynchronous events and parks one AER (cid 21).
pub(crate) fn arm_aer(q: &mut Queue, events: u32) {
    let mut aec = sqe(admin_opcode::SET_FEATURES, 20, 0);
    set_cdw(&mut aec, 10, u32::from(spec::feat::ASYNC_EVENT));
    set_cdw(&mut aec, 11, events);
    assert!(one(run(q, Command::from_bytes(&aec), None))
        .completion
        .status
        .is_success());
    assert!(run(
        q,
        Command::from_bytes(&sqe(admin_opcode::ASYNC_EVENT, 21, 0)),
        None
    )
    .is_empty());
}

/// The AER completion the queue has to send now (none: panics).
pub(crate) fn fired_aer(q: &mut Queue) -> Completion {
    let mut actions = Vec::new();
    q.poll_events(&mut actions);
    one(settle(q, actions)).completion
}

fn queue_closed(q: &mut Queue) -> bool {
    let mut actions = Vec::new();
    q.poll_events(&mut actions);
    matches!(actions.as_slice(), [Action::Close])
}

fn discovery_records(f: &Fixture, host: &str) -> (u64, u64) {
    let mut q = f.queue();
    discovery_ready(&mut q, host);
    let page = discovery_log(&mut q, 4096);
    (le64(&page, 0), numrec(&page))
}

#[test]
fn removed_namespace_is_announced_to_every_controller_and_in_flight_io_finishes() {
    let f = fixture();
    let mut admin_a = f.queue();
    let a = admin_ready(&mut admin_a, 0);
    arm_aer(&mut admin_a, spec::aer::CFG_NS_ATTR);
    let mut admin_b = f.queue();
    admin_ready(&mut admin_b, 0);
    arm_aer(&mut admin_b, spec::aer::CFG_NS_ATTR);
    let mut io = io_ready(&f, a, 1);
    assert!(one(run(
        &mut io,
        rw(io_opcode::WRITE, 7, 0, 1),
        Some(IoBuf::from_vec(vec![0xab; 512]))
    ))
    .completion
    .status
    .is_success());
    // A read submitted to the device, not completed yet, when the namespace goes.
    let mut in_flight = Vec::new();
    io.execute(rw(io_opcode::READ, 8, 0, 1), None, &mut in_flight);
    assert!(matches!(in_flight.as_slice(), [Action::Submit { .. }]));

    let sub = f.target.subsystem(SUBNQN).unwrap();
    let gone = sub.remove_namespace(1).expect("namespace 1 was there");
    assert!(sub.remove_namespace(1).is_none(), "removed once");
    sub.notify_namespace_changed(1);

    for q in [&mut admin_a, &mut admin_b] {
        assert_eq!(
            fired_aer(q).result as u32,
            0x04_00_02,
            "notice, NS attribute changed, log 04h"
        );
        let list = get_log(q, spec::log::CHANGED_NS, 4096, 0, false)
            .data
            .unwrap()
            .into_vec();
        assert_eq!(
            (le32(&list, 0), le32(&list, 4)),
            (1, 0),
            "changed list names NSID 1"
        );
        let active = identify(q, spec::cns::NS_ACTIVE_LIST, 0)
            .data
            .unwrap()
            .into_vec();
        assert_eq!(le32(&active, 0), 0, "no active namespace left");
    }
    // The read in flight completes with its data; new commands find no namespace.
    let done = one(settle(&mut io, in_flight));
    assert!(done.completion.status.is_success());
    assert_eq!(done.data.unwrap().into_vec(), vec![0xab; 512]);
    let r = one(run(&mut io, rw(io_opcode::READ, 9, 0, 1), None));
    assert_eq!(r.completion.status.code(), sc::INVALID_NS);
    // Nothing but the caller holds the namespace now: dropping it closes the device.
    assert_eq!(Arc::strong_count(&gone), 1);
}

#[test]
fn a_queue_gives_back_its_burst_buffers_only_with_nothing_in_flight() {
    static KEPT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let kept = || KEPT.load(std::sync::atomic::Ordering::Relaxed);
    const MIB: usize = 1 << 20;
    let f = fixture();
    let mut admin = f.queue();
    let cntlid = admin_ready(&mut admin, 0);
    let mut io = io_ready(&f, cntlid, 1);
    io.set_buffer_source(Box::new(RecycledBuffers::counted(&KEPT)));
    // What a burst of four 1 MiB commands leaves in the free list.
    let burst: Vec<IoBuf> = (0..4).map(|_| io.take_buffer(MIB)).collect();
    burst.into_iter().for_each(|b| io.recycle(b));
    assert_eq!(kept(), 4 * MIB as u64);

    let mut in_flight = Vec::new();
    io.execute(rw(io_opcode::READ, 3, 0, 8), None, &mut in_flight);
    assert!(matches!(in_flight.as_slice(), [Action::Submit { .. }]));
    // The read's buffer came from the free list: three stay there.
    assert_eq!(kept(), 3 * MIB as u64);
    assert!(!io.release_idle_buffers(), "a read is at the device");
    assert_eq!(kept(), 3 * MIB as u64, "a busy queue keeps its buffers");

    assert!(one(settle(&mut io, in_flight))
        .completion
        .status
        .is_success());
    assert!(io.release_idle_buffers(), "nothing in flight");
    assert!(
        kept() <= RecycledBuffers::KEEP_IDLE_BYTES as u64,
        "{} bytes kept by an idle queue",
        kept()
    );
}

#[test]
fn removed_host_is_refused_and_its_controllers_closed() {
    let f = fixture();
    let mut admin = f.queue();
    let cntlid = admin_ready(&mut admin, 0);
    let mut io = io_ready(&f, cntlid, 1);
    assert_eq!(discovery_records(&f, HOSTNQN).1, 2);
    let sub = f.target.subsystem(SUBNQN).unwrap();

    // Another host added: the connected one is not disturbed.
    let both = HostAccess::Only(BTreeSet::from([
        HOSTNQN.to_string(),
        OTHER_HOST.to_string(),
    ]));
    assert!(sub.set_access(both.clone()).is_empty());
    assert_eq!(sub.access(), both);
    assert!(!queue_closed(&mut io));
    assert_eq!(
        discovery_records(&f, OTHER_HOST).1,
        2,
        "now listed for host b"
    );

    // HOSTNQN removed: its controller is torn down, its queues close, it cannot come back.
    let revoked = sub.set_access(HostAccess::Only(BTreeSet::from([OTHER_HOST.to_string()])));
    assert_eq!(revoked.len(), 1);
    assert_eq!(revoked[0].cntlid, cntlid);
    assert!(queue_closed(&mut io));
    assert!(queue_closed(&mut admin));
    assert!(sub.controller(cntlid).is_none());
    let mut again = f.queue();
    let r = one(run(
        &mut again,
        connect(0, 31, 0),
        Some(connect_data(SUBNQN, HOSTNQN, 0xffff)),
    ));
    assert_eq!(r.completion.status.code(), sc::CONNECT_INVALID_HOST);
    assert_eq!(
        discovery_records(&f, HOSTNQN).1,
        1,
        "only the discovery entry"
    );
    // Any host again.
    sub.set_access(HostAccess::AnyHost);
    assert_eq!(admin_ready(&mut again, 0), 11);
}

#[test]
fn removed_subsystem_closes_its_controllers_and_leaves_the_discovery_log() {
    let f = fixture();
    let mut admin = f.queue();
    admin_ready(&mut admin, 0);
    let mut disc = f.queue();
    discovery_ready(&mut disc, HOSTNQN);
    arm_aer(&mut disc, spec::aer::CFG_DISC_CHANGE);
    let (generation, records) = discovery_records(&f, HOSTNQN);
    assert_eq!(records, 2);

    let removed = f.target.remove_subsystem(SUBNQN).expect("was there");
    assert_eq!(removed.nqn(), SUBNQN);
    assert!(f.target.remove_subsystem(SUBNQN).is_none());
    assert!(f.target.subsystem(SUBNQN).is_none());
    assert!(queue_closed(&mut admin), "its controller was torn down");
    assert_eq!(
        fired_aer(&mut disc).result as u32,
        0x70_f0_02,
        "notice, discovery log changed, log 70h"
    );
    let (after, records) = discovery_records(&f, HOSTNQN);
    assert!(after > generation, "GENCTR moved: {generation} -> {after}");
    assert_eq!(records, 1, "only the discovery entry");
    let mut q = f.queue();
    let r = one(run(
        &mut q,
        connect(0, 31, 0),
        Some(connect_data(SUBNQN, HOSTNQN, 0xffff)),
    ));
    assert_eq!(r.completion.status.code(), sc::CONNECT_INVALID_PARAM);
}

#[test]
fn removed_listener_leaves_the_discovery_log() {
    let f = fixture();
    f.target.add_listener(ListenerInfo {
        transport: TransportType::Tcp,
        address: "127.0.0.2".into(),
        port: 4421,
        port_id: 2,
    });
    let mut disc = f.queue();
    discovery_ready(&mut disc, HOSTNQN);
    arm_aer(&mut disc, spec::aer::CFG_DISC_CHANGE);
    let (generation, records) = discovery_records(&f, HOSTNQN);
    assert_eq!(records, 4, "discovery + subsystem on two listeners");

    assert!(
        !f.target
            .remove_listener(TransportType::Rdma, "127.0.0.2", 4421),
        "wrong transport"
    );
    assert!(
        !f.target
            .remove_listener(TransportType::Tcp, "127.0.0.2", 4420),
        "wrong port"
    );
    assert!(f
        .target
        .remove_listener(TransportType::Tcp, "127.0.0.2", 4421));
    assert_eq!(fired_aer(&mut disc).result as u32, 0x70_f0_02);
    let (after, records) = discovery_records(&f, HOSTNQN);
    assert!(after > generation);
    assert_eq!(records, 2);
    assert!(f.target.listeners().iter().all(|l| l.port != 4421));
}

/// The I/O opcodes whose entry in the Commands Supported and Effects log has CSUPP set.
fn effects_log_io_commands(admin: &mut Queue) -> BTreeSet<u8> {
    let page = get_log(admin, spec::log::CMD_EFFECTS, 4096, 0, false)
        .data
        .expect("effects log")
        .into_vec();
    (0..=u8::MAX)
        .filter(|&op| le32(&page, 1024 + 4 * usize::from(op)) & spec::effects::CSUPP != 0)
        .collect()
}

/// The I/O commands Identify Controller announces: the mandatory ones and, per ONCS bit
/// (NVMe Base 2.0 Figure 275), the optional ones.
fn identify_io_commands(admin: &mut Queue) -> BTreeSet<u8> {
    let ctrl = identify(admin, spec::cns::CTRL, 0)
        .data
        .expect("id-ctrl")
        .into_vec();
    let oncs = le16(&ctrl, 520);
    let mut ops = BTreeSet::from([io_opcode::FLUSH, io_opcode::WRITE, io_opcode::READ]);
    let optional: [(u16, &[u8]); 4] = [
        (spec::ctrl::ONCS_COMPARE, &[io_opcode::COMPARE]),
        (spec::ctrl::ONCS_DSM, &[io_opcode::DSM]),
        (spec::ctrl::ONCS_WRITE_ZEROES, &[io_opcode::WRITE_ZEROES]),
        (
            spec::ctrl::ONCS_RESERVATIONS,
            &[
                io_opcode::RESV_REGISTER,
                io_opcode::RESV_REPORT,
                io_opcode::RESV_ACQUIRE,
                io_opcode::RESV_RELEASE,
            ],
        ),
    ];
    for (bit, commands) in optional {
        if oncs & bit != 0 {
            ops.extend(commands);
        }
    }
    let other_oncs = oncs
        & !(spec::ctrl::ONCS_COMPARE
            | spec::ctrl::ONCS_DSM
            | spec::ctrl::ONCS_WRITE_ZEROES
            | spec::ctrl::ONCS_RESERVATIONS);
    assert_eq!(other_oncs, 0, "an ONCS bit this test does not know");
    if le16(&ctrl, 522) & spec::ctrl::FUSES_COMPARE_AND_WRITE != 0 {
        assert!(ops.contains(&io_opcode::COMPARE), "FUSES without Compare");
    }
    ops
}

/// The I/O opcodes an I/O queue runs (answers with anything but Invalid Opcode); 7Fh is
/// the fabrics commands' opcode, not one of the NVM command set.
fn executed_io_commands(io: &mut Queue) -> BTreeSet<u8> {
    (0..=u8::MAX)
        .filter(|&op| op != fabrics::OPCODE)
        .filter(|&op| {
            let cmd = rw(op, 60, 0, 1);
            let data = cmd
                .is_host_to_controller()
                .then(|| IoBuf::from_vec(vec![0; 512]));
            one(run(io, cmd, data)).completion.status.code() != sc::INVALID_OPCODE
        })
        .collect()
}

/// Identify's ONCS, the Commands Supported and Effects log, the Supported Log Pages log and
/// the I/O queue agree, with reservations offered and not (`[gateway] reservations =
/// false`): the effects log listed the reservation commands that ONCS denied.
#[test]
fn effects_log_lists_exactly_the_io_commands_identify_announces_and_io_queues_run() {
    for reservations in [true, false] {
        let mut f = fixture();
        let target = Arc::try_unwrap(f.target).expect("only the fixture holds it");
        f.target = Arc::new(target.with_reservations(reservations));
        let (mut admin, mut io) = admin_and_io(&f);
        let announced = identify_io_commands(&mut admin);
        assert_eq!(
            announced.contains(&io_opcode::RESV_REGISTER),
            reservations,
            "ONCS follows the target's reservations"
        );
        assert_eq!(
            effects_log_io_commands(&mut admin),
            announced,
            "effects log vs ONCS, reservations {reservations}"
        );
        assert_eq!(
            executed_io_commands(&mut io),
            announced,
            "I/O queue vs ONCS, reservations {reservations}"
        );
        let pages = get_log(&mut admin, spec::log::SUPPORTED, 1024, 0, false)
            .data
            .expect("supported log pages")
            .into_vec();
        assert_eq!(
            le32(&pages, 4 * usize::from(spec::log::RESERVATION)) & 1 == 1,
            reservations,
            "the reservation notification log page, reservations {reservations}"
        );
        let notices = get_log(&mut admin, spec::log::RESERVATION, 64, 0, false);
        assert_eq!(
            notices.completion.status.is_success(),
            reservations,
            "reading the reservation notification log, reservations {reservations}"
        );
    }
}

/// `require_tls` turning on while a plain Connect is under way (an admin's `subsystem set
/// --require-tls true`, a reload), at the worst moment: the controller registered, not yet
/// marked plain, so the admin's side finds nothing plain to close. The Connect must see it
/// and refuse, closing its controller; nothing plain is left serving. For an admin queue,
/// and for a plain I/O queue of a controller whose admin queue came over TLS.
#[test]
fn a_plain_connect_racing_require_tls_never_stays_connected() {
    for io_queue in [false, true] {
        let f = fixture();
        let sub = f.target.subsystem(SUBNQN).expect("subsystem");
        let mut cntlid = 0xffff;
        let mut secure_admin = None;
        if io_queue {
            let mut admin = f.queue();
            admin.set_secure_channel(super::tls::SecureChannel {
                hostnqn: HOSTNQN.into(),
                subnqn: SUBNQN.into(),
            });
            cntlid = admin_ready(&mut admin, 0);
            secure_admin = Some(admin);
        }
        let mut q = f.queue();
        let admin_side = sub.clone();
        let closed = Arc::new(Mutex::new(Vec::new()));
        let seen = closed.clone();
        q.connect_pause = Some(Box::new(move || {
            *seen.lock().unwrap() = admin_side.set_tls_required(true);
        }));
        let r = one(run(
            &mut q,
            connect(u16::from(io_queue), 31, 0),
            Some(connect_data(SUBNQN, HOSTNQN, cntlid)),
        ));
        assert!(
            closed.lock().unwrap().is_empty(),
            "the admin's side found nothing plain yet"
        );
        assert_eq!(
            r.completion.status.code(),
            sc::CONNECT_INVALID_HOST,
            "io_queue {io_queue}: {:?}",
            r.completion.status
        );
        let serving: Vec<u16> = sub
            .controllers()
            .iter()
            .filter(|c| !c.is_torn_down())
            .map(|c| c.cntlid)
            .collect();
        assert!(
            serving.is_empty(),
            "io_queue {io_queue}: controllers {serving:?} still serve with a plain queue"
        );
        drop(secure_admin);
    }
}

/// A host controller that ends (its admin queue's connection closed) calls the target's
/// `on_controller_gone`, which a group gateway uses to beacon the disconnect at once; a
/// discovery controller's end does not (the control plane does not track those), nor does
/// an I/O queue's close alone.
#[test]
fn the_end_of_a_host_controller_is_reported_at_once() {
    let f = fixture();
    let gone = Arc::new(Mutex::new(0u32));
    {
        let gone = gone.clone();
        f.target
            .set_on_controller_gone(Arc::new(move || *gone.lock().unwrap() += 1));
    }
    let (mut admin, mut io) = admin_and_io(&f);
    io.close();
    assert_eq!(
        *gone.lock().unwrap(),
        0,
        "an I/O queue closed, the controller lives"
    );
    admin.close();
    assert_eq!(*gone.lock().unwrap(), 1, "the controller ended");
    let mut disc = f.queue();
    discovery_ready(&mut disc, HOSTNQN);
    disc.close();
    assert_eq!(
        *gone.lock().unwrap(),
        1,
        "a discovery controller is not reported"
    );
}

/// Auto-resize off: a namespace with a frozen size reports it (Identify NSZE, NCAP, NUSE)
/// and refuses I/O beyond it after its device grew, without telling hosts anything changed;
/// a changed frozen size applies at once, and clearing it shows the device's size again.
#[test]
fn a_frozen_namespace_does_not_follow_its_device_growth() {
    let f = fixture();
    let sub = f.target.subsystem(SUBNQN).expect("subsystem");
    let ns = sub.namespace(1).expect("namespace");
    assert!(ns.frozen_size.set(Some(NS_BYTES)));
    let mut admin = f.queue();
    let cntlid = admin_ready(&mut admin, 0);
    arm_aer(&mut admin, spec::aer::CFG_NS_ATTR);
    let mut q = io_ready(&f, cntlid, 1);

    f.device.resize(NS_BYTES * 2);
    assert_eq!(f.device.size_bytes(), NS_BYTES * 2, "the device did grow");
    let mut actions = Vec::new();
    admin.poll_events(&mut actions);
    assert!(
        settle(&mut admin, actions).is_empty(),
        "no Namespace Attribute Changed while frozen"
    );
    let frozen_lbas = NS_BYTES / 512;
    let id = identify(&mut admin, spec::cns::NS, 1)
        .data
        .unwrap()
        .into_vec();
    assert_eq!(
        (le64(&id, 0), le64(&id, 8), le64(&id, 16)),
        (frozen_lbas, frozen_lbas, frozen_lbas),
        "NSZE, NCAP, NUSE: the frozen size"
    );
    let r = one(run(
        &mut q,
        rw(io_opcode::READ, 40, frozen_lbas - 1, 1),
        None,
    ));
    assert!(
        r.completion.status.is_success(),
        "{:?}",
        r.completion.status
    );
    let r = one(run(&mut q, rw(io_opcode::READ, 41, frozen_lbas, 1), None));
    assert_eq!(
        r.completion.status.code(),
        sc::LBA_RANGE,
        "beyond the frozen size, on the device"
    );
    let r = one(run(
        &mut q,
        rw(io_opcode::WRITE, 42, frozen_lbas - 1, 2),
        Some(IoBuf::zeroed(1024)),
    ));
    assert_eq!(r.completion.status.code(), sc::LBA_RANGE);

    // Auto-resize on again: the device's size.
    assert!(ns.frozen_size.set(None));
    let id = identify(&mut admin, spec::cns::NS, 1)
        .data
        .unwrap()
        .into_vec();
    assert_eq!(le64(&id, 0), 2 * frozen_lbas);
    let r = one(run(&mut q, rw(io_opcode::READ, 43, frozen_lbas, 1), None));
    assert!(
        r.completion.status.is_success(),
        "{:?}",
        r.completion.status
    );
}
