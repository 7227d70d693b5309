//! One NVMe queue pair as the core sees it: commands in, actions out.
//!
//! A transport owns one [`Queue`] per connection (NVMe/TCP) or queue pair (RDMA). It feeds
//! each command capsule (with its host data, once fetched) to [`Queue::execute`], runs the
//! [`Action`]s that come back (send a response, submit an op to a device, close), and feeds
//! device completions to [`Queue::complete_io`]. The queue does no I/O and reads no clock, so
//! every path is testable byte for byte without a socket.

use std::net::IpAddr;
use std::sync::{Arc, Weak};

use rbd_backend::{BlockDevice, IoBuf, IoOp};

use super::auth::{allowed_before_authentication, QueueAuth};
use super::buffers::{BufferSource, RecycledBuffers};
use super::cid_map::CidMap;
use super::command::{Command, Completion, Status};
use super::controller::{Controller, QueueNotifier, TeardownReason};
use super::qos::NamespaceQos;
use super::refusals::{Refusal, RefusalReason};
use super::target::{Target, TransportCaps, TransportType};
use crate::spec::{fuse, io_opcode, sc};

/// Maximum Data Transfer Size as a power of two of the 4 KiB minimum page: 2^8 * 4 KiB = 1 MiB.
pub const MDTS_SHIFT: u8 = 8;
pub const MAX_DATA_LEN: u32 = 4096 << MDTS_SHIFT;
/// Largest queue the target accepts (CAP.MQES is this minus one).
pub const MAX_QUEUE_ENTRIES: u32 = 1024;

/// A completion, with the data to send to the host before it (reads, Identify, logs).
#[derive(Debug)]
pub struct Response {
    pub completion: Completion,
    pub data: Option<IoBuf>,
}

/// What the transport must do next.
pub enum Action {
    /// Send `data` (if any) then the completion.
    Respond(Response),
    /// Start `op` on `device`; hand its [`IoDone`](rbd_backend::IoDone) to [`Queue::complete_io`].
    Submit {
        device: Arc<dyn BlockDevice>,
        tag: u64,
        op: IoOp,
    },
    /// Like [`Action::Submit`], for a namespace with QoS limits: `op` waits its turn under
    /// `qos` (without holding up the queue's other commands), then goes to `device`.
    SubmitThrottled {
        qos: Arc<NamespaceQos>,
        device: Arc<dyn BlockDevice>,
        tag: u64,
        op: IoOp,
    },
    /// Close the connection after sending what came before.
    Close,
}

impl std::fmt::Debug for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Action::Respond(r) => f.debug_tuple("Respond").field(r).finish(),
            Action::Submit { device, tag, op } => f
                .debug_struct("Submit")
                .field("device", &device.name())
                .field("tag", tag)
                .field("op", op)
                .finish(),
            Action::SubmitThrottled {
                qos,
                device,
                tag,
                op,
                ..
            } => f
                .debug_struct("SubmitThrottled")
                .field("device", &device.name())
                .field("limits", &qos.limits())
                .field("tag", tag)
                .field("op", op)
                .finish(),
            Action::Close => f.write_str("Close"),
        }
    }
}

/// What a command waiting for its device needs at completion.
#[derive(Debug)]
pub(crate) enum InFlight {
    Read,
    Write,
    Flush,
    /// A multi-op command (DSM ranges): completes when `remaining` reaches zero.
    Ranges {
        remaining: u32,
        status: Status,
    },
    /// Compare: the device reads, the core compares against the host's data.
    Compare {
        expected: IoBuf,
    },
    /// Fused compare-and-write: both commands complete together.
    FusedCompareAndWrite {
        first_cid: u16,
    },
    /// The compare half of a fused pair, held so its CID is not reused meanwhile.
    FusedFirstHalf,
    /// A reservation change being stored with the namespace's device (a gateway of a
    /// group): it takes effect and completes when the store completes.
    ReservationStore(Box<super::pr::StoringChange>),
    /// A reservation change waiting for another change of its namespace to be stored.
    ReservationParked,
}

/// The queue's association with a controller, set by Connect.
#[derive(Debug, Clone)]
pub struct Binding {
    pub controller: Arc<Controller>,
    pub qid: u16,
}

