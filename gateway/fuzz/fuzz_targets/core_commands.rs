//! Feeds arbitrary command sequences to the protocol core (`Queue::execute`), the way a
//! transport would after the PDU decoder: 64-byte SQEs with their host data, device
//! completions delivered late and out of order, namespace resizes in between.
//!
//! The first input byte picks the start: a fresh queue, an admin queue connected and
//! enabled (plus I/O queue 1 of the same controller), or a discovery controller; whether
//! the transport offers keyed SGLs (RDMA) or in-capsule data only (TCP); and whether the
//! host has a DH-HMAC-CHAP key, so its queues must authenticate (in-band authentication
//! messages then come from the input), and if so whether they did (a whole transaction, as
//! the host library runs it, before the input's commands). The rest is a list
//! of steps, each led by one byte: a command (its 64 bytes follow; host-to-controller data
//! is taken from the input), a pending device completion delivered, a resize, a poll for
//! events, a disconnect.
//!
//! Checks, besides "never panics":
//! - every response answers a command that is outstanding on that queue (no response
//!   invented, none sent twice), with that queue's SQ ID; an AER whose CID the host reuses
//!   is no longer outstanding (the core drops it), so a completion for it fails this too;
//! - a response never carries more data than the command's data length (the host's buffer);
//! - once every device op has completed, the queue has nothing in flight;
//! - once the input ends and every device op has completed, the only commands left without
//!   a response are Asynchronous Event Requests and the first half of a fused pair waiting
//!   for its second (what a real controller also holds), unless the queue asked to close.
#![no_main]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, Weak};

use libfuzzer_sys::fuzz_target;
use nvmeof_gateway::auth::{DhGroup, DhchapSecret, HashFunction, Message};
use nvmeof_gateway::core::{
    Action, AuthPolicy, Command, HostAccess, HostKeys, ListenerInfo, Namespace, Queue,
    QueueNotifier, Subsystem, SubsystemKind, SubsystemSpec, Target, TargetIdentity, TransportCaps,
    TransportType,
};
use nvmeof_gateway::host::cmd::{self as hcmd, Sqe};
use nvmeof_gateway::host::{HostOptions, HostTransaction};
use nvmeof_gateway::spec::{self, admin_opcode, fuse};
use rbd_backend::{BlockDevice, IoBuf, IoCompletion, IoDone, MemoryDevice};

const SUBNQN: &str = "nqn.2016-06.io.fuzz:sub";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:fuzz-host";
const NS_BYTES: u64 = 1 << 20;
/// The TCP transport's in-capsule data size (IOCCSZ), which the RDMA one shares.
const IN_CAPSULE: usize = 8192;
/// The buffer a Linux host gives each Authentication Receive.
const RECEIVE_LEN: u32 = 4096;
/// Largest host data buffer built per command: beyond that the data is zeros anyway.
const MAX_FUZZ_DATA: usize = 1 << 20;

struct NoWake;
impl QueueNotifier for NoWake {
    fn wake(&self) {}
}

#[derive(Default)]
struct Collect(Mutex<Vec<IoDone>>);
impl IoCompletion for Collect {
    fn complete(&self, done: IoDone) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(done);
    }
}

struct Input<'a>(&'a [u8]);
impl Input<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
    fn take(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        head
    }
}

/// One queue as a transport drives it, with what the checks need.
struct Driven {
    queue: Queue,
    /// Commands executed and not answered yet: (cid, opcode, fuse, data length).
    outstanding: Vec<(u16, u8, u8, u32)>,
    /// Device completions not yet handed back to the core.
    pending: Vec<IoDone>,
    closed: bool,
    /// The data of the last response that carried some.
    last_data: Option<Vec<u8>>,
}

impl Driven {
    fn new(target: &Arc<Target>, caps: TransportCaps, notifier: &Arc<dyn QueueNotifier>) -> Self {
        let weak: Weak<dyn QueueNotifier> = Arc::downgrade(notifier);
        Self {
            queue: Queue::new(target.clone(), caps, weak),
            outstanding: Vec::new(),
            pending: Vec::new(),
            closed: false,
            last_data: None,
        }
    }

