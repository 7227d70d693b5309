//! A controller: one host's association with one subsystem, shared by its queues.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use super::auth::HostKeys;
use super::command::{Completion, Status};
use super::pr::NoticeLog;
use super::subsystem::Subsystem;
use super::target::{Target, TransportCaps, TransportType};
use crate::spec::{aer, cc, csts, log, pr};

/// Asynchronous Event Request commands a host may keep outstanding: AERL + 1.
pub const MAX_OUTSTANDING_AERS: usize = 4;
/// Highest I/O queue ID a host may create.
pub const MAX_IO_QUEUES: u16 = 128;

/// Wakes the transport task that owns a queue when the controller has something for it (an
/// asynchronous event completion, or teardown).
pub trait QueueNotifier: Send + Sync {
    fn wake(&self);
}

/// An asynchronous event waiting for an AER command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct AsyncEvent {
    event_type: u8,
    info: u8,
    log_page: u8,
}

impl AsyncEvent {
    fn completion_dword(&self) -> u32 {
        u32::from(self.event_type) | (u32::from(self.info) << 8) | (u32::from(self.log_page) << 16)
    }

    /// The event [`Self::completion_dword`] encoded.
    fn from_completion_dword(dword: u32) -> Self {
        Self {
            event_type: (dword & 0xff) as u8,
            info: ((dword >> 8) & 0xff) as u8,
            log_page: ((dword >> 16) & 0xff) as u8,
        }
    }
}

#[derive(Debug, Default)]
struct ControllerState {
    cc: u32,
    csts: u32,
    /// I/O queues granted by Set Features Number of Queues (count, not 0's based).
    io_queues_granted: u16,
    connected_qids: BTreeSet<u16>,
    async_event_config: u32,
    volatile_write_cache: bool,
    /// Values of features that are stored and reported but change nothing here.
    stored_features: BTreeMap<u8, u32>,
    aer_cids: VecDeque<u16>,
    pending_events: VecDeque<AsyncEvent>,
    /// Log pages whose event was delivered and not yet cleared by a read with RAE = 0.
    masked_log_pages: BTreeSet<u8>,
    ready_completions: VecDeque<Completion>,
    changed_namespaces: BTreeSet<u32>,
    changed_namespaces_overflow: bool,
    /// Reservation notices for this host not read yet (log page 80h).
    reservation_notices: NoticeLog,
    /// Reservation Notification Mask (feature 82h): a set bit suppresses that notice.
    reservation_notice_mask: u32,
}

/// Why a controller stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TeardownReason {
    KeepAliveExpired,
    AdminQueueClosed,
    HostShutdown,
    /// The host was removed from the subsystem's allowed hosts.
    HostRemoved,
    /// The subsystem was removed from this gateway.
    SubsystemRemoved,
    /// A queue failed in-band authentication (or re-authentication).
    AuthenticationFailed,
    /// The subsystem was made to require TLS and a queue of this controller came without it.
    TlsRequired,
    /// The gateway lost its lease with the group and the cluster (`crate::lease`): commands
    /// stuck at the cluster are given back to the host, which retries them on another path.
    LeaseLost,
    /// The gateway is cut off from the cluster, or from OSDs (`crate::stall`), and the group
    /// was moved away: commands stuck at the cluster are given back to the host, as for
    /// `LeaseLost`.
    ClusterStalled,
}

