//! The lease a group gateway holds its ANA states on: deterministic, no I/O and no clock
//! (times come in as arguments), driven by the group agent (`group.rs`).
//!
//! Why: a gateway the host still reaches but that is cut off from both the control plane and
//! Ceph keeps reporting its groups optimized, while its I/O hangs in librados and the control
//! plane fences it and moves its groups to a survivor. The host sees two optimized paths, and
//! its commands on the cut one wait for its I/O timeout (30 s on Linux) since keep-alives
//! still answer. So the gateway gives its groups up by itself, no later than the control
//! plane can have moved them:
//!
//! - The lease runs from the *send* time of the last beacon the leader accepted, for the
//!   leader's beacon grace (`BeaconReply.grace_ms`). The leader received that beacon later
//!   than it was sent, so it declares this gateway dead no earlier than the lease ends.
//! - From half the lease on, the agent probes the cluster (an osdmap refresh of every
//!   client; one probe at a time, a quarter lease apart).
//! - At the lease's end the gateway demotes itself (its groups turn inaccessible, controllers
//!   with commands stuck at the cluster are closed so the host retries them on another path)
//!   only if a probe has been waiting a quarter lease for an answer and none started within
//!   the last half lease has answered. A gateway that
//!   reaches Ceph keeps serving when the control plane is down or electing a leader: the
//!   data path never waits for the control plane, and if the control plane is up and fences
//!   this gateway, the blocklist ends its writes at Ceph.
//! - A beacon accepted again restores: the agent takes the current assignment afresh (a group
//!   turns optimized only through the usual osdmap refresh, and fresh clients).
//!
//! Safety does not rest on this (the fence does); the lease only bounds how long hosts wait.

use std::time::{Duration, Instant};

/// The lease until the first reply says the leader's grace: the control plane's default.
pub const DEFAULT_LEASE: Duration = Duration::from_millis(2_000);
/// A probe has a quarter lease to answer, at least this; probes start no more often.
const MIN_PROBE_INTERVAL: Duration = Duration::from_millis(100);

/// What the agent must do after [`LeaseWatch::poll`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseAction {
    Nothing,
    /// Start a cluster probe now; report it with [`LeaseWatch::probe_finished`] and the same
    /// start time.
    ProbeCluster,
    /// The lease ran out and the cluster does not answer: give up every group held here.
    Demote,
    /// A beacon was accepted again after a demotion: take the current assignment afresh.
    Restore,
}

#[derive(Debug, Clone)]
pub struct LeaseWatch {
    lease: Duration,
    /// Send time of the newest beacon the leader accepted (None: none yet, so nothing is
    /// held on a lease: the gateway starts with every group inaccessible).
    last_accepted: Option<Instant>,
    /// Start of the probe in flight.
    probing: Option<Instant>,
    last_probe_start: Option<Instant>,
    /// Start of the newest probe the cluster answered.
    cluster_answered: Option<Instant>,
    demoted: bool,
}

impl Default for LeaseWatch {
    fn default() -> Self {
        Self::new(DEFAULT_LEASE)
    }
}

impl LeaseWatch {
    pub fn new(lease: Duration) -> Self {
        Self {
            lease,
            last_accepted: None,
            probing: None,
            last_probe_start: None,
            cluster_answered: None,
            demoted: false,
        }
    }

    pub fn lease(&self) -> Duration {
        self.lease
    }

    pub fn is_demoted(&self) -> bool {
        self.demoted
    }

    /// The leader's grace, from a beacon reply (0: not said, the lease stays).
    pub fn set_grace_ms(&mut self, grace_ms: u64) {
        if grace_ms > 0 {
            self.lease = Duration::from_millis(grace_ms);
        }
    }

    /// The leader accepted a beacon sent at `sent`.
    pub fn beacon_accepted(&mut self, sent: Instant) {
        if self.last_accepted.is_none_or(|t| sent > t) {
            self.last_accepted = Some(sent);
        }
    }

    /// The probe started at `started` ended; `answered`: every client refreshed its osdmap.
    pub fn probe_finished(&mut self, started: Instant, answered: bool) {
        if self.probing == Some(started) {
            self.probing = None;
        }
        if answered && self.cluster_answered.is_none_or(|t| started > t) {
            self.cluster_answered = Some(started);
        }
    }

    /// How long a probe has to answer, and the least time between two probe starts.
    fn probe_period(&self) -> Duration {
        (self.lease / 4).max(MIN_PROBE_INTERVAL)
    }