    fn execute(&mut self, cmd: Command, data: Option<IoBuf>) {
        if self.closed {
            return;
        }
        // A command reusing the CID of an AER the controller holds means the host gave that
        // AER up: the core drops it, never to be answered (any later response under the CID
        // must answer the new command, or is a double completion the checks catch).
        if self.queue.qid() == Some(0) && !self.queue.awaits_authentication() {
            let held_aer =
                |o: &(u16, u8, u8, u32)| o.0 == cmd.cid() && o.1 == admin_opcode::ASYNC_EVENT;
            if let Some(i) = self.outstanding.iter().position(held_aer) {
                self.outstanding.remove(i);
            }
        }
        self.outstanding
            .push((cmd.cid(), cmd.opcode(), cmd.fuse(), cmd.data_len()));
        let mut actions = Vec::new();
        self.queue.execute(cmd, data, &mut actions);
        self.run(actions);
    }

    /// What the transport does with the core's actions; device ops complete later.
    fn run(&mut self, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::Respond(r) => {
                    let cid = r.completion.cid;
                    // A CID already in use is refused as a conflict: that answers the newest
                    // command with the CID; any other response answers the oldest.
                    let conflict = r.completion.status.code() == spec::sc::CMDID_CONFLICT;
                    let found = if conflict {
                        self.outstanding.iter().rposition(|o| o.0 == cid)
                    } else {
                        self.outstanding.iter().position(|o| o.0 == cid)
                    };
                    let Some(i) = found else {
                        panic!("response to CID {cid}, which no outstanding command has: {r:?}");
                    };
                    let (_, opcode, _, data_len) = self.outstanding.remove(i);
                    if let Some(data) = &r.data {
                        self.last_data = Some(data.as_slice().to_vec());
                        assert!(
                            data.len() <= data_len as usize,
                            "opcode {opcode:#x}: {} bytes of data for a {data_len}-byte buffer",
                            data.len()
                        );
                    }
                    if let Some(qid) = self.queue.qid() {
                        assert_eq!(r.completion.sq_id, qid, "SQ ID of {r:?}");
                    }
                }
                // A throttled op is submitted at once here: its wait is the transport's
                // (gateway/src/qos.rs), not the core's.
                Action::Submit { device, tag, op }
                | Action::SubmitThrottled {
                    device, tag, op, ..
                } => {
                    let sink = Arc::new(Collect::default());
                    let dyn_sink: Arc<dyn IoCompletion> = sink.clone();
                    device.submit(tag, op, &dyn_sink);
                    let done =
                        std::mem::take(&mut *sink.0.lock().unwrap_or_else(|e| e.into_inner()));
                    self.pending.extend(done);
                }
                Action::Close => self.disconnect(),
            }
        }
    }

    fn complete(&mut self, index: usize) {
        if self.pending.is_empty() {
            return;
        }
        let done = self.pending.remove(index % self.pending.len());
        let mut actions = Vec::new();
        self.queue.complete_io(done, &mut actions);
        self.run(actions);
    }

    fn poll(&mut self) {
        let mut actions = Vec::new();
        self.queue.poll_events(&mut actions);
        self.run(actions);
    }

    /// The host went away: the transport closes the queue (with the admin queue, the
    /// controller goes), and still hands the core the completions of ops already started.
    fn disconnect(&mut self) {
        self.queue.close();
        self.closed = true;
    }

    /// Every device op completed, events polled: only AERs and a parked fused first half
    /// may still be waiting.
    fn finish(&mut self) {
        while !self.pending.is_empty() {
            self.complete(0);
        }
        // Closed or not: the RDMA transport waits for this to reach 0 before it frees the
        // queue's registered buffers.
        assert_eq!(
            self.queue.in_flight(),
            0,
            "ops left in flight after every completion"
        );
        self.poll();
        if self.closed {
            return;
        }
        for &(cid, opcode, fused, _) in &self.outstanding {
            let aer = self.queue.qid() == Some(0) && opcode == admin_opcode::ASYNC_EVENT;
            let parked_first = fused == fuse::FIRST;
            assert!(
                aer || parked_first,
                "CID {cid} (opcode {opcode:#x}, fuse {fused}) never answered"
            );
        }
    }
}

/// The host's DH-HMAC-CHAP key, when the input asks for one.
fn host_key() -> DhchapSecret {
    DhchapSecret::from_bytes(&[0x42; 32], Some(HashFunction::Sha256)).expect("32 bytes")
}

/// The fuzz target's policy: the NULL group first, so most transactions cost no key
/// exchange (ffdhe2048, ~1 ms each, only when the input offers nothing else).
fn auth_policy() -> AuthPolicy {
    AuthPolicy {
        hashes: HashFunction::ALL.to_vec(),
        dhgroups: vec![DhGroup::Null, DhGroup::Ffdhe2048],
    }
}