pub struct Controller {
    pub cntlid: u16,
    pub subsystem: Arc<Subsystem>,
    pub target: Arc<Target>,
    pub hostnqn: String,
    pub hostid: [u8; 16],
    pub transport: TransportCaps,
    kato_ms: AtomicU32,
    keep_alive_seen: AtomicBool,
    torn_down: AtomicBool,
    state: Mutex<ControllerState>,
    notifiers: Mutex<Vec<Weak<dyn QueueNotifier>>>,
    /// The gateway address the host dialled for the admin queue, if the transport said.
    pub local_address: Option<(TransportType, IpAddr)>,
    /// The host's DH-HMAC-CHAP keys when it must authenticate: taken at the admin queue's
    /// Connect and at each admin queue Negotiate, used by every queue of the controller.
    auth_keys: Mutex<Option<Arc<HostKeys>>>,
    /// A queue of this controller connected without a TLS secure channel.
    plain_queue: AtomicBool,
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller")
            .field("cntlid", &self.cntlid)
            .field("subsystem", &self.subsystem.nqn())
            .field("hostnqn", &self.hostnqn)
            .finish_non_exhaustive()
    }
}

impl Controller {
    pub fn new(
        cntlid: u16,
        subsystem: Arc<Subsystem>,
        target: Arc<Target>,
        hostnqn: String,
        hostid: [u8; 16],
        kato_ms: u32,
        transport: TransportCaps,
    ) -> Self {
        let mut state = ControllerState {
            volatile_write_cache: true,
            ..Default::default()
        };
        state.connected_qids.insert(0);
        Self {
            cntlid,
            subsystem,
            target,
            hostnqn,
            hostid,
            transport,
            kato_ms: AtomicU32::new(kato_ms),
            keep_alive_seen: AtomicBool::new(true),
            torn_down: AtomicBool::new(false),
            state: Mutex::new(state),
            notifiers: Mutex::new(Vec::new()),
            local_address: None,
            auth_keys: Mutex::new(None),
            plain_queue: AtomicBool::new(false),
        }
    }

    /// Records that a queue connected to this controller without a TLS secure channel.
    pub(crate) fn note_plain_queue(&self) {
        self.plain_queue.store(true, Ordering::SeqCst);
    }

    /// Whether every queue connected so far came through a TLS secure channel (what the
    /// beacons report, and what a subsystem made to require TLS keeps).
    pub fn is_secure(&self) -> bool {
        !self.plain_queue.load(Ordering::SeqCst)
    }

    /// The keys the host authenticates its queues with (`None`: it need not).
    pub fn auth_keys(&self) -> Option<Arc<HostKeys>> {
        self.auth_keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub(crate) fn set_auth_keys(&self, keys: Option<Arc<HostKeys>>) {
        *self.auth_keys.lock().unwrap_or_else(|e| e.into_inner()) = keys;
    }

    /// Records the address the host reached the admin queue at (see
    /// `Queue::set_local_address`).
    pub fn with_local_address(mut self, local: Option<(TransportType, IpAddr)>) -> Self {
        self.local_address = local;
        self
    }

    fn state(&self) -> MutexGuard<'_, ControllerState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn is_discovery(&self) -> bool {
        self.subsystem.is_discovery()
    }

    // ---- keep alive ------------------------------------------------------------------

    /// Keep Alive Timeout in milliseconds; 0 disables the timer.
    pub fn kato_ms(&self) -> u32 {
        self.kato_ms.load(Ordering::SeqCst)
    }

    pub fn set_kato_ms(&self, kato_ms: u32) {
        self.kato_ms.store(kato_ms, Ordering::SeqCst);
    }

    /// Records host traffic that counts as a keep alive.
    pub fn keep_alive(&self) {
        // Every command calls this: a load first, so that only the first command of a KATO
        // period writes the shared line (a locked write per command cost every queue).
        if !self.keep_alive_seen.load(Ordering::Relaxed) {
            self.keep_alive_seen.store(true, Ordering::Relaxed);
        }
    }

    /// The transport's timer calls this once per KATO period: false means nothing arrived
    /// during the period and the controller must be torn down.
    pub fn take_keep_alive(&self) -> bool {
        self.keep_alive_seen.swap(false, Ordering::SeqCst)
    }

    // ---- lifetime ----------------------------------------------------------------------

