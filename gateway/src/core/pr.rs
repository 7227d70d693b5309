//! Reservations (NVMe Base 2.0 section 8.19), with the semantics Linux nvmet gives them
//! (`drivers/nvme/target/pr.c`): Reservation Register, Acquire, Release and Report, the
//! access each reservation type leaves to holders, registrants and others, and the
//! notices (Reservation Notification log page, asynchronous event) other hosts get.
//!
//! A registrant is a host, named by the 128-bit host identifier it gave at Connect: every
//! controller of the host (one per path) shares its registration, as in nvmet and SPDK.
//! State is kept per namespace in the subsystem. A standalone gateway keeps it in memory:
//! it survives a host's disconnect, not a gateway restart (Identify reports no
//! persist-through-power-loss). A gateway of a group ([`Target::reservations_persisted`])
//! runs reservation commands only on the optimized path (the ANA owner of the namespace);
//! each change is computed on a copy, stored with the namespace's device
//! ([`IoOp::StoreRecord`], [`ReservationState::encode`]) and only then made the state and
//! completed, so a store that fails leaves the state as it was and fails the command. One
//! change per namespace is stored at a time; the others wait for it (parked on their queue,
//! woken when it completes). The next owner loads the record ([`Reservations::load`])
//! before its path turns optimized.
//!
//! [`Target::reservations_persisted`]: super::target::Target::reservations_persisted
//!
//! Where nvmet and the spec differ, the spec wins: a Release whose type does not match the
//! reservation gets Invalid Field, and under the all-registrants types every registrant is
//! a holder (an Acquire of the same type by any of them succeeds). Preempt and Abort
//! preempts like Preempt, then completes only after a Flush of the namespace's device that
//! is submitted once the change is in effect: the preempted hosts' later commands get
//! Reservation Conflict, and the ones already at the device (librbd's flush waits for every
//! op started before it) have finished by the completion, as nvmet waits for them.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use std::sync::{Arc, Weak};

use rbd_backend::{IoBuf, IoError, IoOp};

use super::command::{Command, Status};
use super::controller::{Controller, QueueNotifier};
use super::queue::{Action, InFlight, Queue};
use super::subsystem::{Namespace, Subsystem};
use super::wire::{put_u16, put_u32, put_u64};
use crate::spec::{ana, io_opcode, pr, sc};

/// The key a namespace's reservation state is stored under with its device.
pub const RECORD_KEY: &str = "nvme_reservation";
/// Version of the stored record's layout ([`ReservationState::encode`]).
const RECORD_VERSION: u8 = 1;
/// Stored record: version, generation, type (0: none), holder's host ID, registrant count.
const RECORD_HEADER_LEN: usize = 1 + 4 + 1 + 16 + 2;
/// Stored registrant: host ID and key.
const RECORD_ENTRY_LEN: usize = 16 + 8;

/// Why a stored reservation record cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("reservation record of {len} bytes is too short")]
    Truncated { len: usize },
    #[error("reservation record version {0} is not known to this gateway")]
    Version(u8),
    #[error("reservation record names reservation type {0}")]
    Type(u8),
}

/// A host's 128-bit identifier (Connect data HOSTID).
pub type HostId = [u8; 16];

/// Bytes of the Reservation Status header and of each registrant entry in the extended
/// data structure (`struct nvme_reservation_status_ext`, `nvme_registered_ctrl_ext`).
const REPORT_HEADER_LEN: usize = 64;
const REPORT_ENTRY_LEN: usize = 64;
/// Controller ID reported for a registrant: the host's controllers are dynamic (FFFFh).
const DYNAMIC_CNTLID: u16 = 0xffff;
/// Notices a controller keeps for its host to read; older ones go first (the log page
/// count then skips, which tells the host some were lost).
pub const MAX_NOTICES: usize = 64;

/// What a command does to reservations, and whether it is refused by one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registrant {
    pub host: HostId,
    pub key: u64,
}

/// One namespace's reservation state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReservationState {
    /// Bumped by every Register and Preempt that succeeds, and by Clear.
    pub generation: u32,
    /// In registration order: an all-registrants reservation passes to the first one left.
    pub registrants: Vec<Registrant>,
    /// The holder, and the reservation type (1..=6); under the all-registrants types every
    /// registrant holds the reservation and this names one of them.
    pub holder: Option<(HostId, u8)>,
}

/// A notice for a host's controllers (Reservation Notification log entry type).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Notice {
    pub host: HostId,
    pub kind: u8,
}

fn conflict() -> Status {
    Status::error(sc::RESERVATION_CONFLICT)
}

fn invalid_field() -> Status {
    Status::error(sc::INVALID_FIELD)
}

fn all_registrants(rtype: u8) -> bool {
    matches!(
        rtype,
        pr::WRITE_EXCLUSIVE_ALL_REGS | pr::EXCLUSIVE_ACCESS_ALL_REGS
    )
}

impl ReservationState {
    fn registrant(&self, host: &HostId) -> Option<&Registrant> {
        self.registrants.iter().find(|r| &r.host == host)
    }

    /// Whether `host` holds the reservation (any registrant does under types 5 and 6).
    pub fn is_holder(&self, host: &HostId) -> bool {
        match self.holder {
            Some((_, rtype)) if all_registrants(rtype) => self.registrant(host).is_some(),
            Some((holder, _)) => &holder == host,
            None => false,
        }
    }

    fn is_empty(&self) -> bool {
        self.registrants.is_empty() && self.holder.is_none()
    }