pub struct Queue {
    pub(crate) target: Arc<Target>,
    pub(crate) caps: TransportCaps,
    pub(crate) binding: Option<Binding>,
    /// Entries in the submission queue (SQSIZE + 1).
    pub(crate) sq_entries: u32,
    sq_head: u16,
    /// The host disabled SQ flow control at Connect: completions carry no SQ head, and a
    /// transport may complete a successful read with its data (NVMe/TCP C2HData SUCCESS).
    pub(crate) sq_flow_control_disabled: bool,
    pub(crate) inflight: CidMap<InFlight>,
    parked_fused_first: Option<(Command, Option<IoBuf>)>,
    buffers: Box<dyn BufferSource>,
    pub(crate) notifier: Weak<dyn QueueNotifier>,
    /// The local address the host reached this queue at (see [`Queue::set_local_address`]).
    pub(crate) local_address: Option<(TransportType, IpAddr)>,
    /// In-band authentication, when the host must authenticate this queue.
    pub(crate) auth: Option<QueueAuth>,
    /// The TLS PSK identity this queue's connection was made with (secure listeners).
    pub(crate) secure_channel: Option<super::tls::SecureChannel>,
    /// Reservation changes waiting for another change of their namespace to be stored.
    pub(crate) parked_reservations: Vec<super::pr::ParkedChange>,
    /// Runs in Connect between the secure-channel check and marking the controller plain:
    /// tests put an admin's change there, the interleaving a race would need.
    #[cfg(test)]
    pub(crate) connect_pause: Option<Box<dyn FnMut() + Send>>,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("qid", &self.qid())
            .field(
                "cntlid",
                &self.binding.as_ref().map(|b| b.controller.cntlid),
            )
            .finish_non_exhaustive()
    }
}

impl Queue {
    pub fn new(
        target: Arc<Target>,
        caps: TransportCaps,
        notifier: Weak<dyn QueueNotifier>,
    ) -> Self {
        Self {
            target,
            caps,
            binding: None,
            sq_entries: 0,
            sq_head: 0,
            sq_flow_control_disabled: false,
            inflight: CidMap::default(),
            parked_fused_first: None,
            buffers: Box::new(RecycledBuffers::default()),
            notifier,
            local_address: None,
            auth: None,
            secure_channel: None,
            parked_reservations: Vec::new(),
            #[cfg(test)]
            connect_pause: None,
        }
    }

    /// The address of this gateway that the host dialled (the socket's or CM ID's local
    /// address). A controller created on this queue lists it in its discovery log in place
    /// of a wildcard listener address (0.0.0.0 or ::), which a host could not dial; Linux
    /// nvmet does the same (`nvmet_set_disc_traddr`). An IPv4-mapped address (IPv4 through
    /// a dual-stack `[::]` socket) is kept as the IPv4 address (nvmet lists ::ffff:a.b.c.d).
    pub fn set_local_address(&mut self, transport: TransportType, address: IpAddr) {
        self.local_address = Some((transport, address.to_canonical()));
    }

    /// The connection came over a TLS handshake with this identity: Connect must name its
    /// host and subsystem.
    pub fn set_secure_channel(&mut self, channel: super::tls::SecureChannel) {
        self.secure_channel = Some(channel);
    }

    pub fn binding(&self) -> Option<&Binding> {
        self.binding.as_ref()
    }

    pub fn controller(&self) -> Option<&Arc<Controller>> {
        self.binding.as_ref().map(|b| &b.controller)
    }

    pub fn qid(&self) -> Option<u16> {
        self.binding.as_ref().map(|b| b.qid)
    }

    /// Whether the host disabled SQ flow control when it connected this queue.
    pub fn sq_flow_control_disabled(&self) -> bool {
        self.sq_flow_control_disabled
    }

    /// SQHD for a completion: reserved (0) once the host disabled SQ flow control.
    fn reported_sq_head(&self) -> u16 {
        if self.sq_flow_control_disabled {
            0
        } else {
            self.sq_head
        }
    }

    /// Whether the host must still authenticate this queue before other commands.
    pub fn awaits_authentication(&self) -> bool {
        self.auth.as_ref().is_some_and(|a| !a.is_authenticated())
    }

