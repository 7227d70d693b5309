//! Admin commands of I/O and discovery controllers.

use std::sync::Arc;

use rbd_backend::IoBuf;

use super::command::{Command, Status};
use super::controller::Controller;
use super::queue::{Action, Queue};
use super::{identify, log_page};
use crate::spec::{admin_opcode, aer, cns, feat, sc, CSI_NVM, IDENTIFY_DATA_SIZE, NSID_ALL};

/// Set/Get Features: the Save bit (CDW10 bit 31) and the Get Features select field.
const FEATURES_SAVE: u32 = 1 << 31;
const GET_FEATURES_SEL_SHIFT: u32 = 8;
const SEL_SUPPORTED_CAPABILITIES: u32 = 3;
/// Capabilities reported for SEL = 3: changeable, not saveable, not per namespace.
const FEATURE_CAPABILITY_CHANGEABLE: u64 = 1 << 2;

impl Queue {
    pub(crate) fn execute_admin(
        &mut self,
        ctrl: &Arc<Controller>,
        cmd: Command,
        data: Option<IoBuf>,
        out: &mut Vec<Action>,
    ) {
        if let Some(buf) = data {
            self.recycle(buf);
        }
        if !ctrl.is_ready() {
            self.respond(out, cmd.cid(), Status::error(sc::CMD_SEQ_ERROR));
            return;
        }
        let discovery = ctrl.is_discovery();
        match cmd.opcode() {
            admin_opcode::IDENTIFY => self.identify(ctrl, &cmd, out),
            admin_opcode::GET_LOG_PAGE => self.get_log_page(ctrl, &cmd, out),
            admin_opcode::SET_FEATURES => self.set_features(ctrl, &cmd, out),
            admin_opcode::GET_FEATURES => self.get_features(ctrl, &cmd, out),
            admin_opcode::ASYNC_EVENT => {
                if !ctrl.park_aer(cmd.cid()) {
                    self.respond(out, cmd.cid(), Status::error(sc::ASYNC_LIMIT));
                }
                // Parked: completes when an event arrives (see Queue::poll_events).
            }
            admin_opcode::KEEP_ALIVE => self.respond(out, cmd.cid(), Status::SUCCESS),
            admin_opcode::ABORT if !discovery => {
                // Dword 0 bit 0 set: the command was not aborted. Commands here complete
                // quickly and in order, so aborting one is never worth the race.
                let completion = self.completion(cmd.cid(), Status::SUCCESS).with_result(1);
                self.respond_with(out, completion, None);
            }
            admin_opcode::CREATE_SQ
            | admin_opcode::CREATE_CQ
            | admin_opcode::DELETE_SQ
            | admin_opcode::DELETE_CQ => {
                // Fabrics queues come and go with Connect, never with these.
                self.respond(out, cmd.cid(), Status::error(sc::INVALID_OPCODE));
            }
            _ => self.respond(out, cmd.cid(), Status::error(sc::INVALID_OPCODE)),
        }
    }

    /// Sends `len` bytes of `fill`ed data, trimmed or zero-padded to the host's buffer.
    pub(crate) fn respond_with_data(
        &mut self,
        cmd: &Command,
        out: &mut Vec<Action>,
        fill: impl FnOnce(&mut [u8]),
        len: usize,
    ) {
        let mut buf = self.take_buffer(len);
        buf.as_mut_slice().fill(0);
        fill(buf.as_mut_slice());
        buf.resize(cmd.data_len() as usize);
        let completion = self.completion(cmd.cid(), Status::SUCCESS);
        self.respond_with(out, completion, Some(buf));
    }