    /// The record stored with the namespace's device (little endian): version, generation,
    /// type (0: none), the holder's host ID (zero without one), the registrant count, then
    /// each registrant's host ID and key in registration order.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0u8; RECORD_HEADER_LEN + RECORD_ENTRY_LEN * self.registrants.len()];
        out[0] = RECORD_VERSION;
        put_u32(&mut out, 1, self.generation);
        if let Some((host, rtype)) = self.holder {
            out[5] = rtype;
            out[6..22].copy_from_slice(&host);
        }
        put_u16(&mut out, 22, self.registrants.len() as u16);
        for (i, r) in self.registrants.iter().enumerate() {
            let at = RECORD_HEADER_LEN + i * RECORD_ENTRY_LEN;
            out[at..at + 16].copy_from_slice(&r.host);
            put_u64(&mut out, at + 16, r.key);
        }
        out
    }

    /// Reads a record [`Self::encode`] wrote.
    pub fn decode(record: &[u8]) -> Result<Self, RecordError> {
        let truncated = RecordError::Truncated { len: record.len() };
        if record.len() < RECORD_HEADER_LEN {
            return Err(truncated);
        }
        if record[0] != RECORD_VERSION {
            return Err(RecordError::Version(record[0]));
        }
        let u32_at = |at: usize| {
            u32::from_le_bytes([record[at], record[at + 1], record[at + 2], record[at + 3]])
        };
        let host_at = |at: usize| {
            let mut host = [0u8; 16];
            host.copy_from_slice(&record[at..at + 16]);
            host
        };
        let count = usize::from(u16::from_le_bytes([record[22], record[23]]));
        if record.len() != RECORD_HEADER_LEN + count * RECORD_ENTRY_LEN {
            return Err(truncated);
        }
        let registrants = (0..count)
            .map(|i| {
                let at = RECORD_HEADER_LEN + i * RECORD_ENTRY_LEN;
                let mut key = [0u8; 8];
                key.copy_from_slice(&record[at + 16..at + 24]);
                Registrant {
                    host: host_at(at),
                    key: u64::from_le_bytes(key),
                }
            })
            .collect();
        let holder = match record[5] {
            0 => None,
            rtype @ pr::WRITE_EXCLUSIVE..=pr::EXCLUSIVE_ACCESS_ALL_REGS => {
                Some((host_at(6), rtype))
            }
            other => return Err(RecordError::Type(other)),
        };
        Ok(Self {
            generation: u32_at(1),
            registrants,
            holder,
        })
    }

    /// The registrant `host`, if `key` is its key (or `ignore_key`).
    fn check_key(&self, host: &HostId, key: u64, ignore_key: bool) -> Result<(), Status> {
        match self.registrant(host) {
            Some(r) if ignore_key || r.key == key => Ok(()),
            _ => Err(conflict()),
        }
    }

    /// Whether a command of `access` from `host` may run (nvmet's
    /// `nvmet_pr_check_cmd_access`).
    pub fn allows(&self, host: &HostId, access: Access) -> bool {
        let Some((_, rtype)) = self.holder else {
            return true;
        };
        if self.is_holder(host) {
            return true;
        }
        let registered = self.registrant(host).is_some();
        match (rtype, access) {
            (pr::WRITE_EXCLUSIVE, Access::Read) => true,
            (pr::WRITE_EXCLUSIVE | pr::EXCLUSIVE_ACCESS, _) => false,
            (pr::WRITE_EXCLUSIVE_REG_ONLY | pr::WRITE_EXCLUSIVE_ALL_REGS, Access::Read) => true,
            (pr::WRITE_EXCLUSIVE_REG_ONLY | pr::WRITE_EXCLUSIVE_ALL_REGS, Access::Write) => {
                registered
            }
            (pr::EXCLUSIVE_ACCESS_REG_ONLY | pr::EXCLUSIVE_ACCESS_ALL_REGS, _) => registered,
            _ => false,
        }
    }

    /// Notices of "reservation released" to every registrant but `except`.
    fn released(&self, except: &HostId, notices: &mut Vec<Notice>) {
        for r in self.registrants.iter().filter(|r| &r.host != except) {
            notices.push(Notice {
                host: r.host,
                kind: pr::LOG_RESERVATION_RELEASED,
            });
        }
    }

    /// Removes `host`'s registration and what it held (nvmet's `nvmet_pr_unregister_one`).
    fn unregister(&mut self, host: &HostId, notices: &mut Vec<Notice>) {
        self.registrants.retain(|r| &r.host != host);
        let Some((holder, rtype)) = self.holder else {
            return;
        };
        if all_registrants(rtype) {
            // Held by all: it stays while any registrant is left.
            self.holder = self.registrants.first().map(|r| (r.host, rtype));
        } else if &holder == host {
            self.holder = None;
            if matches!(
                rtype,
                pr::WRITE_EXCLUSIVE_REG_ONLY | pr::EXCLUSIVE_ACCESS_REG_ONLY
            ) {
                self.released(host, notices);
            }
        }
    }

    /// Unregisters every host whose key is `key` (all but `issuer` when `others_only`),
    /// each but the issuer told "registration preempted"; Err if none had the key.
    fn preempt_by_key(
        &mut self,
        key: u64,
        issuer: &HostId,
        others_only: bool,
        notices: &mut Vec<Notice>,
    ) -> Result<(), Status> {
        let preempted: Vec<HostId> = self
            .registrants
            .iter()
            .filter(|r| r.key == key && !(others_only && &r.host == issuer))
            .map(|r| r.host)
            .collect();
        if preempted.is_empty() {
            return Err(conflict());
        }
        for host in preempted {
            self.unregister(&host, notices);
            if &host != issuer {
                notices.push(Notice {
                    host,
                    kind: pr::LOG_REGISTRATION_PREEMPTED,
                });
            }
        }
        Ok(())
    }

    /// Reservation Register (`cdw10`: RREGA, IEKEY; CPTPL is ignored: nothing persists).
    pub fn register(
        &mut self,
        host: &HostId,
        cdw10: u32,
        current_key: u64,
        new_key: u64,
    ) -> Result<Vec<Notice>, Status> {
        let ignore_key = cdw10 & pr::IGNORE_KEY != 0;
        let mut notices = Vec::new();
        match cdw10 & pr::ACTION_MASK {
            pr::REGISTER_ACT_REG => {
                if let Some(r) = self.registrant(host) {
                    // Registering again with the same key changes nothing.
                    return if r.key == new_key {
                        Ok(notices)
                    } else {
                        Err(conflict())
                    };
                }
                self.registrants.push(Registrant {
                    host: *host,
                    key: new_key,
                });
            }
            pr::REGISTER_ACT_UNREG => {
                self.check_key(host, current_key, ignore_key)?;
                self.unregister(host, &mut notices);
            }
            pr::REGISTER_ACT_REPLACE => {
                self.check_key(host, current_key, ignore_key)?;
                if let Some(r) = self.registrants.iter_mut().find(|r| &r.host == host) {
                    r.key = new_key;
                }
            }
            _ => return Err(invalid_field()),
        }
        self.generation = self.generation.wrapping_add(1);
        Ok(notices)
    }

    /// Reservation Acquire (`cdw10`: RACQA, IEKEY, RTYPE).
    pub fn acquire(
        &mut self,
        host: &HostId,
        cdw10: u32,
        current_key: u64,
        preempt_key: u64,
    ) -> Result<Vec<Notice>, Status> {
        let rtype = ((cdw10 >> pr::RTYPE_SHIFT) & 0xff) as u8;
        if cdw10 & pr::IGNORE_KEY != 0
            || !(pr::WRITE_EXCLUSIVE..=pr::EXCLUSIVE_ACCESS_ALL_REGS).contains(&rtype)
        {
            return Err(invalid_field());
        }
        self.check_key(host, current_key, false)?;
        let mut notices = Vec::new();
        match cdw10 & pr::ACTION_MASK {
            pr::ACQUIRE_ACT_ACQUIRE => match self.holder {
                None => self.holder = Some((*host, rtype)),
                Some((_, held)) if self.is_holder(host) && held == rtype => {}
                Some(_) => return Err(conflict()),
            },
            pr::ACQUIRE_ACT_PREEMPT | pr::ACQUIRE_ACT_PREEMPT_AND_ABORT => {
                self.preempt(host, rtype, preempt_key, &mut notices)?;
                self.generation = self.generation.wrapping_add(1);
            }
            _ => return Err(invalid_field()),
        }
        Ok(notices)
    }

    /// Preempt, as nvmet's `nvmet_pr_preempt`: the new holder is set before anyone is
    /// unregistered, so the namespace is never left unprotected in between.
    fn preempt(
        &mut self,
        host: &HostId,
        rtype: u8,
        preempt_key: u64,
        notices: &mut Vec<Notice>,
    ) -> Result<(), Status> {
        let Some((holder, held)) = self.holder else {
            return self.preempt_by_key(preempt_key, host, false, notices);
        };
        if all_registrants(held) {
            if preempt_key != 0 {
                return self.preempt_by_key(preempt_key, host, false, notices);
            }
            self.holder = Some((*host, rtype));
            let others: Vec<HostId> = self
                .registrants
                .iter()
                .filter(|r| &r.host != host)
                .map(|r| r.host)
                .collect();
            for other in others {
                self.unregister(&other, notices);
                notices.push(Notice {
                    host: other,
                    kind: pr::LOG_REGISTRATION_PREEMPTED,
                });
            }
            return Ok(());
        }
        if &holder == host {
            self.holder = Some((*host, rtype));
            if held != rtype {
                self.released(host, notices);
            }
            return Ok(());
        }
        let holder_key = self.registrant(&holder).map(|r| r.key);
        if Some(preempt_key) == holder_key {
            self.holder = Some((*host, rtype));
            self.preempt_by_key(preempt_key, host, true, notices)?;
            if held != rtype {
                self.released(host, notices);
            }
            return Ok(());
        }
        if preempt_key != 0 {
            return self.preempt_by_key(preempt_key, host, false, notices);
        }
        Err(invalid_field())
    }

    /// Reservation Release (`cdw10`: RRELA, IEKEY, RTYPE).
    pub fn release(
        &mut self,
        host: &HostId,
        cdw10: u32,
        current_key: u64,
    ) -> Result<Vec<Notice>, Status> {
        if cdw10 & pr::IGNORE_KEY != 0 {
            return Err(invalid_field());
        }
        self.check_key(host, current_key, false)?;
        let rtype = ((cdw10 >> pr::RTYPE_SHIFT) & 0xff) as u8;
        let mut notices = Vec::new();
        match cdw10 & pr::ACTION_MASK {
            pr::RELEASE_ACT_RELEASE => {
                let Some((_, held)) = self.holder else {
                    return Ok(notices);
                };
                if !self.is_holder(host) {
                    return Ok(notices);
                }
                if held != rtype {
                    return Err(invalid_field());
                }
                self.holder = None;
                if !matches!(held, pr::WRITE_EXCLUSIVE | pr::EXCLUSIVE_ACCESS) {
                    self.released(host, &mut notices);
                }
            }
            pr::RELEASE_ACT_CLEAR => {
                for r in self.registrants.iter().filter(|r| &r.host != host) {
                    notices.push(Notice {
                        host: r.host,
                        kind: pr::LOG_RESERVATION_PREEMPTED,
                    });
                }
                self.registrants.clear();
                self.holder = None;
                self.generation = self.generation.wrapping_add(1);
            }
            _ => return Err(invalid_field()),
        }
        Ok(notices)
    }

    /// The Reservation Status extended data structure (EDS = 1), whole.
    pub fn report(&self) -> Vec<u8> {
        let mut out = vec![0u8; REPORT_HEADER_LEN + REPORT_ENTRY_LEN * self.registrants.len()];
        put_u32(&mut out, 0, self.generation);
        out[4] = self.holder.map_or(0, |(_, rtype)| rtype);
        put_u16(&mut out, 5, self.registrants.len() as u16);
        // PTPLS (byte 9) stays 0: nothing persists through power loss.
        for (i, r) in self.registrants.iter().enumerate() {
            let at = REPORT_HEADER_LEN + i * REPORT_ENTRY_LEN;
            put_u16(&mut out, at, DYNAMIC_CNTLID);
            out[at + 2] = u8::from(self.is_holder(&r.host));
            put_u64(&mut out, at + 8, r.key);
            out[at + 16..at + 32].copy_from_slice(&r.host);
        }
        out
    }
}

