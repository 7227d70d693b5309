//! Fabrics commands: Connect, Property Get/Set, Disconnect.

use std::sync::Arc;

use rbd_backend::IoBuf;

use super::auth::QueueAuth;
use super::command::{Command, Status};
use super::controller::{Controller, MAX_IO_QUEUES};
use super::queue::{Action, Binding, Queue, Response, MAX_QUEUE_ENTRIES};
use super::refusals::{Refusal, RefusalReason};
use super::subsystem::Subsystem;
use crate::spec::{cntlid, fabrics, reg, sc, version, NQN_FIELD_LEN, NQN_MAX_LEN};

/// Length of the Connect command's data (`struct nvmf_connect_data`).
pub const CONNECT_DATA_LEN: usize = 1024;
/// Field offsets in the Connect data, for invalid-parameter reports.
const DATA_HOSTID: usize = 0;
const DATA_CNTLID: usize = 16;
const DATA_SUBNQN: usize = 256;
const DATA_HOSTNQN: usize = 512;
/// Field offsets in the Connect command.
const CMD_RECFMT: usize = 40;
const CMD_QID: usize = 42;
const CMD_SQSIZE: usize = 44;
const CMD_CATTR: usize = 46;
const CMD_KATO: usize = 48;

/// NVMe version reported in VS and Identify Controller VER: 1.4 brought ANA.
pub const NVME_VERSION: u32 = version(1, 4, 0);
/// CAP.TO in 500 ms units: how long the host waits for CSTS.RDY (7.5 s).
const CAP_TIMEOUT_UNITS: u64 = 15;

/// Completion dword 0 for Connect Invalid Parameters: offset of the bad field, with IATTR
/// set when it lies in the data rather than the command.
fn invalid_param_location(offset: usize, in_data: bool) -> u64 {
    (offset as u64) | if in_data { 1 << 16 } else { 0 }
}

/// Queues of NVM subsystems (not discovery) connected since the process started: admin
/// queues (one per controller) and I/O queues. What ceph-nvmeof's `get_gateway_stats` calls
/// a poll group's `admin_qpairs` and `io_qpairs`; the group agent beacons them.
pub struct QueuesConnected {
    pub admin: std::sync::atomic::AtomicU64,
    pub io: std::sync::atomic::AtomicU64,
}

pub static QUEUES_CONNECTED: QueuesConnected = QueuesConnected {
    admin: std::sync::atomic::AtomicU64::new(0),
    io: std::sync::atomic::AtomicU64::new(0),
};

/// The parsed Connect command and data.
struct ConnectRequest {
    qid: u16,
    sqsize: u16,
    /// CATTR bit 2: the host asks to disable SQ flow control.
    disable_sq_flow_control: bool,
    kato_ms: u32,
    hostid: [u8; 16],
    cntlid: u16,
    subnqn: String,
    hostnqn: String,
}

/// A rejected Connect: status, the parameter location reported in dword 0, and why.
struct Reject {
    status: Status,
    location: u64,
    reason: RefusalReason,
}

impl Reject {
    fn data(code: u16, offset: usize, reason: RefusalReason) -> Self {
        Reject {
            status: Status::error(code),
            location: invalid_param_location(offset, true),
            reason,
        }
    }

    fn command(code: u16, offset: usize, reason: RefusalReason) -> Self {
        Reject {
            status: Status::error(code),
            location: invalid_param_location(offset, false),
            reason,
        }
    }

    fn plain(code: u16, reason: RefusalReason) -> Self {
        Reject {
            status: Status::error(code),
            location: 0,
            reason,
        }
    }
}

/// The bytes of an NQN field up to its NUL (all of it without one).
fn nqn_bytes(field: &[u8]) -> &[u8] {
    let len = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    &field[..len]
}

/// An NQN field: NUL-terminated UTF-8 of at most 223 bytes; empty only if `may_be_empty`.
fn parse_nqn(field: &[u8], may_be_empty: bool) -> Option<String> {
    let bytes = nqn_bytes(field);
    if (bytes.is_empty() && !may_be_empty) || bytes.len() > NQN_MAX_LEN {
        return None;
    }
    std::str::from_utf8(bytes).ok().map(str::to_owned)
}

/// The subsystem and host NQNs of Connect data as far as they can be read, for the log of
/// a refusal (lossy: the refusal may be that they are not UTF-8).
fn nqns_for_log(data: Option<&IoBuf>) -> (String, String) {
    match data {
        Some(d) if d.len() >= CONNECT_DATA_LEN => {
            let d = d.as_slice();
            let lossy = |at: usize| {
                String::from_utf8_lossy(nqn_bytes(&d[at..at + NQN_FIELD_LEN])).into_owned()
            };
            (lossy(DATA_SUBNQN), lossy(DATA_HOSTNQN))
        }
        _ => (String::new(), String::new()),
    }
}

