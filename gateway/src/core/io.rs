//! NVM I/O commands, turned into block-device ops.

use std::sync::Arc;

use rbd_backend::{IoBuf, IoDone, IoError, IoOp};

use super::command::{Command, Status};
use super::controller::Controller;
use super::pr::Access;
use super::queue::{Action, InFlight, Queue, MAX_DATA_LEN};
use super::subsystem::Namespace;
use super::supported;
use crate::spec::{ana, io_opcode, rw, sc, NSID_ALL};

/// A checked LBA range of a Read/Write/Compare/Write Zeroes command.
struct LbaRange {
    offset: u64,
    len: u64,
}

fn device_error_status(err: &IoError) -> Status {
    match err {
        IoError::Miscompare { .. } => Status::error(sc::COMPARE_FAILED),
        IoError::OutOfRange { .. } => Status::error(sc::LBA_RANGE),
        IoError::ReadOnly => Status::error(sc::READ_ONLY),
        // The backend may recover (a Ceph OSD coming back): let the host retry.
        IoError::Device(_) => Status::retryable(sc::INTERNAL),
        // This gateway's cluster client was blocklisted: the group is served elsewhere now.
        // A path-related status (SCT 3h, DNR clear) makes a multipath host fail the command
        // over to another path and re-read the ANA log, where this group is inaccessible
        // (the device reported the fence before completing the op). Generic Internal Error
        // would be retried on this same path until the host gives up with an I/O error.
        IoError::Fenced(_) => Status::retryable(sc::ANA_INACCESSIBLE),
    }
}

/// Path status for a namespace's ANA group on this gateway; None when I/O may proceed.
fn ana_path_status(ctrl: &Controller, ns: &Namespace) -> Option<Status> {
    match ctrl.subsystem.ana_state(ns.ana_group) {
        ana::OPTIMIZED | ana::NON_OPTIMIZED => None,
        ana::PERSISTENT_LOSS => Some(Status::retryable(sc::ANA_PERSISTENT_LOSS)),
        ana::CHANGE => Some(Status::retryable(sc::ANA_TRANSITION)),
        _ => Some(Status::retryable(sc::ANA_INACCESSIBLE)),
    }
}

/// SLBA in CDW10-11, 0's based block count in CDW12 bits 15:0.
fn lba_range(ns: &Namespace, cmd: &Command) -> Result<LbaRange, Status> {
    let slba = u64::from(cmd.cdw(10)) | (u64::from(cmd.cdw(11)) << 32);
    let blocks = u64::from(cmd.cdw(12) & 0xffff) + 1;
    match slba.checked_add(blocks) {
        Some(end) if end <= ns.size_in_lbas() => Ok(LbaRange {
            offset: slba << ns.lba_shift,
            len: blocks << ns.lba_shift,
        }),
        _ => Err(Status::error(sc::LBA_RANGE)),
    }
}

/// The command's SGL must describe exactly the bytes its blocks cover.
fn check_transfer(cmd: &Command, range: &LbaRange) -> Result<(), Status> {
    if range.len > u64::from(MAX_DATA_LEN) {
        return Err(Status::error(sc::INVALID_FIELD));
    }
    if u64::from(cmd.data_len()) != range.len {
        return Err(Status::error(sc::SGL_INVALID_DATA));
    }
    Ok(())
}

fn host_data(data: Option<IoBuf>, range: &LbaRange) -> Result<IoBuf, (Status, Option<IoBuf>)> {
    match data {
        Some(buf) if buf.len() as u64 == range.len => Ok(buf),
        other => Err((Status::error(sc::SGL_INVALID_DATA), other)),
    }
}

/// The action that starts `op` on the namespace's device: through its QoS limits when it
/// has any (one relaxed load decides; an unlimited namespace pays nothing more).
fn submit_action(ns: &Namespace, tag: u64, op: IoOp) -> Action {
    if ns.qos.is_limited() {
        Action::SubmitThrottled {
            qos: ns.qos.clone(),
            device: ns.device.clone(),
            tag,
            op,
        }
    } else {
        Action::Submit {
            device: ns.device.clone(),
            tag,
            op,
        }
    }
}

impl Queue {
    fn namespace_for_io(&self, ctrl: &Controller, cmd: &Command) -> Result<Arc<Namespace>, Status> {
        // A namespace hidden from this host is an inactive NSID to it.
        let ns = ctrl
            .subsystem
            .namespace_for_host(cmd.nsid(), &ctrl.hostnqn)
            .ok_or(Status::error(sc::INVALID_NS))?;
        match ana_path_status(ctrl, &ns) {
            Some(status) => Err(status),
            None => Ok(ns),
        }
    }