fn target(device: &Arc<MemoryDevice>, keyed_host: bool) -> Arc<Target> {
    let target = Arc::new(Target::new(TargetIdentity::default()).with_auth_policy(auth_policy()));
    let sub = Arc::new(Subsystem::new(
        SubsystemKind::Nvm,
        SubsystemSpec {
            nqn: SUBNQN.into(),
            serial: "FUZZ".into(),
            model: "fuzz".into(),
            access: HostAccess::Only(BTreeSet::from([HOSTNQN.to_string()])),
            cntlid_min: 1,
            cntlid_max: 4,
        },
    ));
    let dyn_device: Arc<dyn BlockDevice> = device.clone();
    sub.add_namespace(Arc::new(Namespace {
        nsid: 1,
        device: dyn_device,
        lba_shift: 9,
        nguid: [1; 16],
        uuid: [2; 16],
        ana_group: 1,
        read_only: false,
        qos: Default::default(),
        frozen_size: Default::default(),
    }));
    device.set_event_sink(Arc::new(nvmeof_gateway::events::NamespaceEvents::new(
        &sub, 1,
    )));
    if keyed_host {
        let keys = HostKeys {
            host: host_key(),
            ctrl: Some(host_key()),
        };
        sub.set_host_keys(BTreeMap::from([(HOSTNQN.to_string(), Arc::new(keys))]));
    }
    target.add_subsystem(sub);
    target.add_listener(ListenerInfo {
        transport: TransportType::Tcp,
        address: "127.0.0.1".into(),
        port: 4420,
        port_id: 1,
    });
    target
}

/// Connect for queue `qid` (32 entries), built by the project's host library.
fn connect_command(qid: u16) -> Command {
    let mut sqe = Sqe::connect(qid, 31, 0);
    sqe.set_cid(0x100 + qid)
        .set_sgl_in_capsule(hcmd::CONNECT_DATA_LEN as u32);
    Command::from_bytes(&sqe.0)
}

fn connect_data(subnqn: &str, cntlid: u16) -> IoBuf {
    IoBuf::from_vec(hcmd::connect_data(&[7; 16], cntlid, subnqn, HOSTNQN))
}

/// A whole DH-HMAC-CHAP transaction on `q`, as the host library runs it (both keys).
fn authenticate(q: &mut Driven, subnqn: &str) {
    let mut opts = HostOptions::new(HOSTNQN);
    opts.dhchap_secret = Some(host_key());
    opts.dhchap_ctrl_secret = Some(host_key());
    opts.dhchap_dhgroups = vec![DhGroup::Null];
    let Ok(mut host) = HostTransaction::new(&opts, subnqn) else {
        return;
    };
    let send = |q: &mut Driven, message: Message| {
        let bytes = message.encode();
        let mut sqe = Sqe::auth_send(bytes.len() as u32);
        sqe.set_cid(0x300).set_sgl_in_capsule(bytes.len() as u32);
        q.execute(Command::from_bytes(&sqe.0), Some(IoBuf::from_vec(bytes)));
    };
    let receive = |q: &mut Driven| {
        let mut sqe = Sqe::auth_receive(RECEIVE_LEN);
        sqe.set_cid(0x301).set_sgl_transport(RECEIVE_LEN);
        q.last_data = None;
        q.execute(Command::from_bytes(&sqe.0), None);
        q.last_data.take().and_then(|d| Message::decode(&d).ok())
    };
    send(q, host.negotiate());
    let Some(reply) = receive(q).and_then(|c| host.reply(c).ok()) else {
        return;
    };
    send(q, reply);
    let finished = receive(q).and_then(|s| host.finish(s).ok());
    if let Some((Some(success2), _)) = finished {
        send(q, success2);
    }
    assert!(
        !q.queue.awaits_authentication(),
        "a whole transaction with the right keys authenticates"
    );
}

/// CC.EN with the NVM command set's entry sizes, as the Linux host enables a controller.
fn enable(q: &mut Driven) {
    let cc = hcmd::cc::EN | hcmd::cc::IOSQES_64 | hcmd::cc::IOCQES_16;
    let mut sqe = Sqe::property_set(hcmd::prop::CC, u64::from(cc), false);
    sqe.set_cid(0x200);
    q.execute(Command::from_bytes(&sqe.0), None);
}