    pub fn register_notifier(&self, notifier: Weak<dyn QueueNotifier>) {
        let mut notifiers = self.notifiers.lock().unwrap_or_else(|e| e.into_inner());
        notifiers.retain(|n| n.strong_count() > 0);
        notifiers.push(notifier);
    }

    fn wake_all(&self) {
        let notifiers: Vec<_> = self
            .notifiers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for n in notifiers {
            n.wake();
        }
    }

    pub fn is_torn_down(&self) -> bool {
        self.torn_down.load(Ordering::SeqCst)
    }

    /// Ends this controller: its queues close, other controllers carry on.
    pub fn teardown(&self, reason: TeardownReason) {
        if self.torn_down.swap(true, Ordering::SeqCst) {
            return;
        }
        tracing::info!(cntlid = self.cntlid, subsystem = self.subsystem.nqn(), host = %self.hostnqn, ?reason, "controller torn down");
        self.subsystem.remove_controller(self.cntlid);
        self.wake_all();
        if !self.subsystem.is_discovery() {
            self.target.controller_gone();
        }
    }

    // ---- registers ---------------------------------------------------------------------

    pub fn cc(&self) -> u32 {
        self.state().cc
    }

    pub fn csts(&self) -> u32 {
        self.state().csts
    }

    pub fn is_ready(&self) -> bool {
        let st = self.state();
        st.cc & cc::ENABLE != 0 && st.csts & csts::RDY != 0
    }

    /// Applies a CC write: enable sets RDY (or CFS on bad entry sizes), disable resets the
    /// controller, a shutdown notification completes at once (nothing to drain).
    pub fn write_cc(&self, new: u32) {
        let mut st = self.state();
        let old = st.cc;
        st.cc = new;
        if new & cc::ENABLE != 0 && old & cc::ENABLE == 0 {
            let iosqes = (new & cc::IOSQES_MASK) >> cc::IOSQES_SHIFT;
            let iocqes = (new & cc::IOCQES_MASK) >> cc::IOCQES_SHIFT;
            let css = new & cc::CSS_MASK;
            let valid = (iosqes == 0 || iosqes == cc::NVM_IOSQES)
                && (iocqes == 0 || iocqes == cc::NVM_IOCQES)
                && css == cc::CSS_NVM;
            st.csts = if valid { csts::RDY } else { csts::CFS };
        } else if new & cc::ENABLE == 0 && old & cc::ENABLE != 0 {
            st.csts &= !csts::RDY;
        }
        let shutdown = new & cc::SHN_MASK != 0 && old & cc::SHN_MASK == 0;
        if shutdown {
            st.csts = (st.csts & !csts::SHST_MASK) | csts::SHST_CMPLT;
        } else if new & cc::SHN_MASK == 0 {
            st.csts &= !csts::SHST_MASK;
        }
        drop(st);
        if shutdown {
            let kind = if new & cc::SHN_MASK == cc::SHN_ABRUPT {
                "abrupt"
            } else {
                "normal"
            };
            tracing::info!(
                cntlid = self.cntlid,
                subsystem = self.subsystem.nqn(),
                host = %self.hostnqn,
                kind,
                "controller shut down by the host (CC.SHN; CSTS.SHST complete)"
            );
        }
    }

    // ---- queues ------------------------------------------------------------------------

    pub fn io_queues_granted(&self) -> u16 {
        self.state().io_queues_granted
    }

    /// Number of Queues: grants up to [`MAX_IO_QUEUES`]; returns the 0's based count.
    pub fn grant_io_queues(&self, requested_zero_based: u16) -> u16 {
        let granted = requested_zero_based.saturating_add(1).min(MAX_IO_QUEUES);
        self.state().io_queues_granted = granted;
        granted - 1
    }

    /// Claims an I/O queue ID; false if it is already connected.
    pub fn attach_queue(&self, qid: u16) -> bool {
        self.state().connected_qids.insert(qid)
    }

    pub fn detach_queue(&self, qid: u16) {
        self.state().connected_qids.remove(&qid);
    }