    fn identify(&mut self, ctrl: &Arc<Controller>, cmd: &Command, out: &mut Vec<Action>) {
        let cns_value = (cmd.cdw(10) & 0xff) as u8;
        let nsid = cmd.nsid();
        let subsystem = ctrl.subsystem.clone();
        let discovery = ctrl.is_discovery();
        let result = match cns_value {
            cns::CTRL => Ok(identify::IdentifyData::Controller),
            _ if discovery => Err(Status::error(sc::INVALID_FIELD)),
            cns::NS | cns::NS_CS_INDEP => {
                if nsid == 0 || nsid == NSID_ALL {
                    Err(Status::error(sc::INVALID_NS))
                } else {
                    // An inactive NSID in range returns zeroes; outside the range is invalid.
                    // A namespace hidden from this host is inactive to it.
                    match subsystem.namespace_for_host(nsid, &ctrl.hostnqn) {
                        Some(ns) if cns_value == cns::NS => {
                            Ok(identify::IdentifyData::Namespace(ns))
                        }
                        Some(ns) => Ok(identify::IdentifyData::NamespaceIndependent(ns)),
                        None if nsid <= subsystem.max_namespaces() => {
                            Ok(identify::IdentifyData::Zeroes)
                        }
                        None => Err(Status::error(sc::INVALID_NS)),
                    }
                }
            }
            cns::NS_ACTIVE_LIST => {
                if nsid >= 0xffff_fffe {
                    Err(Status::error(sc::INVALID_NS))
                } else {
                    Ok(identify::IdentifyData::ActiveNamespaces { after: nsid })
                }
            }
            // The active list of one I/O command set (CSI in CDW11 bits 31:24): every
            // namespace here is NVM, so the NVM list is CNS 02h's; no other set is offered.
            cns::NS_ACTIVE_LIST_CS => {
                if (cmd.cdw(11) >> 24) as u8 != CSI_NVM {
                    Err(Status::error(sc::INVALID_FIELD))
                } else if nsid >= 0xffff_fffe {
                    Err(Status::error(sc::INVALID_NS))
                } else {
                    Ok(identify::IdentifyData::ActiveNamespaces { after: nsid })
                }
            }
            // Inactive NSIDs (hidden ones included) have no descriptors: Invalid Namespace,
            // as Linux nvmet answers.
            cns::NS_DESC_LIST => match subsystem.namespace_for_host(nsid, &ctrl.hostnqn) {
                Some(ns) => Ok(identify::IdentifyData::Descriptors(ns)),
                None => Err(Status::error(sc::INVALID_NS)),
            },
            _ => Err(Status::error(sc::INVALID_FIELD)),
        };
        match result {
            Ok(what) => {
                let ctrl = ctrl.clone();
                self.respond_with_data(
                    cmd,
                    out,
                    |buf| identify::fill(&what, &ctrl, buf),
                    IDENTIFY_DATA_SIZE,
                );
            }
            Err(status) => self.respond(out, cmd.cid(), status),
        }
    }

    fn get_log_page(&mut self, ctrl: &Arc<Controller>, cmd: &Command, out: &mut Vec<Action>) {
        let cdw10 = cmd.cdw(10);
        let lid = (cdw10 & 0xff) as u8;
        let lsp = ((cdw10 >> 8) & 0x7f) as u8;
        let retain_event = cdw10 & (1 << 15) != 0;
        let numd = u64::from(cdw10 >> 16) | (u64::from(cmd.cdw(11) & 0xffff) << 16);
        // NUMD asks for up to 16 GiB; the host gets no more than its buffer (the SGL length,
        // which the transport has bounded by MDTS), so that bounds the buffer built here.
        let len = ((numd + 1) * 4).min(u64::from(cmd.data_len())) as usize;
        let offset = u64::from(cmd.cdw(12)) | (u64::from(cmd.cdw(13)) << 32);
        if offset % 4 != 0 {
            self.respond(out, cmd.cid(), Status::error(sc::INVALID_FIELD));
            return;
        }
        let page = match log_page::build(ctrl, lid, lsp, retain_event, cmd.nsid()) {
            Ok(page) => page,
            Err(status) => {
                self.respond(out, cmd.cid(), status);
                return;
            }
        };
        if offset > page.len() as u64 {
            self.respond(out, cmd.cid(), Status::error(sc::INVALID_FIELD));
            return;
        }
        if !retain_event {
            ctrl.clear_log_page_event(lid);
        }
        let start = offset as usize;
        let take = len.min(page.len() - start);
        self.respond_with_data(
            cmd,
            out,
            |buf| buf[..take].copy_from_slice(&page[start..start + take]),
            len,
        );
    }

