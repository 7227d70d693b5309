//! Per-host namespace visibility in the protocol core (no socket, no clock in the core): one
//! subsystem of 1000 namespaces, every one visible to all hosts (a), against the same with
//! every namespace visible to 64 hosts, the connected host among them (b). Times, through a
//! connected and enabled controller's queues, Identify's active namespace list (CNS 02h,
//! all 1000 NSIDs), Identify Namespace (CNS 00h, NSIDs in turn) and a 4K read (in-memory
//! device, completed inline), alternating a and b over `--rounds` (default 5), and prints
//! ns per command and the ratio b/a (1.00: no cost).
//!
//!     cargo bench -p nvmeof-gateway --bench visibility_core [-- --seconds 0.5 --rounds 5]
//!
//! The NVMe/TCP side (reads over loopback) is `tcp_loopback --visibility`.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use nvmeof_gateway::core::{
    Action, Command, HostAccess, Namespace, Queue, QueueNotifier, Response, Subsystem,
    SubsystemKind, SubsystemSpec, Target, TargetIdentity, TransportCaps, Visibility,
};
use nvmeof_gateway::spec::{self, admin_opcode, cns, fabrics, io_opcode};
use rbd_backend::{IoBuf, IoCompletion, IoDone, MemoryDevice};

const SUBNQN: &str = "nqn.2016-06.io.ceph-nvmeof-rs:bench-vis";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:bench-0000-0000-0000-000000000001";
const NAMESPACES: u32 = 1000;
const HOSTS: usize = 64;

struct NoWakes;
impl QueueNotifier for NoWakes {
    fn wake(&self) {}
}

#[derive(Default)]
struct Collect(Mutex<Vec<IoDone>>);
impl IoCompletion for Collect {
    fn complete(&self, done: IoDone) {
        self.0.lock().unwrap().push(done);
    }
}

fn sqe(opcode: u8, cid: u16, nsid: u32) -> [u8; 64] {
    let mut raw = [0u8; 64];
    raw[0] = opcode;
    raw[2..4].copy_from_slice(&cid.to_le_bytes());
    raw[4..8].copy_from_slice(&nsid.to_le_bytes());
    raw
}

fn set_cdw(raw: &mut [u8; 64], n: usize, v: u32) {
    raw[n * 4..n * 4 + 4].copy_from_slice(&v.to_le_bytes());
}

fn set_data_len(raw: &mut [u8; 64], len: u32) {
    raw[32..36].copy_from_slice(&len.to_le_bytes());
    raw[39] = 0x5a; // transport SGL data block
}

/// A command's responses, device ops run inline.
fn run(q: &mut Queue, cmd: Command, data: Option<IoBuf>, sink: &Arc<Collect>) -> Vec<Response> {
    let mut actions = Vec::new();
    q.execute(cmd, data, &mut actions);
    let dyn_sink: Arc<dyn IoCompletion> = sink.clone();
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
                    device.submit(tag, op, &dyn_sink);
                    let done: Vec<IoDone> = sink.0.lock().unwrap().drain(..).collect();
                    for d in done {
                        q.complete_io(d, &mut next);
                    }
                }
                Action::Close => panic!("the queue closed"),
            }
        }
        actions = next;
    }
    responses
}

fn one_ok(mut responses: Vec<Response>) -> Response {
    assert_eq!(responses.len(), 1, "{responses:?}");
    let r = responses.remove(0);
    assert!(
        r.completion.status.is_success(),
        "{:?}",
        r.completion.status
    );
    r
}

fn connect(q: &mut Queue, qid: u16, cntlid: u16, sink: &Arc<Collect>) -> u16 {
    let mut raw = sqe(fabrics::OPCODE, 100 + qid, 0);
    raw[4] = fabrics::CONNECT;
    set_data_len(&mut raw, 1024);
    raw[42..44].copy_from_slice(&qid.to_le_bytes());
    raw[44..46].copy_from_slice(&127u16.to_le_bytes());
    let mut d = vec![0u8; 1024];
    d[0..16].copy_from_slice(&[7; 16]);
    d[16..18].copy_from_slice(&cntlid.to_le_bytes());
    d[256..256 + SUBNQN.len()].copy_from_slice(SUBNQN.as_bytes());
    d[512..512 + HOSTNQN.len()].copy_from_slice(HOSTNQN.as_bytes());
    let r = one_ok(run(
        q,
        Command::from_bytes(&raw),
        Some(IoBuf::from_vec(d)),
        sink,
    ));
    r.completion.result as u16
}