    fn submit(
        &mut self,
        out: &mut Vec<Action>,
        ns: &Namespace,
        cid: u16,
        inflight: InFlight,
        op: IoOp,
    ) {
        self.inflight.insert(cid, inflight);
        out.push(submit_action(ns, u64::from(cid), op));
    }

    pub(crate) fn fail(
        &mut self,
        out: &mut Vec<Action>,
        cid: u16,
        status: Status,
        data: Option<IoBuf>,
    ) {
        if let Some(buf) = data {
            self.recycle(buf);
        }
        self.respond(out, cid, status);
    }

    pub(crate) fn execute_io(
        &mut self,
        ctrl: &Arc<Controller>,
        cmd: Command,
        data: Option<IoBuf>,
        out: &mut Vec<Action>,
    ) {
        let cid = cmd.cid();
        if cmd.opcode() == io_opcode::FLUSH && cmd.nsid() == NSID_ALL {
            // VWC says broadcast flush is not supported.
            return self.fail(out, cid, Status::error(sc::INVALID_NS), data);
        }
        let ns = match self.namespace_for_io(ctrl, &cmd) {
            Ok(ns) => ns,
            Err(status) => return self.fail(out, cid, status, data),
        };
        let writes = matches!(
            cmd.opcode(),
            io_opcode::WRITE | io_opcode::WRITE_ZEROES | io_opcode::DSM
        );
        if writes && ns.read_only {
            return self.fail(out, cid, Status::error(sc::READ_ONLY), data);
        }
        let access = match cmd.opcode() {
            io_opcode::READ | io_opcode::COMPARE => Some(Access::Read),
            io_opcode::WRITE | io_opcode::WRITE_ZEROES | io_opcode::DSM | io_opcode::FLUSH => {
                Some(Access::Write)
            }
            _ => None,
        };
        if let Some(access) = access {
            let reservations = &ctrl.subsystem.reservations;
            if let Err(status) = reservations.check(ns.nsid, &ctrl.hostid, access) {
                return self.fail(out, cid, status, data);
            }
        }
        match cmd.opcode() {
            io_opcode::READ => {
                let range =
                    match lba_range(&ns, &cmd).and_then(|r| check_transfer(&cmd, &r).map(|_| r)) {
                        Ok(r) => r,
                        Err(status) => return self.fail(out, cid, status, data),
                    };
                let buf = self.take_buffer(range.len as usize);
                self.submit(
                    out,
                    &ns,
                    cid,
                    InFlight::Read,
                    IoOp::Read {
                        offset: range.offset,
                        buf,
                    },
                );
            }
            io_opcode::WRITE | io_opcode::COMPARE => {
                let range =
                    match lba_range(&ns, &cmd).and_then(|r| check_transfer(&cmd, &r).map(|_| r)) {
                        Ok(r) => r,
                        Err(status) => return self.fail(out, cid, status, data),
                    };
                let buf = match host_data(data, &range) {
                    Ok(buf) => buf,
                    Err((status, data)) => return self.fail(out, cid, status, data),
                };
                if cmd.opcode() == io_opcode::WRITE {
                    let fua = cmd.cdw(12) & rw::CDW12_FUA != 0;
                    self.submit(
                        out,
                        &ns,
                        cid,
                        InFlight::Write,
                        IoOp::Write {
                            offset: range.offset,
                            buf,
                            fua,
                        },
                    );
                } else {
                    let read_buf = self.take_buffer(range.len as usize);
                    self.submit(
                        out,
                        &ns,
                        cid,
                        InFlight::Compare { expected: buf },
                        IoOp::Read {
                            offset: range.offset,
                            buf: read_buf,
                        },
                    );
                }
            }
            io_opcode::FLUSH => {
                if let Some(buf) = data {
                    self.recycle(buf);
                }
                self.submit(out, &ns, cid, InFlight::Flush, IoOp::Flush);
            }
            io_opcode::WRITE_ZEROES => {
                if let Some(buf) = data {
                    self.recycle(buf);
                }
                match lba_range(&ns, &cmd) {
                    Ok(range) => self.submit(
                        out,
                        &ns,
                        cid,
                        InFlight::Write,
                        IoOp::WriteZeroes {
                            offset: range.offset,
                            len: range.len,
                        },
                    ),
                    Err(status) => self.respond(out, cid, status),
                }
            }
            io_opcode::DSM => self.dataset_management(&ns, &cmd, data, out),
            io_opcode::RESV_REGISTER
            | io_opcode::RESV_REPORT
            | io_opcode::RESV_ACQUIRE
            | io_opcode::RESV_RELEASE
                if supported::io_command_offered(&self.target, cmd.opcode()) =>
            {
                self.execute_reservation(ctrl, &ns, &cmd, data, out)
            }
            _ => self.fail(out, cid, Status::error(sc::INVALID_OPCODE), data),
        }
    }