/// The reservation state of every namespace of a subsystem.
#[derive(Default)]
pub struct Reservations {
    table: Mutex<Table>,
    /// Namespaces with any registration: while 0, I/O skips the lock.
    active: AtomicUsize,
}

impl std::fmt::Debug for Reservations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservations").finish_non_exhaustive()
    }
}

#[derive(Default)]
struct Table {
    states: BTreeMap<u32, ReservationState>,
    /// Namespaces with a change being stored: the next change of each waits for it, since it
    /// is computed from the state that one leaves.
    storing: BTreeSet<u32>,
    /// Queues with a change parked behind one being stored, woken when a store finishes.
    waiters: Vec<Weak<dyn QueueNotifier>>,
}

impl Table {
    fn set_active(&self, active: &AtomicUsize) {
        let n = self.states.values().filter(|s| !s.is_empty()).count();
        active.store(n, Ordering::Release);
    }
}

/// What [`Reservations::begin_change`] decided.
#[derive(Debug, PartialEq, Eq)]
pub enum Begin {
    /// Another change of the namespace is being stored: wait for it.
    Busy,
    /// The change is refused; nothing changed.
    Refused(Status),
    /// The change leaves the state as it is (an Acquire of what the host holds): complete
    /// it now, nothing to store.
    Unchanged,
    /// Store this state; the namespace is marked as storing until
    /// [`Reservations::finish_change`].
    Store(ReservationState, Vec<Notice>),
}