    /// What to do at `now`; call it often (every beacon interval or faster).
    pub fn poll(&mut self, now: Instant) -> LeaseAction {
        let Some(last) = self.last_accepted else {
            return LeaseAction::Nothing;
        };
        let silent = now.saturating_duration_since(last);
        if self.demoted {
            if silent < self.lease {
                self.demoted = false;
                return LeaseAction::Restore;
            }
            return LeaseAction::Nothing;
        }
        if silent < self.lease / 2 {
            return LeaseAction::Nothing;
        }
        let period = self.probe_period();
        if silent >= self.lease {
            let answered_lately = self
                .cluster_answered
                .is_some_and(|t| now.saturating_duration_since(t) <= self.lease / 2);
            // A probe must have had its period to answer: a gateway thawed after a freeze
            // (nothing probed meanwhile) asks the cluster first.
            let probe_overdue = self
                .probing
                .is_some_and(|t| now.saturating_duration_since(t) >= period);
            if !answered_lately && probe_overdue {
                self.demoted = true;
                return LeaseAction::Demote;
            }
        }
        let due = self.probing.is_none()
            && self
                .last_probe_start
                .is_none_or(|t| now.saturating_duration_since(t) >= period);
        if due {
            self.probing = Some(now);
            self.last_probe_start = Some(now);
            return LeaseAction::ProbeCluster;
        }
        LeaseAction::Nothing
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Polls every 50 ms from `from` to `to` (ms after `t0`), answering each probe after
    /// `probe_ms` when `cluster_up`, never otherwise; returns the time (ms) of the first
    /// action of `kind`.
    fn run_until(
        w: &mut LeaseWatch,
        t0: Instant,
        (from, to): (u64, u64),
        cluster_up: bool,
        probe_ms: u64,
        kind: LeaseAction,
    ) -> Option<u64> {
        let mut started: Vec<Instant> = Vec::new();
        let mut t = from;
        while t <= to {
            let now = t0 + ms(t);
            if cluster_up {
                for s in started.iter().filter(|s| now >= **s + ms(probe_ms)) {
                    w.probe_finished(*s, true);
                }
                started.retain(|s| now < *s + ms(probe_ms));
            }
            let a = w.poll(now);
            if a == LeaseAction::ProbeCluster {
                started.push(now);
            }
            if a == kind {
                return Some(t);
            }
            t += 50;
        }
        None
    }

    #[test]
    fn nothing_is_held_on_a_lease_before_the_first_accepted_beacon() {
        let t0 = Instant::now();
        let mut w = LeaseWatch::new(ms(1500));
        assert_eq!(w.poll(t0 + Duration::from_secs(60)), LeaseAction::Nothing);
        assert!(!w.is_demoted());
    }

    #[test]
    fn cut_from_the_control_plane_and_the_cluster_demotes_at_the_lease_end() {
        let t0 = Instant::now();
        let mut w = LeaseWatch::new(ms(1500));
        w.beacon_accepted(t0);
        // Probes start at half the lease; none answers; demotion exactly at the lease's end.
        assert_eq!(w.poll(t0 + ms(700)), LeaseAction::Nothing);
        assert_eq!(w.poll(t0 + ms(750)), LeaseAction::ProbeCluster);
        let at = run_until(&mut w, t0, (800, 5000), false, 0, LeaseAction::Demote);
        assert_eq!(at, Some(1500));
        assert!(w.is_demoted());
        // Demoted once, not again while still cut.
        assert_eq!(
            run_until(&mut w, t0, (1550, 9000), false, 0, LeaseAction::Demote),
            None
        );
    }

    #[test]
    fn a_reachable_cluster_keeps_the_states_while_the_control_plane_is_away() {
        let t0 = Instant::now();
        let mut w = LeaseWatch::new(ms(1500));
        w.beacon_accepted(t0);
        assert_eq!(
            run_until(&mut w, t0, (0, 60_000), true, 5, LeaseAction::Demote),
            None
        );
        assert!(!w.is_demoted());
    }

    #[test]
    fn a_cluster_lost_later_demotes_within_half_a_lease_of_its_last_answer() {
        let t0 = Instant::now();
        let mut w = LeaseWatch::new(ms(1500));
        w.beacon_accepted(t0);
        assert_eq!(
            run_until(&mut w, t0, (0, 10_000), true, 5, LeaseAction::Demote),
            None
        );
        // From 10.05 s no probe answers; the last answered one started at <= 10 s.
        let at = run_until(&mut w, t0, (10_050, 20_000), false, 0, LeaseAction::Demote)
            .expect("demoted");
        assert!((10_050..=10_800).contains(&at), "demoted at {at} ms");
    }

    #[test]
    fn a_slow_probe_counts_only_if_it_answers_within_the_lease() {
        let t0 = Instant::now();
        let mut w = LeaseWatch::new(ms(1500));
        w.beacon_accepted(t0);
        // Each probe takes 900 ms: the one started at 750 ms answers at 1650 ms, too late.
        let at = run_until(&mut w, t0, (0, 5000), true, 900, LeaseAction::Demote);
        assert_eq!(at, Some(1500));
    }

    #[test]
    fn one_probe_at_a_time_and_not_more_often_than_a_quarter_lease() {
        let t0 = Instant::now();
        let mut w = LeaseWatch::new(ms(2000));
        w.beacon_accepted(t0);
        assert_eq!(w.poll(t0 + ms(1000)), LeaseAction::ProbeCluster);
        assert_eq!(
            w.poll(t0 + ms(1600)),
            LeaseAction::Nothing,
            "probe in flight"
        );
        w.probe_finished(t0 + ms(1000), true);
        assert_eq!(w.poll(t0 + ms(1700)), LeaseAction::ProbeCluster);
        w.probe_finished(t0 + ms(1700), true);
        assert_eq!(
            w.poll(t0 + ms(2100)),
            LeaseAction::Nothing,
            "a quarter lease apart"
        );
        assert_eq!(w.poll(t0 + ms(2200)), LeaseAction::ProbeCluster);
    }

    #[test]
    fn an_accepted_beacon_renews_the_lease_and_restores_after_a_demotion() {
        let t0 = Instant::now();
        let mut w = LeaseWatch::new(ms(1500));
        w.beacon_accepted(t0);
        assert_eq!(
            run_until(&mut w, t0, (0, 3000), false, 0, LeaseAction::Demote),
            Some(1500)
        );
        // An older beacon answered late does not renew.
        w.beacon_accepted(t0 - ms(10));
        assert_eq!(w.poll(t0 + ms(3000)), LeaseAction::Nothing);
        // A beacon sent at 2.9 s is accepted: restored once.
        w.beacon_accepted(t0 + ms(2900));
        assert_eq!(w.poll(t0 + ms(3000)), LeaseAction::Restore);
        assert!(!w.is_demoted());
        assert_eq!(w.poll(t0 + ms(3050)), LeaseAction::Nothing);
        // A beacon accepted late, sent long ago, does not restore.
        let mut w = LeaseWatch::new(ms(1500));
        w.beacon_accepted(t0);
        assert_eq!(
            run_until(&mut w, t0, (0, 3000), false, 0, LeaseAction::Demote),
            Some(1500)
        );
        w.beacon_accepted(t0 + ms(1000));
        assert_eq!(w.poll(t0 + ms(3000)), LeaseAction::Nothing);
        assert!(w.is_demoted());
    }

    #[test]
    fn a_gateway_thawed_past_its_lease_asks_the_cluster_before_demoting() {
        let t0 = Instant::now();
        let mut w = LeaseWatch::new(ms(1500));
        w.beacon_accepted(t0);
        // Frozen from 100 ms to 5 s: the first poll after it starts a probe.
        assert_eq!(w.poll(t0 + ms(100)), LeaseAction::Nothing);
        assert_eq!(w.poll(t0 + ms(5000)), LeaseAction::ProbeCluster);
        let mut cut = w.clone();
        // The cluster answers: the states stay.
        w.probe_finished(t0 + ms(5000), true);
        assert_eq!(
            run_until(&mut w, t0, (5050, 9000), true, 5, LeaseAction::Demote),
            None
        );
        // It does not: demoted once the probe had its quarter lease.
        assert_eq!(
            run_until(&mut cut, t0, (5050, 9000), false, 0, LeaseAction::Demote),
            Some(5400)
        );
    }

    #[test]
    fn the_leaders_grace_sets_the_lease_and_zero_keeps_it() {
        let mut w = LeaseWatch::default();
        assert_eq!(w.lease(), DEFAULT_LEASE);
        w.set_grace_ms(0);
        assert_eq!(w.lease(), DEFAULT_LEASE);
        w.set_grace_ms(1500);
        assert_eq!(w.lease(), ms(1500));
        let t0 = Instant::now();
        w.beacon_accepted(t0);
        assert_eq!(
            run_until(&mut w, t0, (0, 5000), false, 0, LeaseAction::Demote),
            Some(1500)
        );
    }
}