/// What the transport hands the core with a command, or `None` if the transport answers it
/// itself (an oversized transfer, data descriptors it cannot serve), as `tcp/connection.rs`
/// and `rdma/connection.rs` do in `on_capsule`.
fn host_data(
    q: &Driven,
    cmd: &Command,
    caps: TransportCaps,
    input: &mut Input,
) -> Option<Option<IoBuf>> {
    if q.queue.check_data_len(cmd).is_err() {
        return None;
    }
    let len = cmd.data_len() as usize;
    if len == 0 {
        return Some(None);
    }
    let sgl = cmd.sgl();
    let in_capsule = cmd.is_host_to_controller() && sgl.is_in_capsule();
    if in_capsule {
        // TCP takes in-capsule data at offset 0 only; RDMA at any offset inside the capsule.
        let offset_ok = if caps.keyed_sgls {
            usize::try_from(sgl.address)
                .ok()
                .and_then(|a| a.checked_add(len))
                .is_some_and(|end| end <= IN_CAPSULE)
        } else {
            sgl.address == 0 && len <= IN_CAPSULE
        };
        if !offset_ok {
            return None;
        }
    } else if caps.keyed_sgls
        && (sgl.desc_type != spec::sgl::KEYED_DATA_DESC
            || (sgl.subtype != spec::sgl::FMT_ADDRESS && sgl.subtype != spec::sgl::FMT_INVALIDATE))
    {
        return None;
    }
    if !cmd.is_host_to_controller() {
        return Some(None);
    }
    // In the capsule, fetched by R2T or by RDMA READ: the core gets exactly `len` bytes.
    let mut data = vec![0u8; len];
    let given = input.take(len.min(MAX_FUZZ_DATA));
    data[..given.len()].copy_from_slice(given);
    Some(Some(IoBuf::from_vec(data)))
}

fuzz_target!(|bytes: &[u8]| {
    let mut input = Input(bytes);
    let Some(setup) = input.byte() else {
        return;
    };
    let caps = TransportCaps {
        in_capsule_data_size: IN_CAPSULE as u32,
        keyed_sgls: setup & 0x04 != 0,
    };
    let keyed_host = setup & 0x08 != 0;
    let authenticated = keyed_host && setup & 0x10 != 0;
    let device = Arc::new(MemoryDevice::new("fuzz", NS_BYTES));
    let target = target(&device, keyed_host);
    let notifier: Arc<dyn QueueNotifier> = Arc::new(NoWake);
    let mut queues = vec![Driven::new(&target, caps, &notifier)];
    match setup & 0x03 {
        0 => {}
        1 | 2 => {
            queues[0].execute(connect_command(0), Some(connect_data(SUBNQN, 0xffff)));
            if authenticated {
                authenticate(&mut queues[0], SUBNQN);
            }
            enable(&mut queues[0]);
            if setup & 0x03 == 2 {
                if let Some(cntlid) = queues[0].queue.controller().map(|c| c.cntlid) {
                    let mut io = Driven::new(&target, caps, &notifier);
                    io.execute(connect_command(1), Some(connect_data(SUBNQN, cntlid)));
                    if authenticated {
                        authenticate(&mut io, SUBNQN);
                    }
                    queues.push(io);
                }
            }
        }
        _ => {
            queues[0].execute(
                connect_command(0),
                Some(connect_data(spec::DISCOVERY_NQN, 0xffff)),
            );
            enable(&mut queues[0]);
        }
    }

    while let Some(step) = input.byte() {
        let q = usize::from(step >> 7) % queues.len();
        match step & 0x07 {
            0..=3 => {
                let raw = input.take(64);
                if raw.len() < 64 {
                    break;
                }
                let mut sqe = [0u8; 64];
                sqe.copy_from_slice(raw);
                let cmd = Command::from_bytes(&sqe);
                if queues[q].queue.exceeds_queue_size(0) {
                    // Beyond twice the queue size: the TCP transport fails the connection.
                    queues[q].disconnect();
                    continue;
                }
                // `None`: answered by the transport, never reaches the core.
                if let Some(data) = host_data(&queues[q], &cmd, caps, &mut input) {
                    queues[q].execute(cmd, data);
                }
            }
            4 | 5 => {
                let index = usize::from(input.byte().unwrap_or(0));
                queues[q].complete(index);
            }
            6 => {
                let blocks = u64::from(input.byte().unwrap_or(0)) + 1;
                device.resize(blocks * 4096);
            }
            7 if step & 0x08 != 0 => queues[q].disconnect(),
            _ => queues[q].poll(),
        }
    }
    for q in &mut queues {
        q.finish();
    }
    drop(queues);
    drop(target);
});