    // ---- features ----------------------------------------------------------------------

    pub fn async_event_config(&self) -> u32 {
        self.state().async_event_config
    }

    pub fn set_async_event_config(&self, value: u32) {
        self.state().async_event_config = value;
    }

    pub fn volatile_write_cache(&self) -> bool {
        self.state().volatile_write_cache
    }

    pub fn set_volatile_write_cache(&self, enabled: bool) {
        self.state().volatile_write_cache = enabled;
    }

    pub fn stored_feature(&self, fid: u8) -> u32 {
        self.state().stored_features.get(&fid).copied().unwrap_or(0)
    }

    pub fn store_feature(&self, fid: u8, value: u32) {
        self.state().stored_features.insert(fid, value);
    }

    // ---- asynchronous events -----------------------------------------------------------

    /// Holds an Asynchronous Event Request; false when the limit is reached.
    pub fn park_aer(&self, cid: u16) -> bool {
        let mut st = self.state();
        if st.aer_cids.len() >= MAX_OUTSTANDING_AERS {
            return false;
        }
        st.aer_cids.push_back(cid);
        let delivered = Self::deliver_events(&mut st);
        drop(st);
        if delivered {
            self.wake_all();
        }
        true
    }

    /// The host reused the CID of an AER held here: it considers that AER finished (SPDK's
    /// initiator completes its outstanding AERs itself when it detaches, without an Abort,
    /// and reuses their CIDs at once). The AER is dropped and never completed, as a
    /// completion under that CID would now answer the host's new command. An event already
    /// assigned to it goes back to the head of the queue for the next AER, so none is lost.
    /// False when `cid` is no AER held here.
    pub fn abandon_aer(&self, cid: u16) -> bool {
        let mut st = self.state();
        if let Some(at) = st.aer_cids.iter().position(|&c| c == cid) {
            st.aer_cids.remove(at);
            return true;
        }
        let Some(at) = st.ready_completions.iter().position(|c| c.cid == cid) else {
            return false;
        };
        if let Some(unsent) = st.ready_completions.remove(at) {
            let event = AsyncEvent::from_completion_dword(unsent.result as u32);
            st.masked_log_pages.remove(&event.log_page);
            st.pending_events.push_front(event);
        }
        true
    }

    /// Completions for AERs that have an event, to be sent on the admin queue.
    pub fn take_ready_completions(&self) -> Vec<Completion> {
        self.state().ready_completions.drain(..).collect()
    }

    /// AERs the controller holds (waiting for an event, or with a completion not yet sent):
    /// commands the host counts as outstanding on the admin queue.
    pub fn held_aers(&self) -> usize {
        let st = self.state();
        st.aer_cids.len() + st.ready_completions.len()
    }

    /// Pending AERs complete with "aborted by SQ deletion" when the admin queue goes.
    pub fn abort_parked_aers(&self) -> Vec<u16> {
        self.state().aer_cids.drain(..).collect()
    }

    fn deliver_events(st: &mut ControllerState) -> bool {
        let mut delivered = false;
        while !st.aer_cids.is_empty() && !st.pending_events.is_empty() {
            let (Some(cid), Some(event)) = (st.aer_cids.pop_front(), st.pending_events.pop_front())
            else {
                break;
            };
            st.masked_log_pages.insert(event.log_page);
            st.ready_completions.push_back(
                Completion::new(cid, Status::SUCCESS)
                    .with_result(u64::from(event.completion_dword())),
            );
            delivered = true;
        }
        delivered
    }

    /// Queues `event` unless the host disabled it (`enable_bit` in Asynchronous Event
    /// Configuration; `None` for events that setting does not govern) or one of its kind
    /// waits for its log page to be read.
    fn post_event(&self, enable_bit: Option<u32>, event: AsyncEvent) {
        let mut st = self.state();
        if enable_bit.is_some_and(|bit| st.async_event_config & bit == 0)
            || st.masked_log_pages.contains(&event.log_page)
            || st.pending_events.contains(&event)
        {
            return;
        }
        st.pending_events.push_back(event);
        let delivered = Self::deliver_events(&mut st);
        drop(st);
        if delivered {
            self.wake_all();
        }
    }