impl Reservations {
    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reservation Conflict if a reservation on `nsid` refuses `access` to `host`.
    pub fn check(&self, nsid: u32, host: &HostId, access: Access) -> Result<(), Status> {
        if self.active.load(Ordering::Acquire) == 0 {
            return Ok(());
        }
        match self.lock().states.get(&nsid) {
            Some(state) if !state.allows(host, access) => Err(conflict()),
            _ => Ok(()),
        }
    }

    /// Runs `change` on `nsid`'s state; the state is dropped once nothing is left in it.
    pub fn update<T>(&self, nsid: u32, change: impl FnOnce(&mut ReservationState) -> T) -> T {
        let mut table = self.lock();
        let state = table.states.entry(nsid).or_default();
        let out = change(state);
        if state.is_empty() && state.generation == 0 {
            table.states.remove(&nsid);
        }
        table.set_active(&self.active);
        out
    }

    /// A persisted change, first half: runs `change` on a copy of `nsid`'s state. `Busy`
    /// (and `waiter` is woken when the store in progress finishes) while another change of
    /// `nsid` is being stored.
    pub fn begin_change(
        &self,
        nsid: u32,
        waiter: &Weak<dyn QueueNotifier>,
        change: impl FnOnce(&mut ReservationState) -> Result<Vec<Notice>, Status>,
    ) -> Begin {
        let mut table = self.lock();
        if table.storing.contains(&nsid) {
            table.waiters.push(waiter.clone());
            return Begin::Busy;
        }
        let current = table.states.get(&nsid).cloned().unwrap_or_default();
        let mut next = current.clone();
        match change(&mut next) {
            Err(status) => Begin::Refused(status),
            Ok(_) if next == current => Begin::Unchanged,
            Ok(notices) => {
                table.storing.insert(nsid);
                Begin::Store(next, notices)
            }
        }
    }

    /// A persisted change, second half: the store finished; `stored` is the state it stored
    /// (None: it failed, the state stays as it was). Wakes the queues waiting to change.
    pub fn finish_change(&self, nsid: u32, stored: Option<ReservationState>) {
        let waiters = {
            let mut table = self.lock();
            if let Some(state) = stored {
                table.states.insert(nsid, state);
            }
            table.storing.remove(&nsid);
            table.set_active(&self.active);
            std::mem::take(&mut table.waiters)
        };
        for waiter in waiters.iter().filter_map(Weak::upgrade) {
            waiter.wake();
        }
    }

    /// Replaces `nsid`'s state with one loaded from its device (this gateway is about to
    /// serve the namespace as its ANA owner).
    pub fn load(&self, nsid: u32, state: ReservationState) {
        let mut table = self.lock();
        if state == ReservationState::default() {
            table.states.remove(&nsid);
        } else {
            table.states.insert(nsid, state);
        }
        table.set_active(&self.active);
    }

    /// A copy of `nsid`'s state (empty if none).
    pub fn state(&self, nsid: u32) -> ReservationState {
        self.lock().states.get(&nsid).cloned().unwrap_or_default()
    }

    /// The namespace is gone: so are its reservations.
    pub fn forget(&self, nsid: u32) {
        self.update(nsid, |state| *state = ReservationState::default());
    }
}

/// A reservation change being stored: the namespace stays marked as storing until the
/// change is finished, or this is dropped unfinished (the queue went away), which leaves
/// the state as it was.
#[derive(Debug)]
pub(crate) struct StoringChange {
    subsystem: Arc<Subsystem>,
    nsid: u32,
    state: Option<ReservationState>,
    notices: Vec<Notice>,
    /// A Preempt and Abort: once stored, it completes after a barrier
    /// ([`Queue::preempt_barrier`]).
    abort_barrier: bool,
}

/// Whether a reservation command is an Acquire with the Preempt and Abort action.
fn is_preempt_and_abort(opcode: u8, cdw10: u32) -> bool {
    opcode == io_opcode::RESV_ACQUIRE
        && cdw10 & pr::ACTION_MASK == pr::ACQUIRE_ACT_PREEMPT_AND_ABORT
}

impl StoringChange {
    /// The store completed with `result`: the state is made the namespace's (and the notices
    /// sent) only if it succeeded.
    fn finish(mut self, result: &Result<(), IoError>) {
        let state = self.state.take();
        match result {
            Ok(()) => {
                self.subsystem.reservations.finish_change(self.nsid, state);
                self.subsystem
                    .notify_reservation(self.nsid, &std::mem::take(&mut self.notices));
            }
            Err(e) => {
                tracing::warn!(
                    nsid = self.nsid,
                    subsystem = %self.subsystem.nqn(),
                    error = %e,
                    "reservation change not stored: the command fails, the state stays"
                );
                self.subsystem.reservations.finish_change(self.nsid, None);
            }
        }
    }
}

impl Drop for StoringChange {
    fn drop(&mut self) {
        if self.state.is_some() {
            self.subsystem.reservations.finish_change(self.nsid, None);
        }
    }
}

/// A reservation change a queue holds until its namespace's store in progress finishes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ParkedChange {
    cid: u16,
    nsid: u32,
    opcode: u8,
    cdw10: u32,
    keys: (u64, u64),
}