fn enable(q: &mut Queue, sink: &Arc<Collect>) {
    let mut raw = sqe(fabrics::OPCODE, 1, 0);
    raw[4] = fabrics::PROPERTY_SET;
    set_cdw(&mut raw, 11, spec::reg::CC);
    set_cdw(
        &mut raw,
        12,
        spec::cc::ENABLE
            | (spec::cc::NVM_IOSQES << spec::cc::IOSQES_SHIFT)
            | (spec::cc::NVM_IOCQES << spec::cc::IOCQES_SHIFT),
    );
    one_ok(run(q, Command::from_bytes(&raw), None, sink));
}

/// A target with one subsystem of `NAMESPACES` namespaces, each visible to all hosts or to
/// `HOSTS` hosts (`HOSTNQN` among them); its admin queue (enabled) and I/O queue 1.
struct Setup {
    _target: Arc<Target>,
    _notifier: Arc<dyn QueueNotifier>,
    admin: Queue,
    io: Queue,
    sink: Arc<Collect>,
}

fn setup(restricted: bool) -> Setup {
    let target = Arc::new(Target::new(TargetIdentity::default()));
    let sub = Arc::new(Subsystem::new(
        SubsystemKind::Nvm,
        SubsystemSpec {
            nqn: SUBNQN.into(),
            serial: "BENCH".into(),
            model: "bench".into(),
            access: HostAccess::AnyHost,
            cntlid_min: 1,
            cntlid_max: 100,
        },
    ));
    // UUID NQNs spread so that 47 sort before `HOSTNQN` and 16 after it: its lookup is not
    // the set's cheapest.
    let mut hosts: BTreeSet<String> = (1..HOSTS)
        .map(|i| {
            format!(
                "nqn.2014-08.org.nvmexpress:uuid:{:08x}-0000-4000-8000-000000000000",
                i * 0x0400_0000
            )
        })
        .collect();
    hosts.insert(HOSTNQN.to_string());
    assert_eq!(hosts.len(), HOSTS);
    assert_eq!(hosts.iter().position(|h| h == HOSTNQN), Some(47));
    for nsid in 1..=NAMESPACES {
        if restricted {
            sub.set_visibility(nsid, Visibility::Only(hosts.clone()));
        }
        let mut id = [0u8; 16];
        id[..4].copy_from_slice(&nsid.to_be_bytes());
        sub.add_namespace(Arc::new(Namespace {
            nsid,
            device: Arc::new(MemoryDevice::new(format!("mem{nsid}"), 1 << 20)),
            lba_shift: 9,
            nguid: id,
            uuid: id,
            ana_group: 1,
            read_only: false,
            qos: Default::default(),
            frozen_size: Default::default(),
        }));
    }
    target.add_subsystem(sub);
    let notifier: Arc<dyn QueueNotifier> = Arc::new(NoWakes);
    let weak: Weak<dyn QueueNotifier> = Arc::downgrade(&notifier);
    let caps = TransportCaps {
        in_capsule_data_size: 8192,
        keyed_sgls: false,
    };
    let sink = Arc::new(Collect::default());
    let mut admin = Queue::new(target.clone(), caps, weak.clone());
    let cntlid = connect(&mut admin, 0, 0xffff, &sink);
    enable(&mut admin, &sink);
    let mut io = Queue::new(target.clone(), caps, weak);
    connect(&mut io, 1, cntlid, &sink);
    Setup {
        _target: target,
        _notifier: notifier,
        admin,
        io,
        sink,
    }
}

fn identify(cns: u8, nsid: u32) -> Command {
    let mut raw = sqe(admin_opcode::IDENTIFY, 5, nsid);
    set_cdw(&mut raw, 10, u32::from(cns));
    set_data_len(&mut raw, 4096);
    Command::from_bytes(&raw)
}