    /// Commands waiting for a device.
    pub fn in_flight(&self) -> usize {
        self.inflight.len()
    }

    /// Whether one more command would put more than twice the queue size the host
    /// connected with (SQSIZE + 1 entries) outstanding on this queue, counting the commands
    /// the core holds (ops at a device, a parked fused first half, on the admin queue the
    /// controller's AERs) and `held`, those the transport holds before `execute` (waiting for
    /// their data). A host never has more outstanding than its queue holds; one that does
    /// would otherwise make the gateway keep a data buffer per command, up to one per CID
    /// (65536 x MDTS per connection). Twice, as Linux nvmet (tcp.c keeps `sq->size * 2`
    /// commands per queue and fails the connection when they run out): the slack spares a
    /// host that counts its queue a little differently. The NVMe/TCP transport checks it;
    /// NVMe/RDMA needs not, its data buffers come from the bounded registered pool.
    pub fn exceeds_queue_size(&self, held: usize) -> bool {
        if self.sq_entries == 0 {
            return false; // not connected: Connect itself
        }
        let aers = match &self.binding {
            Some(b) if b.qid == 0 => b.controller.held_aers(),
            _ => 0,
        };
        let core = self.inflight.len() + usize::from(self.parked_fused_first.is_some()) + aers;
        core + held >= 2 * self.sq_entries as usize
    }

    /// Replaces where the queue's data buffers come from (an RDMA transport hands out
    /// pre-registered memory).
    pub fn set_buffer_source(&mut self, source: Box<dyn BufferSource>) {
        self.buffers = source;
    }

    /// A buffer of exactly `len` bytes for data the queue sends or receives.
    pub fn take_buffer(&mut self, len: usize) -> IoBuf {
        self.buffers.take(len)
    }

    /// Returns a buffer once the transport is done with it.
    pub fn recycle(&mut self, buf: IoBuf) {
        self.buffers.give_back(buf);
    }

    /// With no command in flight, lets the buffer source keep only what a light load reuses
    /// (the transport calls it once the host has been quiet for a while); false if busy.
    pub fn release_idle_buffers(&mut self) -> bool {
        let idle = self.inflight.is_empty() && self.parked_fused_first.is_none();
        if idle {
            self.buffers.trim_idle();
        }
        idle
    }

    /// Checks a command's data length before the transport fetches its data, so an
    /// oversized transfer is refused without reading it.
    pub fn check_data_len(&self, cmd: &Command) -> Result<(), Completion> {
        if cmd.data_len() > MAX_DATA_LEN {
            return Err(self.completion(cmd.cid(), Status::error(sc::INVALID_FIELD)));
        }
        Ok(())
    }

    /// A completion for this queue, with SQ ID and head filled in.
    pub(crate) fn completion(&self, cid: u16, status: Status) -> Completion {
        Completion {
            result: 0,
            sq_head: self.reported_sq_head(),
            sq_id: self.qid().unwrap_or(0),
            cid,
            status,
        }
    }

    pub(crate) fn respond(&self, out: &mut Vec<Action>, cid: u16, status: Status) {
        out.push(Action::Respond(Response {
            completion: self.completion(cid, status),
            data: None,
        }));
    }

    pub(crate) fn respond_with(
        &self,
        out: &mut Vec<Action>,
        completion: Completion,
        data: Option<IoBuf>,
    ) {
        let completion = Completion {
            sq_head: self.reported_sq_head(),
            sq_id: self.qid().unwrap_or(0),
            ..completion
        };
        out.push(Action::Respond(Response { completion, data }));
    }