impl ParkedChange {
    fn apply(&self, host: &HostId, state: &mut ReservationState) -> Result<Vec<Notice>, Status> {
        let (cdw10, keys) = (self.cdw10, self.keys);
        match self.opcode {
            io_opcode::RESV_REGISTER => state.register(host, cdw10, keys.0, keys.1),
            io_opcode::RESV_ACQUIRE => state.acquire(host, cdw10, keys.0, keys.1),
            _ => state.release(host, cdw10, keys.0),
        }
    }
}

/// One entry of a controller's Reservation Notification log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogEntry {
    /// The Log Page Count: this controller's notices numbered from 1.
    pub count: u64,
    pub kind: u8,
    pub nsid: u32,
}

/// A controller's notices not read yet.
#[derive(Debug, Default)]
pub struct NoticeLog {
    entries: VecDeque<LogEntry>,
    next_count: u64,
}

impl NoticeLog {
    pub fn push(&mut self, kind: u8, nsid: u32) {
        self.next_count = self.next_count.wrapping_add(1).max(1);
        if self.entries.len() == MAX_NOTICES {
            self.entries.pop_front();
        }
        self.entries.push_back(LogEntry {
            count: self.next_count,
            kind,
            nsid,
        });
    }

    /// The 64-byte log page: the oldest notice (taken out unless `retain`), with the
    /// number of those left; an empty entry when there is none.
    pub fn page(&mut self, retain: bool) -> Vec<u8> {
        let mut page = vec![0u8; 64];
        let entry = if retain {
            self.entries.front().copied()
        } else {
            self.entries.pop_front()
        };
        if let Some(e) = entry {
            put_u64(&mut page, 0, e.count);
            page[8] = e.kind;
            let left = self.entries.len() - usize::from(retain);
            page[9] = left.min(255) as u8;
            put_u32(&mut page, 12, e.nsid);
        }
        page
    }
}

impl Queue {
    /// Reservation Register, Acquire, Release and Report (see `core::pr`): the change is
    /// made under the subsystem's reservation lock, then the hosts it concerns are told.
    pub(crate) fn execute_reservation(
        &mut self,
        ctrl: &Arc<Controller>,
        ns: &Namespace,
        cmd: &Command,
        data: Option<IoBuf>,
        out: &mut Vec<Action>,
    ) {
        let cid = cmd.cid();
        let host = ctrl.hostid;
        let reservations = &ctrl.subsystem.reservations;
        if self.target.reservations_persisted()
            && ctrl.subsystem.ana_state(ns.ana_group) != ana::OPTIMIZED
        {
            // Only the ANA owner has the state; any other path sends the host to it.
            if let Some(buf) = data {
                self.recycle(buf);
            }
            return self.respond(out, cid, Status::retryable(sc::ANA_INACCESSIBLE));
        }
        if cmd.opcode() == io_opcode::RESV_REPORT {
            if let Some(buf) = data {
                self.recycle(buf);
            }
            if cmd.cdw(11) & pr::EXTENDED_DATA_STRUCT == 0 {
                // Host IDs are 128-bit on fabrics: the 64-bit structure cannot hold them.
                return self.respond(out, cid, Status::error(sc::HOST_ID_INCONSIST));
            }
            let report = reservations.state(ns.nsid).report();
            let len = ((u64::from(cmd.cdw(10)) + 1) * 4).min(u64::from(cmd.data_len())) as usize;
            let take = len.min(report.len());
            self.respond_with_data(
                cmd,
                out,
                |buf| buf[..take].copy_from_slice(&report[..take]),
                len,
            );
            return;
        }
        // Register and Acquire carry two keys (16 bytes), Release one (8).
        let needed = if cmd.opcode() == io_opcode::RESV_RELEASE {
            8
        } else {
            16
        };
        let keys = match data {
            Some(buf) if buf.len() >= needed => {
                let d = buf.as_slice();
                let key = |at: usize| {
                    u64::from_le_bytes([
                        d[at],
                        d[at + 1],
                        d[at + 2],
                        d[at + 3],
                        d[at + 4],
                        d[at + 5],
                        d[at + 6],
                        d[at + 7],
                    ])
                };
                let keys = (key(0), if needed == 16 { key(8) } else { 0 });
                self.recycle(buf);
                keys
            }
            other => return self.fail(out, cid, Status::error(sc::SGL_INVALID_DATA), other),
        };
        let cdw10 = cmd.cdw(10);
        if self.target.reservations_persisted() {
            let change = ParkedChange {
                cid,
                nsid: ns.nsid,
                opcode: cmd.opcode(),
                cdw10,
                keys,
            };
            return self.change_persisted(ctrl, ns, change, out);
        }
        let result = reservations.update(ns.nsid, |state| match cmd.opcode() {
            io_opcode::RESV_REGISTER => state.register(&host, cdw10, keys.0, keys.1),
            io_opcode::RESV_ACQUIRE => state.acquire(&host, cdw10, keys.0, keys.1),
            _ => state.release(&host, cdw10, keys.0),
        });
        match result {
            Ok(notices) => {
                ctrl.subsystem.notify_reservation(ns.nsid, &notices);
                if is_preempt_and_abort(cmd.opcode(), cdw10) {
                    return self.preempt_barrier(cid, ns.device.clone(), out);
                }
                self.respond(out, cid, Status::SUCCESS);
            }
            Err(status) => self.respond(out, cid, status),
        }
    }
}

impl Queue {
    /// A reservation change on a gateway of a group: computed on a copy, stored with the
    /// namespace's device, made the state and completed when the store completes
    /// ([`Self::finish_reservation_store`]); parked while another change of the namespace
    /// is being stored.
    fn change_persisted(
        &mut self,
        ctrl: &Arc<Controller>,
        ns: &Namespace,
        change: ParkedChange,
        out: &mut Vec<Action>,
    ) {
        let host = ctrl.hostid;
        let reservations = &ctrl.subsystem.reservations;
        match reservations.begin_change(ns.nsid, &self.notifier, |state| change.apply(&host, state))
        {
            Begin::Busy => {
                // Holds the CID (a reuse meanwhile is a conflict) until it is retried.
                self.inflight
                    .insert(change.cid, InFlight::ReservationParked);
                self.parked_reservations.push(change);
            }
            Begin::Refused(status) => self.respond(out, change.cid, status),
            Begin::Unchanged => self.respond(out, change.cid, Status::SUCCESS),
            Begin::Store(state, notices) => {
                let value = state.encode();
                self.inflight.insert(
                    change.cid,
                    InFlight::ReservationStore(Box::new(StoringChange {
                        subsystem: ctrl.subsystem.clone(),
                        nsid: ns.nsid,
                        state: Some(state),
                        notices,
                        abort_barrier: is_preempt_and_abort(change.opcode, change.cdw10),
                    })),
                );
                out.push(Action::Submit {
                    device: ns.device.clone(),
                    tag: u64::from(change.cid),
                    op: IoOp::StoreRecord {
                        key: RECORD_KEY.to_string(),
                        value,
                    },
                });
            }
        }
    }

