//! The gateway group model and its ANA decisions: pure and deterministic.
//!
//! No I/O and no clock: [`GroupMap::handle`] takes an [`Event`] (a beacon, a timer tick, a
//! completed fence) with its timestamp and returns the [`Action`]s the caller must carry out
//! (fence a gateway's librados clients, push new ANA states to a gateway). The same sequence
//! of events always gives the same map and the same actions.
//!
//! Rules:
//! - Each gateway owns one ANA group. A group's *holder* is the gateway whose path is
//!   optimized for it: its owner, or a survivor after a failover.
//! - A gateway that has not beaconed for `grace_ms` is unavailable; so is one whose control
//!   stream ended ([`Event::StreamEnded`]: its process died and the kernel reset its
//!   connections, or the network between it and the replica broke). Either way each group it
//!   holds is fenced first ([`Action::Fence`]); only the [`Event::Fenced`] for that fence moves the group
//!   to a survivor (the owner if it is available, else the available gateway holding the
//!   fewest groups, ties by name). No survivor: the group is orphaned and moves as soon as
//!   one appears (after the fence).
//! - A gateway that beacons but reports itself cut off from the cluster
//!   ([`ClusterReach::Stalled`]: its commands at Ceph make no progress and the monitors do not
//!   answer it) is unavailable too, but only while another available gateway reports the
//!   cluster reachable: in a whole-cluster outage moving helps nobody. It is available again
//!   only once it no longer reports the cluster stalled.
//! - A fenced gateway stays fenced while it beacons with the same incarnation (it came back
//!   without restarting: its clients are blocklisted); a new incarnation makes it available.
//! - Failback, when the owner is available again (for `failback_delay_ms`): the survivor is
//!   told ANA change (drain), and once it reports that assignment applied its context for the
//!   group is fenced; only then is the group optimized on the owner.
//! - Invariant, at every step: for each group exactly one gateway reports it optimized or
//!   changing (the holder), every other gateway reports it inaccessible
//!   ([`GroupMap::check_invariant`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// ANA states, valued as in the NVMe Base spec (Asymmetric Namespace Access log page) and
/// Linux `include/linux/nvme.h` (`NVME_ANA_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum AnaState {
    Optimized,
    NonOptimized,
    Inaccessible,
    PersistentLoss,
    Change,
}

impl AnaState {
    /// The state code on the wire (`NVME_ANA_OPTIMIZED` = 0x01 ... `NVME_ANA_CHANGE` = 0x0f).
    pub fn code(self) -> u8 {
        match self {
            AnaState::Optimized => 0x01,
            AnaState::NonOptimized => 0x02,
            AnaState::Inaccessible => 0x03,
            AnaState::PersistentLoss => 0x04,
            AnaState::Change => 0x0f,
        }
    }

    pub fn from_code(code: u8) -> Option<AnaState> {
        Some(match code {
            0x01 => AnaState::Optimized,
            0x02 => AnaState::NonOptimized,
            0x03 => AnaState::Inaccessible,
            0x04 => AnaState::PersistentLoss,
            0x0f => AnaState::Change,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            AnaState::Optimized => "optimized",
            AnaState::NonOptimized => "non-optimized",
            AnaState::Inaccessible => "inaccessible",
            AnaState::PersistentLoss => "persistent-loss",
            AnaState::Change => "change",
        }
    }
}

/// Controller IDs per gateway (as ceph-nvmeof: `min_cntlid = (group - 1) * 2040 + 1`).
pub const CNTLID_RANGE_SIZE: u32 = 2040;
/// The highest controller ID (`NVME_CNTLID_MAX` = 0xffef).
pub const CNTLID_MAX: u32 = 0xffef;
/// The highest ANA group a gateway may own: its controller ID range must fit below
/// [`CNTLID_MAX`].
pub const MAX_ANA_GROUP: u32 = CNTLID_MAX / CNTLID_RANGE_SIZE;

/// The controller ID range of the gateway owning `group` (1-based), disjoint per group.
pub fn cntlid_range(group: u32) -> Option<(u16, u16)> {
    if group == 0 || group > MAX_ANA_GROUP {
        return None;
    }
    let min = (group - 1) * CNTLID_RANGE_SIZE + 1;
    let max = (min + CNTLID_RANGE_SIZE - 1).min(CNTLID_MAX);
    Some((u16::try_from(min).ok()?, u16::try_from(max).ok()?))
}

/// The ANA group a new namespace goes to: the one with the fewest namespaces (ties: lowest
/// ID). `counts` holds the namespaces per group; groups missing from it have none.
pub fn pick_group(groups: &[u32], counts: &BTreeMap<u32, usize>) -> Option<u32> {
    groups
        .iter()
        .copied()
        .min_by_key(|g| (counts.get(g).copied().unwrap_or(0), *g))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Availability {
    Available,
    Unavailable,
    /// Blocklisted; stays so until it beacons with a new incarnation.
    Fenced,
}

impl Availability {
    pub fn name(self) -> &'static str {
        match self {
            Availability::Available => "available",
            Availability::Unavailable => "unavailable",
            Availability::Fenced => "fenced",
        }
    }
}

/// Whether a gateway reaches the cluster, as its beacons say (`Beacon.cluster`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ClusterReach {
    /// Not said (an older gateway) or not known yet.
    #[default]
    Unknown,
    /// A command or a probe of the monitors was answered within its stall window.
    Reachable,
    /// Its commands at the cluster have made no progress for its stall window and the
    /// monitors do not answer it either.
    Stalled,
}