    /// Dataset Management: only the deallocate attribute does anything; each range becomes a
    /// discard and the command completes when all have.
    fn dataset_management(
        &mut self,
        ns: &Namespace,
        cmd: &Command,
        data: Option<IoBuf>,
        out: &mut Vec<Action>,
    ) {
        let cid = cmd.cid();
        let ranges = (cmd.cdw(10) & 0xff) as usize + 1;
        let needed = ranges * rw::DSM_RANGE_LEN;
        let Some(buf) = data.filter(|b| b.len() >= needed) else {
            return self.respond(out, cid, Status::error(sc::SGL_INVALID_DATA));
        };
        if cmd.cdw(11) & rw::DSM_AD == 0 {
            self.recycle(buf);
            return self.respond(out, cid, Status::SUCCESS);
        }
        let size = ns.size_in_lbas();
        let mut discards = Vec::with_capacity(ranges);
        for chunk in buf.as_slice()[..needed].chunks_exact(rw::DSM_RANGE_LEN) {
            let blocks = u64::from(u32::from_le_bytes([chunk[4], chunk[5], chunk[6], chunk[7]]));
            let slba = u64::from_le_bytes([
                chunk[8], chunk[9], chunk[10], chunk[11], chunk[12], chunk[13], chunk[14],
                chunk[15],
            ]);
            if blocks == 0 {
                continue;
            }
            match slba.checked_add(blocks) {
                Some(end) if end <= size => discards.push(IoOp::Discard {
                    offset: slba << ns.lba_shift,
                    len: blocks << ns.lba_shift,
                }),
                _ => {
                    self.recycle(buf);
                    return self.respond(out, cid, Status::error(sc::LBA_RANGE));
                }
            }
        }
        self.recycle(buf);
        if discards.is_empty() {
            return self.respond(out, cid, Status::SUCCESS);
        }
        self.inflight.insert(
            cid,
            InFlight::Ranges {
                remaining: discards.len() as u32,
                status: Status::SUCCESS,
            },
        );
        for op in discards {
            out.push(submit_action(ns, u64::from(cid), op));
        }
    }

    /// Fused Compare (first) + Write (second) over the same blocks: one atomic
    /// compare-and-write on the device.
    pub(crate) fn execute_fused(
        &mut self,
        ctrl: &Arc<Controller>,
        first: Command,
        first_data: Option<IoBuf>,
        second: Command,
        second_data: Option<IoBuf>,
        out: &mut Vec<Action>,
    ) {
        let (cid1, cid2) = (first.cid(), second.cid());
        let prepared = (|| {
            if second.opcode() != io_opcode::WRITE || second.nsid() != first.nsid() {
                return Err(Status::error(sc::INVALID_FIELD));
            }
            if (first.cdw(10), first.cdw(11), first.cdw(12) & 0xffff)
                != (second.cdw(10), second.cdw(11), second.cdw(12) & 0xffff)
            {
                return Err(Status::error(sc::INVALID_FIELD));
            }
            let ns = self.namespace_for_io(ctrl, &first)?;
            if ns.read_only {
                return Err(Status::error(sc::READ_ONLY));
            }
            ctrl.subsystem
                .reservations
                .check(ns.nsid, &ctrl.hostid, Access::Write)?;
            let range = lba_range(&ns, &first)?;
            check_transfer(&first, &range)?;
            check_transfer(&second, &range)?;
            Ok((ns, range))
        })();
        let (ns, range) = match prepared {
            Ok(p) => p,
            Err(status) => {
                for buf in [first_data, second_data].into_iter().flatten() {
                    self.recycle(buf);
                }
                self.respond(out, cid1, status);
                self.respond(out, cid2, Status::error(sc::FUSED_FAIL));
                return;
            }
        };
        let (compare, write) = match (first_data, second_data) {
            (Some(c), Some(w)) if c.len() as u64 == range.len && w.len() as u64 == range.len => {
                (c, w)
            }
            (c, w) => {
                for buf in [c, w].into_iter().flatten() {
                    self.recycle(buf);
                }
                self.respond(out, cid1, Status::error(sc::SGL_INVALID_DATA));
                self.respond(out, cid2, Status::error(sc::FUSED_FAIL));
                return;
            }
        };
        if self.inflight.contains_key(&cid1) || cid1 == cid2 {
            self.recycle(compare);
            self.recycle(write);
            self.respond(out, cid1, Status::error(sc::CMDID_CONFLICT));
            self.respond(out, cid2, Status::error(sc::FUSED_FAIL));
            return;
        }
        self.inflight.insert(cid1, InFlight::FusedFirstHalf);
        self.submit(
            out,
            &ns,
            cid2,
            InFlight::FusedCompareAndWrite { first_cid: cid1 },
            IoOp::CompareAndWrite {
                offset: range.offset,
                compare,
                write,
            },
        );
    }