    /// The store of a reservation change completed: the change takes effect and the
    /// command succeeds only if it was stored; otherwise it fails and the state is
    /// unchanged: a fenced client gets ANA Inaccessible (the host retries on the path of the
    /// new owner, which loaded the state), any other failure a retryable Internal Error.
    pub(crate) fn finish_reservation_store(
        &mut self,
        cid: u16,
        change: StoringChange,
        result: &Result<(), IoError>,
        out: &mut Vec<Action>,
    ) {
        let barrier = result.is_ok() && change.abort_barrier;
        let device = change
            .subsystem
            .namespace(change.nsid)
            .map(|ns| ns.device.clone());
        change.finish(result);
        if let (true, Some(device)) = (barrier, device) {
            return self.preempt_barrier(cid, device, out);
        }
        let status = match result {
            Ok(()) => Status::SUCCESS,
            Err(IoError::Fenced(_)) => Status::retryable(sc::ANA_INACCESSIBLE),
            Err(_) => Status::retryable(sc::INTERNAL),
        };
        self.respond(out, cid, status);
    }

    /// Preempt and Abort, once the preemption is in effect: a Flush of the device, after
    /// which the command completes (with the Flush's status), so the commands of the
    /// preempted hosts already at the device have finished by then.
    fn preempt_barrier(
        &mut self,
        cid: u16,
        device: Arc<dyn rbd_backend::BlockDevice>,
        out: &mut Vec<Action>,
    ) {
        self.inflight.insert(cid, InFlight::Flush);
        out.push(Action::Submit {
            device,
            tag: u64::from(cid),
            op: IoOp::Flush,
        });
    }