impl ClusterReach {
    pub fn name(self) -> &'static str {
        match self {
            ClusterReach::Unknown => "unknown",
            ClusterReach::Reachable => "reachable",
            ClusterReach::Stalled => "stalled",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GatewayEntry {
    pub name: String,
    pub ana_group: u32,
    pub incarnation: u64,
    /// librados client addresses (`rados_getaddrs`) last reported: the whole gateway.
    pub addrs: Vec<String>,
    /// The addresses per ANA group, when the gateway shards its connections per group (each
    /// group's images use clients of their own): a fence of one group blocklists only these.
    /// None: not reported (every fence blocklists `addrs`).
    #[serde(default)]
    pub group_addrs: Option<BTreeMap<u32, Vec<String>>>,
    pub availability: Availability,
    /// The incarnation that was fenced; beacons carrying it do not make the gateway available.
    pub fenced_incarnation: Option<u64>,
    /// For a gateway fenced per ANA group: the addresses blocklisted. It serves again without
    /// restarting once none of the addresses it reports is among them (it dropped its fenced
    /// clients; a group it gets back is served through fresh ones). None: fenced whole, only
    /// a restart brings it back.
    #[serde(default)]
    pub fenced_addrs: Option<Vec<String>>,
    /// The map epoch whose ANA states the gateway last reported applied.
    pub applied_epoch: u64,
    /// Announced that it is shutting down: its groups move away (drain, fence, then
    /// optimized elsewhere) and it takes none over. Cleared by a new incarnation.
    #[serde(default)]
    pub leaving: bool,
    /// Whether the gateway's last beacon said it reaches the cluster. Not persisted: a new
    /// leader hears it again in the next beacon.
    #[serde(skip)]
    pub cluster: ClusterReach,
    /// Not persisted: a new leader starts every gateway's grace at its first tick.
    #[serde(skip)]
    pub last_beacon_ms: Option<u64>,
    #[serde(skip)]
    pub available_since_ms: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    /// The holder serves the group.
    Active,
    /// The holder (its process `incarnation`) is unavailable and being fenced; the group
    /// moves when fence `fence` is done.
    FailoverWaitFence { fence: u64, incarnation: u64 },
    /// The holder is unavailable (or fenced) and no gateway can take the group over.
    Orphan { fenced: bool },
    /// Failback: the holder was told ANA change at map `epoch`, waiting for it to apply it.
    FailbackDraining { to: String, epoch: u64 },
    /// Failback: the holder's context for the group is being fenced.
    FailbackWaitFence { to: String, fence: u64 },
}

impl Phase {
    pub fn name(&self) -> &'static str {
        match self {
            Phase::Active => "active",
            Phase::FailoverWaitFence { .. } => "failover-wait-fence",
            Phase::Orphan { .. } => "orphan",
            Phase::FailbackDraining { .. } => "failback-draining",
            Phase::FailbackWaitFence { .. } => "failback-wait-fence",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupEntry {
    pub id: u32,
    pub owner: String,
    pub holder: String,
    pub phase: Phase,
}

/// Timers, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timing {
    /// Missed-beacon time after which a gateway is declared dead.
    pub grace_ms: u64,
    /// How long a returning owner must stay available before failback starts.
    pub failback_delay_ms: u64,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            grace_ms: 2_000,
            failback_delay_ms: 1_000,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Beacon {
        gateway: String,
        /// 0: assign a free group.
        ana_group: u32,
        incarnation: u64,
        addrs: Vec<String>,
        /// The addresses per ANA group (see [`GatewayEntry::group_addrs`]).
        group_addrs: Option<BTreeMap<u32, Vec<String>>>,
        applied_epoch: u64,
        /// Whether the gateway reaches the cluster, as it sees it.
        cluster: ClusterReach,
        now_ms: u64,
    },
    Tick {
        now_ms: u64,
    },
    /// Fence `fence` is in force: the blocklist is committed and the survivors' osdmaps
    /// include it.
    Fenced {
        fence: u64,
    },
    /// Fence `fence` could not be done; it is asked again.
    FenceFailed {
        fence: u64,
    },
    /// The gateway is shutting down (planned): move its groups away first.
    Leave {
        gateway: String,
        now_ms: u64,
    },
    /// A control stream (`Join`) of the gateway's process `incarnation` ended: the process died
    /// (the kernel reset its connections) or the network to it broke. A fast *suspicion*, not
    /// proof of death: the gateway is unavailable at once, so the groups it holds are fenced
    /// at once, and they move only when that fence is done, exactly as after missed beacons.
    /// Ignored for another incarnation (the gateway restarted meanwhile) or a gateway that is
    /// not available.
    StreamEnded {
        gateway: String,
        incarnation: u64,
        now_ms: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FenceScope {
    /// Every client address the gateway reported (it does not report them per group).
    Gateway,
    /// Only the gateway's clients for one group: its other groups keep working there.
    Group,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Blocklist `addrs` (the gateway's librados clients), wait until the osdmap carries it,
    /// then report [`Event::Fenced`] with this `fence`. Empty `addrs`: nothing to blocklist
    /// (report it fenced at once).
    Fence {
        fence: u64,
        group: u32,
        gateway: String,
        addrs: Vec<String>,
        scope: FenceScope,
    },
    /// The gateway's ANA states changed: push it a new assignment.
    Push { gateway: String },
    /// Blocklist `addrs`, nothing waits for it: the clients of a gateway's previous
    /// incarnation, seen restarted. That process is gone (or must be: one gateway name, one
    /// process), and its librbd exclusive locks and watches then break at once instead of
    /// making the new process's first writes wait out the watch timeout (~30 s).
    Blocklist { gateway: String, addrs: Vec<String> },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MapError {
    #[error("ANA group {group} is owned by gateway {owner}")]
    GroupTaken { group: u32, owner: String },
    #[error("gateway {gateway} owns ANA group {owned}, not {asked}")]
    WrongGroup {
        gateway: String,
        owned: u32,
        asked: u32,
    },
    #[error("ANA group {0} is out of range (1..={MAX_ANA_GROUP})")]
    GroupRange(u32),
    #[error("no free ANA group (all {MAX_ANA_GROUP} are owned)")]
    NoFreeGroup,
    #[error("unknown fence {0}")]
    UnknownFence(u64),
    #[error("unknown gateway {0}")]
    UnknownGateway(String),
}

/// The group's gateways and ANA groups. Serialisable: the leader persists it in RADOS.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupMap {
    /// Bumped on every change of any gateway's ANA states.
    pub epoch: u64,
    pub next_fence: u64,
    pub timing: Timing,
    pub gateways: BTreeMap<String, GatewayEntry>,
    pub groups: BTreeMap<u32, GroupEntry>,
    /// The replica that persisted this map, i.e. the leader when it was written: what
    /// replicas that do not lead report as the leader (empty in maps from older replicas).
    #[serde(default)]
    pub leader: String,
}

impl GroupMap {
    pub fn new(timing: Timing) -> Self {
        GroupMap {
            epoch: 1,
            next_fence: 1,
            timing,
            ..GroupMap::default()
        }
    }

    fn available(&self, gateway: &str) -> bool {
        self.gateways
            .get(gateway)
            .is_some_and(|g| g.availability == Availability::Available)
    }

    /// Available and not leaving: may take groups.
    fn can_take(&self, gateway: &str) -> bool {
        self.gateways
            .get(gateway)
            .is_some_and(|g| g.availability == Availability::Available && !g.leaving)
    }

    fn leaving(&self, gateway: &str) -> bool {
        self.gateways.get(gateway).is_some_and(|g| g.leaving)
    }

    /// The ANA state `gateway` reports for `group`.
    pub fn ana_state(&self, gateway: &str, group: u32) -> AnaState {
        let Some(g) = self.groups.get(&group) else {
            return AnaState::Inaccessible;
        };
        if g.holder != gateway {
            return AnaState::Inaccessible;
        }
        match g.phase {
            Phase::Active | Phase::FailoverWaitFence { .. } | Phase::Orphan { .. } => {
                AnaState::Optimized
            }
            Phase::FailbackDraining { .. } | Phase::FailbackWaitFence { .. } => AnaState::Change,
        }
    }

    /// Every group's state as `gateway` reports it, in group order.
    pub fn ana_states(&self, gateway: &str) -> Vec<(u32, AnaState)> {
        self.groups
            .keys()
            .map(|&id| (id, self.ana_state(gateway, id)))
            .collect()
    }

    /// The number of groups each available gateway holds.
    fn held_counts(&self) -> BTreeMap<&str, usize> {
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for g in self.gateways.values() {
            if g.availability == Availability::Available && !g.leaving {
                counts.insert(&g.name, 0);
            }
        }
        for grp in self.groups.values() {
            if let Some(c) = counts.get_mut(grp.holder.as_str()) {
                *c += 1;
            }
        }
        counts
    }

    /// Who takes `group` over from its fenced holder: the owner if available, else the
    /// available gateway holding the fewest groups (ties: name order).
    fn takeover_target(&self, group: u32, exclude: &str) -> Option<String> {
        let grp = self.groups.get(&group)?;
        if grp.owner != exclude && self.can_take(&grp.owner) {
            return Some(grp.owner.clone());
        }
        self.held_counts()
            .into_iter()
            .filter(|(name, _)| *name != exclude)
            .min_by_key(|(name, n)| (*n, *name))
            .map(|(name, _)| name.to_string())
    }

    fn free_group(&self) -> Option<u32> {
        (1..=MAX_ANA_GROUP).find(|g| !self.groups.contains_key(g))
    }

    fn bump(&mut self, push: &mut Vec<Action>) {
        self.epoch += 1;
        // Everyone's view of the group table may have changed (new group, new holder).
        for name in self.gateways.keys() {
            let a = Action::Push {
                gateway: name.clone(),
            };
            if !push.contains(&a) {
                push.push(a);
            }
        }
    }

    fn new_fence(&mut self) -> u64 {
        let f = self.next_fence;
        self.next_fence += 1;
        f
    }

    /// Applies one event. Errors leave the map unchanged.
    /// The fences the map waits for (a failover or failback past its drain). A replica that
    /// takes the lead asks them again ([`Event::FenceFailed`]): the leader that asked them
    /// may have died before the blocklist was committed or before it fed the result, and
    /// nothing else would move those groups on.
    pub fn pending_fences(&self) -> Vec<u64> {
        self.groups
            .values()
            .filter_map(|g| match g.phase {
                Phase::FailoverWaitFence { fence, .. } | Phase::FailbackWaitFence { fence, .. } => {
                    Some(fence)
                }
                _ => None,
            })
            .collect()
    }

    pub fn handle(&mut self, event: Event) -> Result<Vec<Action>, MapError> {
        let mut actions = Vec::new();
        match event {
            Event::Beacon {
                gateway,
                ana_group,
                incarnation,
                addrs,
                group_addrs,
                applied_epoch,
                cluster,
                now_ms,
            } => self.beacon(
                gateway,
                ana_group,
                incarnation,
                (addrs, group_addrs),
                (applied_epoch, cluster),
                now_ms,
                &mut actions,
            )?,
            Event::Tick { now_ms } => self.tick(now_ms, &mut actions),
            Event::Fenced { fence } => self.fenced(fence, &mut actions)?,
            Event::FenceFailed { fence } => self.fence_failed(fence, &mut actions)?,
            Event::Leave { gateway, now_ms } => {
                let gw = self
                    .gateways
                    .get_mut(&gateway)
                    .ok_or_else(|| MapError::UnknownGateway(gateway.clone()))?;
                if !gw.leaving {
                    tracing::info!(gateway = %gateway, "gateway leaving: moving its groups away");
                    gw.leaving = true;
                }
                self.advance(now_ms, &mut actions);
            }
            Event::StreamEnded {
                gateway,
                incarnation,
                now_ms,
            } => self.stream_ended(&gateway, incarnation, now_ms, &mut actions),
        }
        Ok(actions)
    }

    fn stream_ended(
        &mut self,
        gateway: &str,
        incarnation: u64,
        now_ms: u64,
        actions: &mut Vec<Action>,
    ) {
        let Some(gw) = self.gateways.get_mut(gateway) else {
            return;
        };
        if gw.incarnation != incarnation || gw.availability != Availability::Available {
            return;
        }
        tracing::warn!(
            gateway = %gateway,
            incarnation,
            silent_ms = gw.last_beacon_ms.map(|t| now_ms.saturating_sub(t)),
            "gateway's control stream ended: unavailable (fencing what it holds at once)"
        );
        gw.availability = Availability::Unavailable;
        gw.available_since_ms = None;
        self.advance(now_ms, actions);
    }

    #[allow(clippy::too_many_arguments)]
    fn beacon(
        &mut self,
        gateway: String,
        ana_group: u32,
        incarnation: u64,
        (addrs, group_addrs): (Vec<String>, Option<BTreeMap<u32, Vec<String>>>),
        (applied_epoch, cluster): (u64, ClusterReach),
        now_ms: u64,
        actions: &mut Vec<Action>,
    ) -> Result<(), MapError> {
        if ana_group > MAX_ANA_GROUP {
            return Err(MapError::GroupRange(ana_group));
        }
        if let Some(gw) = self.gateways.get(&gateway) {
            if ana_group != 0 && ana_group != gw.ana_group {
                return Err(MapError::WrongGroup {
                    gateway,
                    owned: gw.ana_group,
                    asked: ana_group,
                });
            }
        } else {
            let group = if ana_group == 0 {
                self.free_group().ok_or(MapError::NoFreeGroup)?
            } else {
                if let Some(g) = self.groups.get(&ana_group) {
                    return Err(MapError::GroupTaken {
                        group: ana_group,
                        owner: g.owner.clone(),
                    });
                }
                ana_group
            };
            tracing::info!(gateway = %gateway, ana_group = group, "gateway joins the group");
            self.gateways.insert(
                gateway.clone(),
                GatewayEntry {
                    name: gateway.clone(),
                    ana_group: group,
                    incarnation,
                    addrs: addrs.clone(),
                    group_addrs: group_addrs.clone(),
                    availability: Availability::Available,
                    fenced_incarnation: None,
                    fenced_addrs: None,
                    applied_epoch: 0,
                    leaving: false,
                    cluster: ClusterReach::Unknown,
                    last_beacon_ms: Some(now_ms),
                    available_since_ms: Some(now_ms),
                },
            );
            self.groups.insert(
                group,
                GroupEntry {
                    id: group,
                    owner: gateway.clone(),
                    holder: gateway.clone(),
                    phase: Phase::Active,
                },
            );
            self.bump(actions);
        }
        let Some(gw) = self.gateways.get_mut(&gateway) else {
            return Ok(());
        };
        gw.last_beacon_ms = Some(now_ms);
        gw.applied_epoch = gw.applied_epoch.max(applied_epoch);
        if gw.incarnation != incarnation {
            if !gw.addrs.is_empty() {
                tracing::info!(gateway = %gateway, incarnation, "gateway restarted: blocklisting its previous process's clients");
                actions.push(Action::Blocklist {
                    gateway: gateway.clone(),
                    addrs: gw.addrs.clone(),
                });
            }
            gw.incarnation = incarnation;
            gw.applied_epoch = applied_epoch;
            gw.leaving = false;
        }
        gw.addrs = addrs;
        gw.group_addrs = group_addrs;
        if gw.cluster != cluster {
            if cluster == ClusterReach::Stalled {
                tracing::warn!(gateway = %gateway, "gateway reports the cluster out of its reach");
            } else if gw.cluster == ClusterReach::Stalled {
                tracing::info!(gateway = %gateway, "gateway no longer reports the cluster out of its reach");
            }
            gw.cluster = cluster;
        }
        // Fenced per group and reporting none of the blocklisted addresses any more.
        let clean_again = match (&gw.fenced_addrs, &gw.group_addrs) {
            (Some(fenced), Some(now)) => now.values().flatten().all(|a| !fenced.contains(a)),
            _ => false,
        };
        let became_available = cluster != ClusterReach::Stalled
            && match gw.availability {
                Availability::Available => false,
                Availability::Unavailable => true,
                Availability::Fenced => gw.fenced_incarnation != Some(incarnation) || clean_again,
            };
        if became_available {
            tracing::info!(gateway = %gateway, incarnation, clean_again, "gateway available again");
            gw.availability = Availability::Available;
            gw.available_since_ms = Some(now_ms);
            if gw.fenced_incarnation != Some(incarnation) || clean_again {
                gw.fenced_incarnation = None;
                gw.fenced_addrs = None;
            }
            let push = Action::Push {
                gateway: gateway.clone(),
            };
            if !actions.contains(&push) {
                actions.push(push);
            }
        }
        self.mark_cut_off(&gateway);
        // Phases that wait for a beacon: drained survivors, orphans whose holder is back.
        self.advance(now_ms, actions);
        Ok(())
    }

    /// `gateway` reports the cluster out of its reach: unavailable (what it holds is fenced
    /// and moves) if another available gateway reports it reachable. Otherwise nothing: in a
    /// whole-cluster outage moving would help nobody (and the fence could not be done).
    fn mark_cut_off(&mut self, gateway: &str) {
        let someone_else_reaches = self.gateways.values().any(|g| {
            g.name != gateway
                && g.availability == Availability::Available
                && g.cluster == ClusterReach::Reachable
        });
        let Some(gw) = self.gateways.get_mut(gateway) else {
            return;
        };
        if gw.availability == Availability::Available
            && gw.cluster == ClusterReach::Stalled
            && someone_else_reaches
        {
            tracing::warn!(
                gateway = %gateway,
                "gateway cut off from the cluster while others reach it: unavailable (fencing \
                 what it holds)"
            );
            gw.availability = Availability::Unavailable;
            gw.available_since_ms = None;
        }
    }

    fn tick(&mut self, now_ms: u64, actions: &mut Vec<Action>) {
        let grace = self.timing.grace_ms;
        for gw in self.gateways.values_mut() {
            let last = *gw.last_beacon_ms.get_or_insert(now_ms);
            if gw.availability == Availability::Available && now_ms.saturating_sub(last) > grace {
                tracing::warn!(
                    gateway = %gw.name,
                    silent_ms = now_ms.saturating_sub(last),
                    "gateway missed its beacons: unavailable"
                );
                gw.availability = Availability::Unavailable;
                gw.available_since_ms = None;
            }
        }
        self.advance(now_ms, actions);
    }

    /// Moves every group as far as the gateways' availability allows.
    fn advance(&mut self, now_ms: u64, actions: &mut Vec<Action>) {
        let ids: Vec<u32> = self.groups.keys().copied().collect();
        for id in ids {
            let Some(grp) = self.groups.get(&id).cloned() else {
                continue;
            };
            let holder_ok = self.available(&grp.holder);
            match grp.phase {
                Phase::Active => {
                    if !holder_ok {
                        self.start_failover(id, actions);
                    } else if self.leaving(&grp.holder) {
                        // Planned move: drain on the leaving holder, fence it, then optimized
                        // on the target (the same steps as a failback).
                        if let Some(to) = self.takeover_target(id, &grp.holder) {
                            tracing::info!(group = id, from = %grp.holder, to = %to, "planned move: draining");
                            self.set_phase(
                                id,
                                Phase::FailbackDraining {
                                    to,
                                    epoch: self.epoch + 1,
                                },
                            );
                            self.bump(actions);
                        }
                    } else if grp.owner != grp.holder && self.owner_ready(&grp.owner, now_ms) {
                        // Failback: drain on the survivor first.
                        self.set_phase(
                            id,
                            Phase::FailbackDraining {
                                to: grp.owner.clone(),
                                epoch: self.epoch + 1,
                            },
                        );
                        tracing::info!(group = id, from = %grp.holder, to = %grp.owner, "failback: draining");
                        self.bump(actions);
                    }
                }
                Phase::Orphan { fenced } => {
                    if !fenced && holder_ok {
                        tracing::info!(group = id, holder = %grp.holder, "holder back: group active again");
                        self.set_phase(id, Phase::Active);
                        self.bump(actions);
                    } else if fenced {
                        if let Some(to) = self.takeover_target(id, &grp.holder) {
                            self.give(id, to, actions);
                        }
                    } else if self.takeover_target(id, &grp.holder).is_some() {
                        self.start_failover(id, actions);
                    }
                }
                Phase::FailoverWaitFence { .. } => {}
                Phase::FailbackDraining { to, epoch } => {
                    if !holder_ok {
                        self.start_failover(id, actions);
                    } else if !self.can_take(&to) {
                        tracing::info!(group = id, to = %to, "move cancelled: its target is gone");
                        self.set_phase(id, Phase::Active);
                        self.bump(actions);
                    } else if self
                        .gateways
                        .get(&grp.holder)
                        .is_some_and(|g| g.applied_epoch >= epoch)
                    {
                        let fence = self.new_fence();
                        self.set_phase(
                            id,
                            Phase::FailbackWaitFence {
                                to: to.clone(),
                                fence,
                            },
                        );
                        // The holder's clients for this group only (its other groups keep
                        // working there); a holder that does not report them per group:
                        // nothing if it stays (its clients serve its own group too), all of
                        // them if it is leaving.
                        let leaving = self.leaving(&grp.holder);
                        let (addrs, scope) = self.fence_addrs(&grp.holder, id, leaving);
                        actions.push(Action::Fence {
                            fence,
                            group: id,
                            gateway: grp.holder.clone(),
                            addrs,
                            scope,
                        });
                    }
                }
                Phase::FailbackWaitFence { .. } => {
                    if !holder_ok {
                        self.start_failover(id, actions);
                    }
                }
            }
        }
    }

    fn owner_ready(&self, owner: &str, now_ms: u64) -> bool {
        self.gateways.get(owner).is_some_and(|g| {
            g.availability == Availability::Available
                && !g.leaving
                && g.available_since_ms
                    .is_some_and(|t| now_ms.saturating_sub(t) >= self.timing.failback_delay_ms)
        })
    }

    fn set_phase(&mut self, id: u32, phase: Phase) {
        if let Some(g) = self.groups.get_mut(&id) {
            g.phase = phase;
        }
    }

    /// The holder of `id` is dead: fence it (if anyone can take over).
    fn start_failover(&mut self, id: u32, actions: &mut Vec<Action>) {
        let Some(grp) = self.groups.get(&id).cloned() else {
            return;
        };
        if self.takeover_target(id, &grp.holder).is_none() {
            if !matches!(grp.phase, Phase::Orphan { .. }) {
                tracing::warn!(group = id, holder = %grp.holder, "holder unavailable and no survivor: group orphaned");
                self.set_phase(id, Phase::Orphan { fenced: false });
                self.bump(actions);
            }
            return;
        }
        // One fence per dead gateway in flight is enough, but a fence per group keeps each
        // group's progress independent; blocklisting the same address twice is harmless.
        let fence = self.new_fence();
        let incarnation = self
            .gateways
            .get(&grp.holder)
            .map(|g| g.incarnation)
            .unwrap_or_default();
        let (addrs, scope) = self.fence_addrs(&grp.holder, id, true);
        tracing::warn!(group = id, holder = %grp.holder, fence, "failover: fencing the holder");
        let was_change = matches!(
            grp.phase,
            Phase::FailbackDraining { .. } | Phase::FailbackWaitFence { .. }
        );
        self.set_phase(id, Phase::FailoverWaitFence { fence, incarnation });
        if was_change {
            // The dead holder was told "change"; nothing to push it, but the epoch moves.
            self.bump(actions);
        }
        actions.push(Action::Fence {
            fence,
            group: id,
            gateway: grp.holder,
            addrs,
            scope,
        });
    }

    /// What fencing `gateway` for `group` blocklists: its clients for that group when it
    /// reports them per group (none: it has no connection for the group, nothing can write
    /// it there); otherwise all its clients when `whole_if_unsharded`, else nothing.
    fn fence_addrs(
        &self,
        gateway: &str,
        group: u32,
        whole_if_unsharded: bool,
    ) -> (Vec<String>, FenceScope) {
        let Some(gw) = self.gateways.get(gateway) else {
            return (Vec::new(), FenceScope::Group);
        };
        match &gw.group_addrs {
            Some(per_group) => (
                per_group.get(&group).cloned().unwrap_or_default(),
                FenceScope::Group,
            ),
            None if whole_if_unsharded => (gw.addrs.clone(), FenceScope::Gateway),
            None => (Vec::new(), FenceScope::Group),
        }
    }

    /// Makes `to` the holder of `id`, optimized.
    fn give(&mut self, id: u32, to: String, actions: &mut Vec<Action>) {
        tracing::info!(group = id, to = %to, "group optimized on its new holder");
        if let Some(g) = self.groups.get_mut(&id) {
            g.holder = to;
            g.phase = Phase::Active;
        }
        self.bump(actions);
    }

    fn fenced(&mut self, fence: u64, actions: &mut Vec<Action>) -> Result<(), MapError> {
        let Some((id, grp)) = self
            .groups
            .iter()
            .find(|(_, g)| match g.phase {
                Phase::FailoverWaitFence { fence: f, .. }
                | Phase::FailbackWaitFence { fence: f, .. } => f == fence,
                _ => false,
            })
            .map(|(id, g)| (*id, g.clone()))
        else {
            return Err(MapError::UnknownFence(fence));
        };
        match grp.phase {
            Phase::FailoverWaitFence { incarnation, .. } => {
                let (addrs, scope) = self.fence_addrs(&grp.holder, id, true);
                if let Some(gw) = self.gateways.get_mut(&grp.holder) {
                    // Only the fenced incarnation's clients are blocklisted: a holder that
                    // restarted meanwhile has new ones and stays available.
                    if gw.incarnation == incarnation {
                        let already = gw.availability == Availability::Fenced;
                        gw.availability = Availability::Fenced;
                        gw.fenced_incarnation = Some(incarnation);
                        gw.available_since_ms = None;
                        gw.fenced_addrs = match (scope, gw.fenced_addrs.take()) {
                            (FenceScope::Group, Some(mut before)) if already => {
                                before.extend(addrs);
                                Some(before)
                            }
                            (FenceScope::Group, None) if already => None,
                            (FenceScope::Group, _) => Some(addrs),
                            (FenceScope::Gateway, _) => None,
                        };
                    }
                }
                match self.takeover_target(id, "") {
                    Some(to) => self.give(id, to, actions),
                    None => {
                        self.set_phase(id, Phase::Orphan { fenced: true });
                        self.bump(actions);
                    }
                }
            }
            Phase::FailbackWaitFence { to, .. } => {
                if self.leaving(&grp.holder) {
                    if let Some(gw) = self.gateways.get_mut(&grp.holder) {
                        gw.availability = Availability::Fenced;
                        gw.fenced_incarnation = Some(gw.incarnation);
                        gw.available_since_ms = None;
                    }
                }
                if self.can_take(&to) {
                    self.give(id, to, actions);
                } else {
                    // The owner left meanwhile; the survivor's context for the group is fenced,
                    // so it cannot simply resume: look for another holder.
                    match self.takeover_target(id, &grp.holder) {
                        Some(next) => self.give(id, next, actions),
                        None => {
                            self.set_phase(id, Phase::Orphan { fenced: true });
                            self.bump(actions);
                        }
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn fence_failed(&mut self, fence: u64, actions: &mut Vec<Action>) -> Result<(), MapError> {
        let Some((id, grp)) = self
            .groups
            .iter()
            .find(|(_, g)| match g.phase {
                Phase::FailoverWaitFence { fence: f, .. }
                | Phase::FailbackWaitFence { fence: f, .. } => f == fence,
                _ => false,
            })
            .map(|(id, g)| (*id, g.clone()))
        else {
            return Err(MapError::UnknownFence(fence));
        };
        let whole = match grp.phase {
            Phase::FailoverWaitFence { .. } => true,
            _ => self.leaving(&grp.holder),
        };
        let (addrs, scope) = self.fence_addrs(&grp.holder, id, whole);
        actions.push(Action::Fence {
            fence,
            group: id,
            gateway: grp.holder,
            addrs,
            scope,
        });
        Ok(())
    }

    /// Checks the ANA invariant; `Err` names the first group that breaks it.
    ///
    /// For every group, exactly one known gateway reports it optimized or changing, and that
    /// gateway is the group's holder; at most one reports it optimized.
    pub fn check_invariant(&self) -> Result<(), String> {
        for (id, grp) in &self.groups {
            let mut optimized = Vec::new();
            let mut serving = Vec::new();
            for name in self.gateways.keys() {
                match self.ana_state(name, *id) {
                    AnaState::Optimized => {
                        optimized.push(name.clone());
                        serving.push(name.clone());
                    }
                    AnaState::Change => serving.push(name.clone()),
                    _ => {}
                }
            }
            if optimized.len() > 1 {
                return Err(format!("group {id}: optimized on {optimized:?}"));
            }
            if serving.len() != 1 || serving[0] != grp.holder {
                return Err(format!(
                    "group {id}: serving {serving:?}, holder {}",
                    grp.holder
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