    /// [`Self::complete_io`] for each of `done`, which it leaves empty (its allocation kept).
    pub fn complete_each(&mut self, done: &mut Vec<IoDone>, out: &mut Vec<Action>) {
        for d in done.drain(..) {
            self.complete_io(d, out);
        }
    }

    /// A device finished an op this queue submitted.
    pub fn complete_io(&mut self, done: IoDone, out: &mut Vec<Action>) {
        let cid = done.tag as u16;
        let status_of = |r: &Result<(), IoError>| match r {
            Ok(()) => Status::SUCCESS,
            Err(e) => device_error_status(e),
        };
        if let Some(InFlight::Ranges { remaining, status }) = self.inflight.get_mut(&cid) {
            if status.is_success() {
                *status = status_of(&done.result);
            }
            *remaining -= 1;
            if *remaining > 0 {
                return;
            }
        }
        let Some(inflight) = self.inflight.remove(&cid) else {
            tracing::error!(cid, "completion for a command that is not in flight");
            return;
        };
        if let Err(e) = &done.result {
            tracing::warn!(cid, error = %e, "I/O failed");
        }
        match (inflight, done.op) {
            (InFlight::Read, IoOp::Read { buf, .. }) => match done.result {
                Ok(()) => {
                    let completion = self.completion(cid, Status::SUCCESS);
                    self.respond_with(out, completion, Some(buf));
                }
                Err(e) => self.fail(out, cid, device_error_status(&e), Some(buf)),
            },
            (InFlight::Compare { expected }, IoOp::Read { buf, .. }) => {
                let status = match done.result {
                    Ok(()) if buf.as_slice() == expected.as_slice() => Status::SUCCESS,
                    Ok(()) => Status::error(sc::COMPARE_FAILED),
                    Err(e) => device_error_status(&e),
                };
                self.recycle(expected);
                self.fail(out, cid, status, Some(buf));
            }
            (
                InFlight::FusedCompareAndWrite { first_cid },
                IoOp::CompareAndWrite { compare, write, .. },
            ) => {
                self.inflight.remove(&first_cid);
                self.recycle(compare);
                self.recycle(write);
                match done.result {
                    Ok(()) => {
                        self.respond(out, first_cid, Status::SUCCESS);
                        self.respond(out, cid, Status::SUCCESS);
                    }
                    Err(e) => {
                        self.respond(out, first_cid, device_error_status(&e));
                        self.respond(out, cid, Status::error(sc::FUSED_FAIL));
                    }
                }
            }
            (InFlight::Ranges { status, .. }, _) => self.respond(out, cid, status),
            (InFlight::ReservationStore(change), _) => {
                self.finish_reservation_store(cid, *change, &done.result, out)
            }
            (_, op) => {
                let status = status_of(&done.result);
                if let IoOp::Write { buf, .. } | IoOp::Read { buf, .. } = op {
                    self.recycle(buf);
                }
                self.respond(out, cid, status);
            }
        }
    }
}

#[cfg(test)]
mod status_tests {
    use super::*;

    /// Linux `nvme_is_path_error()`: status code type 3h (path related).
    fn is_path_error(status: Status) -> bool {
        status.raw() & 0x700 == 0x300
    }

    /// Linux `NVME_STATUS_DNR` (0x4000): the host never retries such a command.
    fn has_dnr(status: Status) -> bool {
        status.raw() & 0x4000 != 0
    }

    #[test]
    fn a_fenced_device_fails_over_to_another_path() {
        let s = device_error_status(&IoError::Fenced("client blocklisted".into()));
        assert_eq!(s.raw(), 0x302, "ANA inaccessible");
        assert!(is_path_error(s));
        assert!(!has_dnr(s), "a fenced write must be retried elsewhere");
    }

    #[test]
    fn device_errors_are_retried_and_media_checks_are_final() {
        let s = device_error_status(&IoError::Device("timeout".into()));
        assert!(!has_dnr(s) && !is_path_error(s));
        for e in [
            IoError::ReadOnly,
            IoError::Miscompare { offset_in_range: 0 },
            IoError::OutOfRange {
                offset: 0,
                len: 1,
                size: 0,
            },
        ] {
            let s = device_error_status(&e);
            assert!(has_dnr(s), "{e}");
            assert!(!is_path_error(s), "{e}");
        }
    }
}