    /// Runs one command. `data` is the host's data for host-to-controller commands.
    pub fn execute(&mut self, cmd: Command, data: Option<IoBuf>, out: &mut Vec<Action>) {
        if self.sq_entries > 0 {
            self.sq_head = ((u32::from(self.sq_head) + 1) % self.sq_entries) as u16;
        }
        if self.auth.as_ref().is_some_and(|a| !a.is_authenticated())
            && !allowed_before_authentication(&cmd)
        {
            // Not even a Keep Alive counts before the host has proven who it is.
            if let Some(buf) = data {
                self.recycle(buf);
            }
            self.refuse_unauthenticated();
            self.respond(out, cmd.cid(), Status::error(sc::AUTH_REQUIRED));
            return;
        }
        if let Some(ctrl) = self.controller() {
            ctrl.keep_alive();
        }

        // A fused pair must arrive back to back: anything else orphans a parked first half.
        if cmd.fuse() != fuse::SECOND {
            if let Some((first, first_data)) = self.parked_fused_first.take() {
                if let Some(buf) = first_data {
                    self.recycle(buf);
                }
                self.respond(out, first.cid(), Status::error(sc::FUSED_MISSING));
            }
        }
        // A CID in use by an op at a device is refused: answering the new command would put
        // two completions under one CID once the op completes.
        if self.inflight.contains_key(&cmd.cid()) {
            self.respond(out, cmd.cid(), Status::error(sc::CMDID_CONFLICT));
            return;
        }
        // A CID held by an AER (admin queue) means the host gave that AER up, as SPDK's
        // initiator does when it detaches: drop it, without a completion, and run the new
        // command, as Linux nvmet and SPDK's target accept it.
        if let Some(b) = self.binding.as_ref().filter(|b| b.qid == 0) {
            if b.controller.abandon_aer(cmd.cid()) {
                tracing::debug!(
                    cid = cmd.cid(),
                    opcode = cmd.opcode(),
                    "the host reused the CID of an outstanding AER: AER dropped"
                );
            }
        }
        if cmd.is_fabrics() {
            self.execute_fabrics(cmd, data, out);
            return;
        }
        let Some(binding) = self.binding.clone() else {
            // Only Connect may come before Connect.
            self.respond(out, cmd.cid(), Status::error(sc::CMD_SEQ_ERROR));
            return;
        };
        if binding.qid == 0 {
            self.execute_admin(&binding.controller, cmd, data, out);
            return;
        }
        match cmd.fuse() {
            0 => self.execute_io(&binding.controller, cmd, data, out),
            fuse::FIRST => {
                if cmd.opcode() != io_opcode::COMPARE {
                    self.respond(out, cmd.cid(), Status::error(sc::INVALID_FIELD));
                } else {
                    self.parked_fused_first = Some((cmd, data));
                }
            }
            fuse::SECOND => match self.parked_fused_first.take() {
                Some((first, first_data)) => {
                    self.execute_fused(&binding.controller, first, first_data, cmd, data, out)
                }
                None => self.respond(out, cmd.cid(), Status::error(sc::FUSED_MISSING)),
            },
            _ => self.respond(out, cmd.cid(), Status::error(sc::INVALID_FIELD)),
        }
    }

    /// Completions and closes that arrived from outside (asynchronous events, teardown).
    pub fn poll_events(&mut self, out: &mut Vec<Action>) {
        let Some(binding) = self.binding.clone() else {
            return;
        };
        if binding.controller.is_torn_down() {
            out.push(Action::Close);
            return;
        }
        if binding.qid == 0 {
            for completion in binding.controller.take_ready_completions() {
                self.respond_with(out, completion, None);
            }
        } else {
            self.retry_parked_reservations(out);
        }
    }

    /// Counts and logs, once per queue, that the host did not authenticate a queue that had
    /// to: it sent another command first, or closed the queue (a Linux host with no key
    /// for this subsystem gives up when Connect asks it to authenticate).
    fn refuse_unauthenticated(&mut self) {
        let Some(auth) = self.auth.as_mut() else {
            return;
        };
        if auth.is_authenticated() || !auth.first_refusal() {
            return;
        }
        if let Some(binding) = &self.binding {
            let ctrl = &binding.controller;
            self.target.connect_refusals().record(Refusal {
                reason: RefusalReason::AuthenticationRequired,
                host: &ctrl.hostnqn,
                subsystem: ctrl.subsystem.nqn(),
                qid: Some(binding.qid),
            });
        }
    }

    /// The connection is gone: release the queue, and with the admin queue the controller.
    pub fn close(&mut self) {
        self.refuse_unauthenticated();
        if let Some(binding) = self.binding.take() {
            if binding.qid == 0 {
                binding.controller.abort_parked_aers();
                binding
                    .controller
                    .teardown(TeardownReason::AdminQueueClosed);
            } else {
                binding.controller.detach_queue(binding.qid);
            }
        }
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        self.close();
    }
}