fn parse_connect(cmd: &Command, data: Option<&IoBuf>) -> Result<ConnectRequest, Reject> {
    let raw = cmd.as_bytes();
    let le16 = |at: usize| u16::from_le_bytes([raw[at], raw[at + 1]]);
    if le16(CMD_RECFMT) != 0 {
        return Err(Reject::command(
            sc::CONNECT_FORMAT,
            CMD_RECFMT,
            RefusalReason::IncompatibleFormat,
        ));
    }
    let data = match data {
        Some(d) if d.len() >= CONNECT_DATA_LEN => d.as_slice(),
        _ => {
            return Err(Reject::plain(
                sc::SGL_INVALID_DATA,
                RefusalReason::NoConnectData,
            ))
        }
    };
    let mut hostid = [0u8; 16];
    hostid.copy_from_slice(&data[DATA_HOSTID..DATA_HOSTID + 16]);
    Ok(ConnectRequest {
        qid: le16(CMD_QID),
        sqsize: le16(CMD_SQSIZE),
        disable_sq_flow_control: raw[CMD_CATTR] & fabrics::CONNECT_DISABLE_SQFLOW != 0,
        kato_ms: cmd.cdw(CMD_KATO / 4),
        hostid,
        cntlid: u16::from_le_bytes([data[DATA_CNTLID], data[DATA_CNTLID + 1]]),
        subnqn: parse_nqn(&data[DATA_SUBNQN..DATA_SUBNQN + NQN_FIELD_LEN], false).ok_or(
            Reject::data(
                sc::CONNECT_INVALID_PARAM,
                DATA_SUBNQN,
                RefusalReason::InvalidSubsystemNqn,
            ),
        )?,
        // Empty: SPDK's initiator tools send none unless told one. Linux nvmet and SPDK's
        // target take it (a subsystem that allows any host lets it in), and so does this one.
        hostnqn: parse_nqn(&data[DATA_HOSTNQN..DATA_HOSTNQN + NQN_FIELD_LEN], true).ok_or(
            Reject::data(
                sc::CONNECT_INVALID_PARAM,
                DATA_HOSTNQN,
                RefusalReason::InvalidHostNqn,
            ),
        )?,
    })
}

impl Queue {
    pub(crate) fn execute_fabrics(
        &mut self,
        cmd: Command,
        data: Option<IoBuf>,
        out: &mut Vec<Action>,
    ) {
        let fctype = cmd.fctype();
        if fctype == fabrics::CONNECT {
            let result = self.connect(&cmd, data.as_ref());
            if let Err(reject) = &result {
                let (subsystem, host) = nqns_for_log(data.as_ref());
                let raw = cmd.as_bytes();
                let qid = Some(u16::from_le_bytes([raw[CMD_QID], raw[CMD_QID + 1]]));
                self.target.connect_refusals().record(Refusal {
                    reason: reject.reason,
                    host: &host,
                    subsystem: &subsystem,
                    qid,
                });
            }
            if let Some(buf) = data {
                self.recycle(buf);
            }
            match result {
                Ok(cntlid) => {
                    let authreq = if self.auth.is_some() {
                        fabrics::CONNECT_AUTHREQ_ATR
                    } else {
                        0
                    };
                    let mut completion = self
                        .completion(cmd.cid(), Status::SUCCESS)
                        .with_result(u64::from(u32::from(cntlid) | authreq));
                    if self.sq_flow_control_disabled {
                        // FFFFh in this one SQHD tells the host its request was accepted.
                        completion.sq_head = fabrics::SQHD_FLOW_CONTROL_DISABLED;
                    }
                    out.push(Action::Respond(Response {
                        completion,
                        data: None,
                    }));
                }
                Err(reject) => {
                    let completion = self
                        .completion(cmd.cid(), reject.status)
                        .with_result(reject.location);
                    self.respond_with(out, completion, None);
                }
            }
            return;
        }
        let Some(binding) = self.binding.clone() else {
            if let Some(buf) = data {
                self.recycle(buf);
            }
            self.respond(out, cmd.cid(), Status::error(sc::CMD_SEQ_ERROR));
            return;
        };
        if matches!(fctype, fabrics::AUTH_SEND | fabrics::AUTH_RECEIVE) {
            self.execute_auth(&binding, cmd, data, out);
            return;
        }
        if let Some(buf) = data {
            self.recycle(buf);
        }
        match (fctype, binding.qid) {
            (fabrics::PROPERTY_GET, 0) => match property_get(&binding.controller, &cmd) {
                Ok(value) => {
                    let completion = self
                        .completion(cmd.cid(), Status::SUCCESS)
                        .with_result(value);
                    self.respond_with(out, completion, None);
                }
                Err(status) => self.respond(out, cmd.cid(), status),
            },
            (fabrics::PROPERTY_SET, 0) => {
                let status = property_set(&binding.controller, &cmd);
                self.respond(out, cmd.cid(), status);
            }
            (fabrics::DISCONNECT, qid) if qid != 0 => {
                self.respond(out, cmd.cid(), Status::SUCCESS);
                out.push(Action::Close);
            }
            _ => self.respond(out, cmd.cid(), Status::error(sc::INVALID_OPCODE)),
        }
    }