fn read(nsid: u32, lba: u64) -> Command {
    let mut raw = sqe(io_opcode::READ, 9, nsid);
    set_data_len(&mut raw, 4096);
    set_cdw(&mut raw, 10, lba as u32);
    set_cdw(&mut raw, 11, (lba >> 32) as u32);
    set_cdw(&mut raw, 12, 7); // 8 blocks of 512 bytes
    Command::from_bytes(&raw)
}

#[derive(Clone, Copy)]
enum Op {
    ActiveList,
    IdentifyNs,
    Read,
}

/// Runs `op` for `duration` (checking the clock every 64 commands); ns per command.
fn time(s: &mut Setup, op: Op, duration: Duration) -> f64 {
    let begin = Instant::now();
    let mut n: u64 = 0;
    loop {
        for _ in 0..64 {
            n += 1;
            let nsid = (n % u64::from(NAMESPACES)) as u32 + 1;
            let r = match op {
                Op::ActiveList => {
                    let r = one_ok(run(
                        &mut s.admin,
                        identify(cns::NS_ACTIVE_LIST, 0),
                        None,
                        &s.sink,
                    ));
                    debug_assert_eq!(
                        r.data.as_ref().map(|d| d.as_slice()[3996..4000].to_vec()),
                        Some(NAMESPACES.to_le_bytes().to_vec())
                    );
                    r
                }
                Op::IdentifyNs => one_ok(run(&mut s.admin, identify(cns::NS, nsid), None, &s.sink)),
                Op::Read => one_ok(run(&mut s.io, read(nsid, n % 256 * 8), None, &s.sink)),
            };
            std::hint::black_box(r);
        }
        let elapsed = begin.elapsed();
        if elapsed >= duration {
            return elapsed.as_nanos() as f64 / n as f64;
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
    };
    let seconds = value("--seconds")
        .and_then(|s| s.parse::<f64>().ok())
        .unwrap_or(0.5);
    // `cargo test --benches` runs benches with --bench absent: keep that quick.
    let duration = if args.iter().any(|a| a == "--bench") {
        Duration::from_secs_f64(seconds)
    } else {
        Duration::from_millis(20)
    };
    let rounds = value("--rounds")
        .and_then(|s| s.parse::<usize>().ok())
        .unwrap_or(5)
        .max(1);

    let mut all = setup(false);
    let mut only = setup(true);
    // Both views are what they should be: all 1000 NSIDs in each active list.
    for s in [&mut all, &mut only] {
        let r = one_ok(run(
            &mut s.admin,
            identify(cns::NS_ACTIVE_LIST, 0),
            None,
            &s.sink,
        ));
        let page = r.data.expect("the list").into_vec();
        let listed = page.chunks(4).take_while(|c| c != &[0, 0, 0, 0]).count();
        assert_eq!(listed, NAMESPACES as usize);
    }

    println!(
        "Per-host visibility in the core, {NAMESPACES} namespaces, {:.2} s per run, {rounds} \
         rounds: all auto-visible (a) against each visible to {HOSTS} hosts, this one among them (b)",
        duration.as_secs_f64()
    );
    println!(
        "{:<32} {:>9} {:>9} {:>22}",
        "command", "a ns/cmd", "b ns/cmd", "time ratio b/a [min-max]"
    );
    for (name, op) in [
        ("Identify active NS list (02h)", Op::ActiveList),
        ("Identify Namespace (00h)", Op::IdentifyNs),
        ("Read 4K (in-memory, inline)", Op::Read),
    ] {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            if round % 2 == 0 {
                a.push(time(&mut all, op, duration));
                b.push(time(&mut only, op, duration));
            } else {
                b.push(time(&mut only, op, duration));
                a.push(time(&mut all, op, duration));
            }
        }
        let ratios: Vec<f64> = a.iter().zip(&b).map(|(a, b)| b / a).collect();
        let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        println!(
            "{:<32} {:>9.0} {:>9.0} {:>8.3} [{:.3}-{:.3}]",
            name,
            median(a),
            median(b),
            median(ratios),
            lo,
            hi
        );
    }
}