    /// Retries the reservation changes parked behind another change's store (the queue was
    /// woken: a store finished).
    pub(crate) fn retry_parked_reservations(&mut self, out: &mut Vec<Action>) {
        if self.parked_reservations.is_empty() {
            return;
        }
        let Some(ctrl) = self.controller().cloned() else {
            return;
        };
        for change in std::mem::take(&mut self.parked_reservations) {
            self.inflight.remove(&change.cid);
            let Some(ns) = ctrl.subsystem.namespace(change.nsid) else {
                self.respond(out, change.cid, Status::error(sc::INVALID_NS));
                continue;
            };
            if ctrl.subsystem.ana_state(ns.ana_group) != ana::OPTIMIZED {
                self.respond(out, change.cid, Status::retryable(sc::ANA_INACCESSIBLE));
                continue;
            }
            self.change_persisted(&ctrl, &ns, change, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: HostId = [0xa; 16];
    const B: HostId = [0xb; 16];
    const C: HostId = [0xc; 16];

    fn act(action: u32, rtype: u8) -> u32 {
        action | (u32::from(rtype) << pr::RTYPE_SHIFT)
    }

    fn registered(hosts: &[(HostId, u64)]) -> ReservationState {
        let mut s = ReservationState::default();
        for (h, k) in hosts {
            s.register(h, pr::REGISTER_ACT_REG, 0, *k)
                .expect("register");
        }
        s
    }

    #[test]
    fn registration_needs_the_right_key_and_bumps_the_generation() {
        let mut s = registered(&[(A, 1)]);
        assert_eq!(s.generation, 1);
        // Same key again: nothing changes; another key: conflict.
        assert_eq!(s.register(&A, pr::REGISTER_ACT_REG, 0, 1), Ok(vec![]));
        assert_eq!(s.register(&A, pr::REGISTER_ACT_REG, 0, 2), Err(conflict()));
        assert_eq!(s.generation, 1);
        assert_eq!(
            s.register(&A, pr::REGISTER_ACT_REPLACE, 9, 2),
            Err(conflict())
        );
        s.register(&A, pr::REGISTER_ACT_REPLACE, 1, 2)
            .expect("replace");
        s.register(&A, pr::REGISTER_ACT_REPLACE | pr::IGNORE_KEY, 7, 3)
            .expect("replace ignoring the key");
        assert_eq!(s.registrant(&A).map(|r| r.key), Some(3));
        assert_eq!(
            s.register(&B, pr::REGISTER_ACT_UNREG, 3, 0),
            Err(conflict())
        );
        s.register(&A, pr::REGISTER_ACT_UNREG, 3, 0)
            .expect("unregister");
        assert!(s.registrants.is_empty());
        assert_eq!(s.generation, 4);
        assert_eq!(s.register(&A, 7, 0, 0), Err(invalid_field()));
    }

    /// nvmet's access table: each type, for the holder, a registrant and anyone else.
    #[test]
    fn each_type_leaves_the_access_the_spec_gives() {
        use Access::{Read, Write};
        // (type, registrant read, registrant write, other read, other write)
        let table = [
            (pr::WRITE_EXCLUSIVE, true, false, true, false),
            (pr::EXCLUSIVE_ACCESS, false, false, false, false),
            (pr::WRITE_EXCLUSIVE_REG_ONLY, true, true, true, false),
            (pr::EXCLUSIVE_ACCESS_REG_ONLY, true, true, false, false),
            (pr::WRITE_EXCLUSIVE_ALL_REGS, true, true, true, false),
            (pr::EXCLUSIVE_ACCESS_ALL_REGS, true, true, false, false),
        ];
        for (rtype, reg_r, reg_w, other_r, other_w) in table {
            let mut s = registered(&[(A, 1), (B, 2)]);
            s.acquire(&A, act(pr::ACQUIRE_ACT_ACQUIRE, rtype), 1, 0)
                .expect("acquire");
            assert!(
                s.allows(&A, Read) && s.allows(&A, Write),
                "holder, type {rtype}"
            );
            assert_eq!(
                (s.allows(&B, Read), s.allows(&B, Write)),
                (reg_r, reg_w),
                "registrant, type {rtype}"
            );
            assert_eq!(
                (s.allows(&C, Read), s.allows(&C, Write)),
                (other_r, other_w),
                "other host, type {rtype}"
            );
        }
        assert!(
            registered(&[(A, 1)]).allows(&C, Write),
            "registered, no reservation"
        );
    }

    #[test]
    fn acquire_and_release_follow_the_holder_and_the_type() {
        let mut s = registered(&[(A, 1), (B, 2)]);
        let we = act(pr::ACQUIRE_ACT_ACQUIRE, pr::WRITE_EXCLUSIVE);
        assert_eq!(s.acquire(&A, we, 9, 0), Err(conflict()), "wrong key");
        assert_eq!(s.acquire(&C, we, 0, 0), Err(conflict()), "not registered");
        assert_eq!(
            s.acquire(&A, we | pr::IGNORE_KEY, 1, 0),
            Err(invalid_field())
        );
        assert_eq!(s.acquire(&A, act(0, 7), 1, 0), Err(invalid_field()));
        s.acquire(&A, we, 1, 0).expect("acquire");
        s.acquire(&A, we, 1, 0).expect("again, same type");
        assert_eq!(s.generation, 2, "acquire does not bump the generation");
        assert_eq!(s.acquire(&B, we, 2, 0), Err(conflict()), "held by A");
        let ea = act(pr::ACQUIRE_ACT_ACQUIRE, pr::EXCLUSIVE_ACCESS);
        assert_eq!(s.acquire(&A, ea, 1, 0), Err(conflict()), "another type");
        // B releasing what it does not hold changes nothing.
        s.release(&B, act(0, pr::WRITE_EXCLUSIVE), 2)
            .expect("no-op");
        assert_eq!(s.holder, Some((A, pr::WRITE_EXCLUSIVE)));
        assert_eq!(
            s.release(&A, act(0, pr::EXCLUSIVE_ACCESS), 1),
            Err(invalid_field()),
            "the type must match"
        );
        assert_eq!(s.release(&A, act(0, pr::WRITE_EXCLUSIVE), 1), Ok(vec![]));
        assert_eq!(s.holder, None);
    }

    #[test]
    fn all_registrants_hold_and_it_passes_on_when_one_leaves() {
        let wear = pr::WRITE_EXCLUSIVE_ALL_REGS;
        let mut s = registered(&[(A, 1), (B, 2)]);
        s.acquire(&A, act(pr::ACQUIRE_ACT_ACQUIRE, wear), 1, 0)
            .expect("acquire");
        assert!(s.is_holder(&A) && s.is_holder(&B));
        s.acquire(&B, act(pr::ACQUIRE_ACT_ACQUIRE, wear), 2, 0)
            .expect("B holds it too");
        s.register(&A, pr::REGISTER_ACT_UNREG, 1, 0)
            .expect("A leaves");
        assert_eq!(s.holder, Some((B, wear)), "B still holds it");
        s.register(&B, pr::REGISTER_ACT_UNREG, 2, 0)
            .expect("B leaves");
        assert_eq!(s.holder, None, "no registrant, no reservation");
    }

    #[test]
    fn a_registrants_only_holder_leaving_releases_and_tells_the_others() {
        let mut s = registered(&[(A, 1), (B, 2), (C, 3)]);
        s.acquire(&A, act(0, pr::WRITE_EXCLUSIVE_REG_ONLY), 1, 0)
            .expect("acquire");
        let notices = s.register(&A, pr::REGISTER_ACT_UNREG, 1, 0).expect("leave");
        assert_eq!(s.holder, None);
        assert_eq!(
            notices,
            vec![
                Notice {
                    host: B,
                    kind: pr::LOG_RESERVATION_RELEASED
                },
                Notice {
                    host: C,
                    kind: pr::LOG_RESERVATION_RELEASED
                },
            ]
        );
    }

    /// Failover in a cluster: B preempts the dead A by A's key, takes the reservation, and
    /// A is told its registration was preempted.
    #[test]
    fn preempting_the_holders_key_takes_its_reservation() {
        let mut s = registered(&[(A, 1), (B, 2)]);
        s.acquire(&A, act(0, pr::WRITE_EXCLUSIVE_REG_ONLY), 1, 0)
            .expect("acquire");
        let preempt = act(pr::ACQUIRE_ACT_PREEMPT, pr::WRITE_EXCLUSIVE_REG_ONLY);
        assert_eq!(
            s.acquire(&B, preempt, 9, 1),
            Err(conflict()),
            "B's own key is 2"
        );
        let notices = s.acquire(&B, preempt, 2, 1).expect("preempt");
        assert_eq!(s.holder, Some((B, pr::WRITE_EXCLUSIVE_REG_ONLY)));
        assert!(s.registrant(&A).is_none());
        assert_eq!(
            notices,
            vec![Notice {
                host: A,
                kind: pr::LOG_REGISTRATION_PREEMPTED
            }]
        );
        assert!(!s.allows(&A, Access::Write), "A is no registrant any more");
        // Another registrant preempting with nobody's key: conflict; with 0 while a holder
        // exists: invalid field.
        s.register(&C, pr::REGISTER_ACT_REG, 0, 3)
            .expect("C registers");
        assert_eq!(s.acquire(&C, preempt, 3, 42), Err(conflict()));
        assert_eq!(s.acquire(&C, preempt, 3, 0), Err(invalid_field()));
        assert_eq!(s.holder, Some((B, pr::WRITE_EXCLUSIVE_REG_ONLY)));
    }

    #[test]
    fn preempt_with_key_0_under_all_registrants_leaves_the_issuer_alone() {
        let wear = pr::WRITE_EXCLUSIVE_ALL_REGS;
        let mut s = registered(&[(A, 1), (B, 2), (C, 3)]);
        s.acquire(&A, act(0, wear), 1, 0).expect("acquire");
        let notices = s
            .acquire(
                &B,
                act(pr::ACQUIRE_ACT_PREEMPT_AND_ABORT, pr::EXCLUSIVE_ACCESS),
                2,
                0,
            )
            .expect("preempt all others");
        assert_eq!(s.registrants, vec![Registrant { host: B, key: 2 }]);
        assert_eq!(s.holder, Some((B, pr::EXCLUSIVE_ACCESS)));
        assert_eq!(notices.len(), 2);
        assert!(!s.allows(&A, Access::Read));
    }

    #[test]
    fn the_holder_preempting_itself_changes_the_type_and_tells_the_others() {
        let mut s = registered(&[(A, 1), (B, 2)]);
        s.acquire(&A, act(0, pr::WRITE_EXCLUSIVE), 1, 0)
            .expect("acquire");
        let notices = s
            .acquire(&A, act(pr::ACQUIRE_ACT_PREEMPT, pr::EXCLUSIVE_ACCESS), 1, 1)
            .expect("type change");
        assert_eq!(s.holder, Some((A, pr::EXCLUSIVE_ACCESS)));
        assert_eq!(
            notices,
            vec![Notice {
                host: B,
                kind: pr::LOG_RESERVATION_RELEASED
            }]
        );
    }

    #[test]
    fn clear_drops_everything_and_tells_every_other_registrant() {
        let mut s = registered(&[(A, 1), (B, 2)]);
        s.acquire(&A, act(0, pr::EXCLUSIVE_ACCESS), 1, 0)
            .expect("acquire");
        assert_eq!(
            s.release(&B, pr::RELEASE_ACT_CLEAR, 9),
            Err(conflict()),
            "key"
        );
        let notices = s.release(&B, pr::RELEASE_ACT_CLEAR, 2).expect("clear");
        assert!(s.registrants.is_empty() && s.holder.is_none());
        assert_eq!(
            notices,
            vec![Notice {
                host: A,
                kind: pr::LOG_RESERVATION_PREEMPTED
            }]
        );
        assert_eq!(s.generation, 3);
    }

    /// `struct nvme_reservation_status_ext` and `nvme_registered_ctrl_ext`.
    #[test]
    fn report_layout_is_the_extended_data_structure() {
        let mut s = registered(&[(A, 0x1111), (B, 0x2222)]);
        s.acquire(&B, act(0, pr::WRITE_EXCLUSIVE_REG_ONLY), 0x2222, 0)
            .expect("acquire");
        let page = s.report();
        assert_eq!(page.len(), 64 + 2 * 64);
        assert_eq!(
            u32::from_le_bytes(page[0..4].try_into().unwrap()),
            2,
            "generation"
        );
        assert_eq!(page[4], pr::WRITE_EXCLUSIVE_REG_ONLY);
        assert_eq!(u16::from_le_bytes([page[5], page[6]]), 2, "regctl");
        for (i, (host, key, holds)) in [(A, 0x1111u64, 0u8), (B, 0x2222, 1)].iter().enumerate() {
            let e = &page[64 + i * 64..128 + i * 64];
            assert_eq!(u16::from_le_bytes([e[0], e[1]]), 0xffff);
            assert_eq!(e[2], *holds, "rcsts");
            assert_eq!(u64::from_le_bytes(e[8..16].try_into().unwrap()), *key);
            assert_eq!(&e[16..32], host);
        }
    }

    #[test]
    fn the_stored_record_reads_back_as_the_state() {
        for s in [
            ReservationState::default(),
            registered(&[(A, 1), (B, u64::MAX)]),
            {
                let mut s = registered(&[(A, 1), (C, 3)]);
                s.acquire(&C, act(0, pr::EXCLUSIVE_ACCESS_REG_ONLY), 3, 0)
                    .expect("acquire");
                s.generation = 0xfedc_ba98;
                s
            },
        ] {
            let record = s.encode();
            assert_eq!(
                record.len(),
                RECORD_HEADER_LEN + RECORD_ENTRY_LEN * s.registrants.len()
            );
            assert_eq!(ReservationState::decode(&record), Ok(s));
        }
        let good = registered(&[(A, 1)]).encode();
        assert_eq!(
            ReservationState::decode(&good[..good.len() - 1]),
            Err(RecordError::Truncated {
                len: good.len() - 1
            })
        );
        let mut bad = good.clone();
        bad[0] = 2;
        assert_eq!(ReservationState::decode(&bad), Err(RecordError::Version(2)));
        let mut bad = good;
        bad[5] = 7;
        assert_eq!(ReservationState::decode(&bad), Err(RecordError::Type(7)));
    }

    #[test]
    fn the_table_skips_its_lock_while_no_namespace_has_a_registration() {
        let table = Reservations::default();
        assert!(table.check(1, &A, Access::Write).is_ok());
        table
            .update(1, |s| s.register(&A, pr::REGISTER_ACT_REG, 0, 1))
            .expect("reg");
        table
            .update(1, |s| s.acquire(&A, act(0, pr::WRITE_EXCLUSIVE), 1, 0))
            .expect("acquire");
        assert_eq!(table.active.load(Ordering::Relaxed), 1);
        assert_eq!(table.check(1, &B, Access::Write), Err(conflict()));
        assert!(
            table.check(2, &B, Access::Write).is_ok(),
            "another namespace"
        );
        table.forget(1);
        assert_eq!(table.active.load(Ordering::Relaxed), 0);
        assert!(table.check(1, &B, Access::Write).is_ok());
    }

    #[test]
    fn the_notice_log_hands_out_the_oldest_and_counts_what_is_left() {
        let mut log = NoticeLog::default();
        assert_eq!(log.page(false), vec![0; 64], "empty entry");
        for i in 0..(MAX_NOTICES as u32 + 2) {
            log.push(pr::LOG_REGISTRATION_PREEMPTED, i + 1);
        }
        let page = log.page(true);
        assert_eq!(
            u64::from_le_bytes(page[0..8].try_into().unwrap()),
            3,
            "the two oldest were lost"
        );
        assert_eq!(page[9] as usize, MAX_NOTICES - 1);
        let taken = log.page(false);
        assert_eq!(taken, page, "retain showed the same entry");
        assert_eq!(u32::from_le_bytes(taken[12..16].try_into().unwrap()), 3);
        assert_eq!(log.page(false)[9] as usize, MAX_NOTICES - 2);
    }
}