    fn connect(&mut self, cmd: &Command, data: Option<&IoBuf>) -> Result<u16, Reject> {
        if self.binding.is_some() {
            return Err(Reject::plain(
                sc::CMD_SEQ_ERROR,
                RefusalReason::AlreadyConnected,
            ));
        }
        let req = parse_connect(cmd, data)?;
        let subsystem = self.target.subsystem(&req.subnqn).ok_or(Reject::data(
            sc::CONNECT_INVALID_PARAM,
            DATA_SUBNQN,
            RefusalReason::UnknownSubsystem,
        ))?;
        if !subsystem.allows_host(&req.hostnqn) {
            let reason = if req.hostnqn.is_empty() {
                RefusalReason::NoHostNqn
            } else {
                RefusalReason::HostNotAllowed
            };
            return Err(Reject::data(sc::CONNECT_INVALID_HOST, DATA_HOSTNQN, reason));
        }
        self.check_secure_channel(&subsystem, &req)?;
        if req.sqsize == 0 || u32::from(req.sqsize) + 1 > MAX_QUEUE_ENTRIES {
            return Err(Reject::command(
                sc::CONNECT_INVALID_PARAM,
                CMD_SQSIZE,
                RefusalReason::InvalidSqsize,
            ));
        }
        let controller = if req.qid == 0 {
            self.connect_admin(subsystem, &req)?
        } else {
            self.connect_io(&subsystem, &req)?
        };
        let cntlid = controller.cntlid;
        #[cfg(test)]
        if let Some(pause) = self.connect_pause.as_mut() {
            pause();
        }
        if self.secure_channel.is_none() {
            controller.note_plain_queue();
            // `require_tls` may have turned on since check_secure_channel. That side
            // (`Subsystem::set_tls_required`) sets the flag, then closes the plain controllers
            // it finds; this side marks the controller plain, then reads the flag. Both in
            // SeqCst order, so at least one sees the other and the controller is closed.
            if controller.subsystem.tls.required() {
                controller.teardown(super::controller::TeardownReason::TlsRequired);
                return Err(Reject::data(
                    sc::CONNECT_INVALID_HOST,
                    DATA_HOSTNQN,
                    RefusalReason::TlsRequired,
                ));
            }
        }
        if req.qid == 0 {
            controller.set_auth_keys(controller.subsystem.host_keys(&req.hostnqn));
        }
        self.auth = controller.auth_keys().map(QueueAuth::new);
        controller.register_notifier(self.notifier.clone());
        self.sq_entries = u32::from(req.sqsize) + 1;
        self.sq_flow_control_disabled = req.disable_sq_flow_control;
        tracing::info!(cntlid, qid = req.qid, sqsize = req.sqsize, sq_flow_control = !req.disable_sq_flow_control, host = %req.hostnqn, subsystem = %req.subnqn, "queue connected");
        if req.hostnqn.is_empty() && req.qid == 0 {
            tracing::info!(
                cntlid,
                subsystem = %req.subnqn,
                "host connected without a host NQN (the subsystem allows any host)"
            );
        }
        self.target
            .connect_refusals()
            .forget(&req.hostnqn, &req.subnqn);
        if !controller.subsystem.is_discovery() {
            let connected = if req.qid == 0 {
                &QUEUES_CONNECTED.admin
            } else {
                &QUEUES_CONNECTED.io
            };
            connected.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        self.binding = Some(Binding {
            controller,
            qid: req.qid,
        });
        Ok(cntlid)
    }

    /// Over TLS, the Connect must be for the PSK identity's host and subsystem (a host's key
    /// must not open another host's queues); without TLS, the subsystem must not require it.
    fn check_secure_channel(
        &self,
        subsystem: &Subsystem,
        req: &ConnectRequest,
    ) -> Result<(), Reject> {
        match &self.secure_channel {
            Some(channel) if channel.hostnqn != req.hostnqn || channel.subnqn != req.subnqn => {
                Err(Reject::data(
                    sc::CONNECT_INVALID_HOST,
                    DATA_HOSTNQN,
                    RefusalReason::TlsIdentityMismatch,
                ))
            }
            None if subsystem.tls.required() => Err(Reject::data(
                sc::CONNECT_INVALID_HOST,
                DATA_HOSTNQN,
                RefusalReason::TlsRequired,
            )),
            _ => Ok(()),
        }
    }

    fn connect_admin(
        &self,
        subsystem: Arc<Subsystem>,
        req: &ConnectRequest,
    ) -> Result<Arc<Controller>, Reject> {
        if req.cntlid != cntlid::DYNAMIC && req.cntlid != cntlid::STATIC_ANY {
            return Err(Reject::data(
                sc::CONNECT_INVALID_PARAM,
                DATA_CNTLID,
                RefusalReason::InvalidControllerId,
            ));
        }
        let target = self.target.clone();
        let caps = self.caps;
        let local = self.local_address;
        let sub = subsystem.clone();
        subsystem
            .register_controller(|id| {
                Arc::new(
                    Controller::new(
                        id,
                        sub,
                        target,
                        req.hostnqn.clone(),
                        req.hostid,
                        req.kato_ms,
                        caps,
                    )
                    .with_local_address(local),
                )
            })
            .map_err(|_| {
                Reject::plain(sc::CONNECT_CTRL_BUSY, RefusalReason::ControllerIdsExhausted)
            })
    }

    fn connect_io(
        &self,
        subsystem: &Subsystem,
        req: &ConnectRequest,
    ) -> Result<Arc<Controller>, Reject> {
        if subsystem.is_discovery() {
            return Err(Reject::command(
                sc::CONNECT_INVALID_PARAM,
                CMD_QID,
                RefusalReason::InvalidQueueId,
            ));
        }
        let controller = subsystem
            .controller(req.cntlid)
            .filter(|c| !c.is_torn_down())
            .ok_or(Reject::data(
                sc::CONNECT_INVALID_PARAM,
                DATA_CNTLID,
                RefusalReason::UnknownController,
            ))?;
        if controller.hostnqn != req.hostnqn {
            return Err(Reject::data(
                sc::CONNECT_INVALID_PARAM,
                DATA_HOSTNQN,
                RefusalReason::HostMismatch,
            ));
        }
        if !controller.is_ready() {
            return Err(Reject::plain(
                sc::CMD_SEQ_ERROR,
                RefusalReason::ControllerNotReady,
            ));
        }
        let granted = match controller.io_queues_granted() {
            0 => MAX_IO_QUEUES,
            n => n,
        };
        if req.qid > granted {
            return Err(Reject::command(
                sc::CONNECT_INVALID_PARAM,
                CMD_QID,
                RefusalReason::InvalidQueueId,
            ));
        }
        if !controller.attach_queue(req.qid) {
            return Err(Reject::plain(sc::CMD_SEQ_ERROR, RefusalReason::QueueInUse));
        }
        Ok(controller)
    }
}

/// Property Get: attribute bits 2:0 give the size (0 = 4 bytes, 1 = 8 bytes).
fn property_get(ctrl: &Controller, cmd: &Command) -> Result<u64, Status> {
    let eight_bytes = cmd.as_bytes()[40] & 0x7 == 1;
    let offset = cmd.cdw(11);
    let value = match (offset, eight_bytes) {
        (reg::CAP, true) => capabilities(),
        (reg::VS, false) => u64::from(NVME_VERSION),
        (reg::CC, false) => u64::from(ctrl.cc()),
        (reg::CSTS, false) => u64::from(ctrl.csts()),
        _ => return Err(Status::error(sc::INVALID_FIELD)),
    };
    Ok(value)
}

fn property_set(ctrl: &Controller, cmd: &Command) -> Status {
    let eight_bytes = cmd.as_bytes()[40] & 0x7 == 1;
    let offset = cmd.cdw(11);
    let value = cmd.cdw(12);
    match (offset, eight_bytes) {
        (reg::CC, false) => {
            ctrl.write_cc(value);
            Status::SUCCESS
        }
        _ => Status::error(sc::INVALID_FIELD),
    }
}

/// CAP: MQES, contiguous queues required, timeout, NVM command set; 4 KiB pages only.
pub fn capabilities() -> u64 {
    let mqes = u64::from(MAX_QUEUE_ENTRIES - 1);
    let cqr = 1u64 << 16;
    let timeout = CAP_TIMEOUT_UNITS << 24;
    let css_nvm = 1u64 << 37;
    mqes | cqr | timeout | css_nvm
}