    fn set_features(&mut self, ctrl: &Arc<Controller>, cmd: &Command, out: &mut Vec<Action>) {
        let cdw10 = cmd.cdw(10);
        let cdw11 = cmd.cdw(11);
        if cdw10 & FEATURES_SAVE != 0 {
            self.respond(out, cmd.cid(), Status::error(sc::FEATURE_NOT_SAVEABLE));
            return;
        }
        let fid = (cdw10 & 0xff) as u8;
        let discovery = ctrl.is_discovery();
        let mut result = 0u64;
        let status = match fid {
            feat::KATO => {
                ctrl.set_kato_ms(cdw11);
                Status::SUCCESS
            }
            feat::ASYNC_EVENT => {
                let supported = if discovery {
                    aer::CFG_DISC_CHANGE
                } else {
                    aer::CFG_NS_ATTR | aer::CFG_ANA_CHANGE
                };
                ctrl.set_async_event_config(cdw11 & supported);
                Status::SUCCESS
            }
            _ if discovery => Status::error(sc::INVALID_FIELD),
            feat::NUM_QUEUES => {
                let nsqr = (cdw11 & 0xffff) as u16;
                let ncqr = (cdw11 >> 16) as u16;
                if nsqr == 0xffff || ncqr == 0xffff {
                    Status::error(sc::INVALID_FIELD)
                } else {
                    let granted = u64::from(ctrl.grant_io_queues(nsqr.min(ncqr)));
                    result = granted | (granted << 16);
                    Status::SUCCESS
                }
            }
            feat::VOLATILE_WC => {
                ctrl.set_volatile_write_cache(cdw11 & 1 != 0);
                Status::SUCCESS
            }
            feat::HOST_ID => {
                // The host ID arrives with Connect on fabrics and cannot change afterwards.
                Status::error(sc::CMD_SEQ_ERROR)
            }
            feat::RESV_MASK if ctrl.target.reservations_enabled() => {
                ctrl.set_reservation_notice_mask(cdw11);
                Status::SUCCESS
            }
            feat::POWER_MGMT if cdw11 & 0x1f != 0 => {
                // Only power state 0 exists (NPSS = 0).
                Status::error(sc::INVALID_FIELD)
            }
            feat::ARBITRATION
            | feat::POWER_MGMT
            | feat::TEMP_THRESH
            | feat::ERR_RECOVERY
            | feat::IRQ_COALESCE
            | feat::IRQ_CONFIG
            | feat::WRITE_ATOMIC => {
                ctrl.store_feature(fid, cdw11);
                Status::SUCCESS
            }
            _ => Status::error(sc::INVALID_FIELD),
        };
        let completion = self.completion(cmd.cid(), status).with_result(result);
        self.respond_with(out, completion, None);
    }

    fn get_features(&mut self, ctrl: &Arc<Controller>, cmd: &Command, out: &mut Vec<Action>) {
        let cdw10 = cmd.cdw(10);
        let fid = (cdw10 & 0xff) as u8;
        let select = (cdw10 >> GET_FEATURES_SEL_SHIFT) & 0x7;
        let discovery = ctrl.is_discovery();
        let known = matches!(fid, feat::KATO | feat::ASYNC_EVENT)
            || (!discovery
                && matches!(
                    fid,
                    feat::NUM_QUEUES
                        | feat::VOLATILE_WC
                        | feat::HOST_ID
                        | feat::ARBITRATION
                        | feat::POWER_MGMT
                        | feat::TEMP_THRESH
                        | feat::ERR_RECOVERY
                        | feat::IRQ_COALESCE
                        | feat::IRQ_CONFIG
                        | feat::WRITE_ATOMIC
                ))
            || (!discovery && fid == feat::RESV_MASK && ctrl.target.reservations_enabled());
        if !known {
            self.respond(out, cmd.cid(), Status::error(sc::INVALID_FIELD));
            return;
        }
        if select == SEL_SUPPORTED_CAPABILITIES {
            let completion = self
                .completion(cmd.cid(), Status::SUCCESS)
                .with_result(FEATURE_CAPABILITY_CHANGEABLE);
            self.respond_with(out, completion, None);
            return;
        }
        let value: u64 = match fid {
            feat::KATO => u64::from(ctrl.kato_ms()),
            feat::ASYNC_EVENT => u64::from(ctrl.async_event_config()),
            feat::NUM_QUEUES => {
                let n = u64::from(ctrl.io_queues_granted().max(1) - 1);
                n | (n << 16)
            }
            feat::VOLATILE_WC => u64::from(ctrl.volatile_write_cache()),
            feat::RESV_MASK => u64::from(ctrl.reservation_notice_mask()),
            feat::TEMP_THRESH => match ctrl.stored_feature(fid) {
                // Default over-temperature threshold: the warning temperature.
                0 => u64::from(identify::WARNING_TEMPERATURE_KELVIN),
                v => u64::from(v),
            },
            feat::HOST_ID => {
                // Only the 128-bit host identifier exists on fabrics (EXHID must be set).
                if cmd.cdw(11) & 1 == 0 {
                    self.respond(out, cmd.cid(), Status::error(sc::INVALID_FIELD));
                    return;
                }
                let hostid = ctrl.hostid;
                self.respond_with_data(cmd, out, |buf| buf[..16].copy_from_slice(&hostid), 16);
                return;
            }
            other => u64::from(ctrl.stored_feature(other)),
        };
        let completion = self
            .completion(cmd.cid(), Status::SUCCESS)
            .with_result(value);
        self.respond_with(out, completion, None);
    }
}