    /// A namespace was added, removed or resized.
    pub fn notify_namespace_changed(&self, nsid: u32) {
        {
            let mut st = self.state();
            if st.changed_namespaces.len() >= log::MAX_CHANGED_NAMESPACES {
                st.changed_namespaces_overflow = true;
            } else {
                st.changed_namespaces.insert(nsid);
            }
        }
        self.post_event(
            Some(aer::CFG_NS_ATTR),
            AsyncEvent {
                event_type: aer::TYPE_NOTICE,
                info: aer::NOTICE_NS_CHANGED,
                log_page: log::CHANGED_NS,
            },
        );
    }

    pub fn notify_ana_change(&self) {
        self.post_event(
            Some(aer::CFG_ANA_CHANGE),
            AsyncEvent {
                event_type: aer::TYPE_NOTICE,
                info: aer::NOTICE_ANA,
                log_page: log::ANA,
            },
        );
    }

    pub fn notify_discovery_change(&self) {
        self.post_event(
            Some(aer::CFG_DISC_CHANGE),
            AsyncEvent {
                event_type: aer::TYPE_NOTICE,
                info: aer::NOTICE_DISC_CHANGED,
                log_page: log::DISC,
            },
        );
    }

    /// The changed namespace list; `clear` (RAE = 0) empties it.
    pub fn changed_namespaces(&self, clear: bool) -> (Vec<u32>, bool) {
        let mut st = self.state();
        let list = st.changed_namespaces.iter().copied().collect();
        let overflow = st.changed_namespaces_overflow;
        if clear {
            st.changed_namespaces.clear();
            st.changed_namespaces_overflow = false;
        }
        (list, overflow)
    }

    /// A reservation notice (`pr::LOG_*`) for namespace `nsid`: logged for the host to read
    /// and announced by an asynchronous event, unless the host masked that kind.
    pub fn notify_reservation(&self, kind: u8, nsid: u32) {
        let mask_bit = match kind {
            pr::LOG_REGISTRATION_PREEMPTED => pr::NOTIFY_MASK_REG_PREEMPTED,
            pr::LOG_RESERVATION_RELEASED => pr::NOTIFY_MASK_RESV_RELEASED,
            pr::LOG_RESERVATION_PREEMPTED => pr::NOTIFY_MASK_RESV_PREEMPTED,
            _ => return,
        };
        {
            let mut st = self.state();
            if st.reservation_notice_mask & mask_bit != 0 {
                return;
            }
            st.reservation_notices.push(kind, nsid);
        }
        self.post_event(
            None,
            AsyncEvent {
                event_type: aer::TYPE_CSS,
                info: aer::CSS_RESV_LOG_PAGE_AVAILABLE,
                log_page: log::RESERVATION,
            },
        );
    }

    /// The Reservation Notification log page: the oldest notice, taken out unless `retain`.
    pub fn reservation_log_page(&self, retain: bool) -> Vec<u8> {
        self.state().reservation_notices.page(retain)
    }

    pub fn reservation_notice_mask(&self) -> u32 {
        self.state().reservation_notice_mask
    }

    pub fn set_reservation_notice_mask(&self, mask: u32) {
        self.state().reservation_notice_mask = mask
            & (pr::NOTIFY_MASK_REG_PREEMPTED
                | pr::NOTIFY_MASK_RESV_RELEASED
                | pr::NOTIFY_MASK_RESV_PREEMPTED);
    }

    /// A log page was read with RAE = 0: its event type may fire again.
    pub fn clear_log_page_event(&self, log_page: u8) {
        self.state().masked_log_pages.remove(&log_page);
    }
}
