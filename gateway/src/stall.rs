//! Whether this group gateway reaches the cluster, as it reports it in its beacons
//! (`Beacon.cluster`): deterministic, no I/O and no clock (times come in as arguments),
//! driven by the group agent (`group.rs`).
//!
//! Why: a gateway whose Ceph network fails while its link to the control plane does not
//! keeps beaconing, so the leader would see it alive and move nothing, while its commands wait
//! in librados (no OSD op timeout by default) until the host's I/O timeout. The lease
//! (`crate::lease`) does not help: beacons are accepted. So the gateway says it, and the
//! leader fails it over while another gateway reports the cluster reachable
//! (`control_plane::ana`).
//!
//! - **Stalled**: commands have been at the cluster for the stall window (half the leader's
//!   beacon grace, or `[group] stall_window_ms`) with none of them completing, no monitor
//!   probe (an osdmap refresh) has answered since then, and one failed or has been waiting
//!   for half the window. Both, so a slow OSD (the monitors answer) or a monitor election
//!   (commands complete) is not taken for a cut.
//! - **Reachable**: a command completed, or a probe answered, within two windows. An idle
//!   gateway probes once per window to keep saying so.
//! - **Unknown**: neither (an idle gateway before its first probe, or with no connection).
//!
//! Probes: one at a time, from half a window of commands stuck on, or once per window when
//! nothing else showed the cluster answering.
//!
//! **OSDs that do not answer** (reported apart: `Beacon.osds_unanswered`, the log, a metric):
//! commands stuck for the window while the monitors answer are either at a slow OSD or at one
//! this gateway cannot reach (its network reaches the monitors, not that OSD host). An OSD
//! probe (`rbd_backend::osd_probe`, at most one per window) tells which: the OSDs it names
//! did not answer. While some are named, a probe runs every window, stuck commands or not,
//! and only one that finds them all answering clears the report: commands completing through
//! other OSDs say nothing of these. The leader checks the OSDs itself before it acts on it
//! (`control_plane::osd_reports`). One command older than the window starts a probe too,
//! while the others complete (the devices count their ops by age, `rbd_backend::op_ages`):
//! a gateway cut off from one OSD of many is found that way, not only once all of its
//! commands wait.

use std::time::{Duration, Instant};

/// The stall window until the leader says its beacon grace: half the control plane's default
/// grace. With the grace known it is half of that ([`StallWatch::set_grace_ms`]), so a cut
/// gateway is reported and moved about when a frozen one would be.
pub const DEFAULT_WINDOW: Duration = Duration::from_millis(1_000);
/// The shortest window, whatever the grace: a few probe intervals. Also the least
/// `[group] stall_window_ms` takes.
pub const MIN_WINDOW: Duration = Duration::from_millis(400);
/// Probes start no more often than this.
const MIN_PROBE_INTERVAL: Duration = Duration::from_millis(100);

/// What the gateway reports in its beacons.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    Unknown,
    Reachable,
    Stalled,
}

/// What the agent must do after [`StallWatch::poll`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StallPoll {
    /// Start a monitor probe now; report it with [`StallWatch::probe_finished`] and the same
    /// start time.
    pub probe: bool,
    /// What is reported changed to this (send a beacon now).
    pub changed: Option<Reach>,
    /// Start an OSD probe now that waits this long for the OSDs' answers; report it with
    /// [`StallWatch::osd_probe_finished`] and the same start time.
    pub osd_probe: Option<Duration>,
}

#[derive(Debug, Clone)]
pub struct StallWatch {
    window: Duration,
    /// The window was configured (`[group] stall_window_ms`): the leader's grace leaves it.
    fixed: bool,
    /// The completed-ops total at the last poll (None: no poll yet).
    completed: Option<u64>,
    last_completion: Option<Instant>,
    /// Commands have been waiting since then with none completing (None: none waiting).
    stuck_since: Option<Instant>,
    probing: Option<Instant>,
    last_probe_start: Option<Instant>,
    /// When a probe last answered.
    probe_answered: Option<Instant>,
    /// When a probe last failed (or had no connection to ask).
    probe_failed: Option<Instant>,
    reach: Reach,
    osd_probing: Option<Instant>,
    last_osd_probe_start: Option<Instant>,
    /// The OSDs the last OSD probe found not answering, while commands stay stuck.
    osds_unanswered: Vec<i32>,
    /// A command has been at the cluster for the window or longer, whatever completed since
    /// ([`StallWatch::set_old_command`]).
    old_command: bool,
}

impl Default for StallWatch {
    fn default() -> Self {
        Self::new(DEFAULT_WINDOW)
    }
}

impl StallWatch {
    pub fn new(window: Duration) -> Self {
        Self {
            window,
            fixed: false,
            completed: None,
            last_completion: None,
            stuck_since: None,
            probing: None,
            last_probe_start: None,
            probe_answered: None,
            probe_failed: None,
            reach: Reach::Unknown,
            osd_probing: None,
            last_osd_probe_start: None,
            osds_unanswered: Vec::new(),
            old_command: false,
        }
    }

    /// Whether a command has been at the cluster for the window or longer (the devices'
    /// `has_op_older_than`), told before each [`Self::poll`]. Commands completing through
    /// other OSDs keep the gateway from being stuck as a whole; one such command alone asks
    /// the OSDs (at most once per window), so an OSD this gateway cannot reach is found
    /// while the rest of its I/O flows.
    pub fn set_old_command(&mut self, old: bool) {
        self.old_command = old;
    }

    pub fn reach(&self) -> Reach {
        self.reach
    }

    /// A window of its own (`[group] stall_window_ms`), which the leader's grace does not
    /// change: for a cluster whose monitors can be silent for a while (an election) while
    /// commands wait on a slow OSD, where half the grace would fail a gateway over that the
    /// cluster only kept waiting.
    pub fn with_fixed_window(window: Duration) -> Self {
        Self {
            fixed: true,
            ..Self::new(window)
        }
    }

    pub fn window(&self) -> Duration {
        self.window
    }

    /// The leader's beacon grace (`BeaconReply.grace_ms`; 0: not said, the window stays):
    /// the window becomes half of it, unless it was configured.
    pub fn set_grace_ms(&mut self, grace_ms: u64) {
        if grace_ms > 0 && !self.fixed {
            self.window = Duration::from_millis(grace_ms / 2).max(MIN_WINDOW);
        }
    }

    /// Looks at the commands now: `in_flight` at the cluster, `completed` the total ever
    /// completed (successfully or not).
    pub fn poll(&mut self, now: Instant, in_flight: usize, completed: u64) -> StallPoll {
        let progressed = self.completed.is_some_and(|c| c != completed);
        if progressed {
            self.last_completion = Some(now);
        }
        self.completed = Some(completed);
        if in_flight == 0 {
            self.stuck_since = None;
        } else if progressed || self.stuck_since.is_none() {
            self.stuck_since = Some(now);
        }
        let stuck = self.stuck_since.map(|t| now.saturating_duration_since(t));
        let evidence = self.last_completion.max(self.probe_answered);
        let wants_probe = stuck.is_some_and(|d| d >= self.window / 2)
            || evidence.is_none_or(|t| now.saturating_duration_since(t) >= self.window);
        let may_probe = self.probing.is_none()
            && self
                .last_probe_start
                .is_none_or(|t| now.saturating_duration_since(t) >= self.probe_interval(stuck));
        let probe = wants_probe && may_probe;
        if probe {
            self.probing = Some(now);
            self.last_probe_start = Some(now);
        }
        let osd_probe = self.wants_osd_probe(now).then_some(self.window / 2);
        if osd_probe.is_some() {
            self.osd_probing = Some(now);
            self.last_osd_probe_start = Some(now);
        }
        StallPoll {
            probe,
            changed: self.update(now),
            osd_probe,
        }
    }

    /// Commands stuck for the window while a monitor answered since they got stuck, a
    /// command older than the window while others complete, or OSDs named by the last
    /// probe; and no OSD probe in the last window. The probe waits half a window for the
    /// OSDs, so what it finds is reported about one and a half windows into a stall.
    fn wants_osd_probe(&self, now: Instant) -> bool {
        let since = |t: Instant| now.saturating_duration_since(t);
        let stuck_with_monitors_answering = self.stuck_since.is_some_and(|stuck| {
            since(stuck) >= self.window && self.probe_answered.is_some_and(|a| a >= stuck)
        });
        // Others completing within the window: the cluster answers this gateway, in part.
        // (Cut from it all, nothing completes: that is a stall, and the OSDs are not asked.)
        let old_command_among_completions = self.old_command
            && self.stuck_since.is_some()
            && self.last_completion.is_some_and(|t| since(t) < self.window);
        (stuck_with_monitors_answering
            || old_command_among_completions
            || !self.osds_unanswered.is_empty())
            && self.osd_probing.is_none()
            && self
                .last_osd_probe_start
                .is_none_or(|t| since(t) >= self.window)
    }

    /// The OSD probe started at `started` finished: `unanswered` the OSDs that did not
    /// answer it (None: it could not ask, e.g. no connection or the monitors stopped
    /// answering; the report stays). Returns the OSDs to report now if that changed.
    pub fn osd_probe_finished(
        &mut self,
        started: Instant,
        unanswered: Option<Vec<i32>>,
    ) -> Option<Vec<i32>> {
        if self.osd_probing == Some(started) {
            self.osd_probing = None;
        }
        self.set_osds_unanswered(unanswered?)
    }

    pub fn osds_unanswered(&self) -> &[i32] {
        &self.osds_unanswered
    }

    fn set_osds_unanswered(&mut self, osds: Vec<i32>) -> Option<Vec<i32>> {
        if osds == self.osds_unanswered {
            return None;
        }
        self.osds_unanswered = osds.clone();
        Some(osds)
    }

    /// The probe started at `started` finished: `answered` if a monitor answered it.
    pub fn probe_finished(
        &mut self,
        now: Instant,
        started: Instant,
        answered: bool,
    ) -> Option<Reach> {
        if self.probing == Some(started) {
            self.probing = None;
        }
        let newest = if answered {
            &mut self.probe_answered
        } else {
            &mut self.probe_failed
        };
        *newest = (*newest).max(Some(now));
        self.update(now)
    }

    /// Stuck commands ask again soon; otherwise once per window.
    fn probe_interval(&self, stuck: Option<Duration>) -> Duration {
        if stuck.is_some_and(|d| d >= self.window / 2) {
            (self.window / 4).max(MIN_PROBE_INTERVAL)
        } else {
            self.window
        }
    }

    fn update(&mut self, now: Instant) -> Option<Reach> {
        let since = |t: Instant| now.saturating_duration_since(t);
        let stalled = self.stuck_since.is_some_and(|stuck| {
            let unanswered_since_stuck = self.probe_answered.is_none_or(|a| a < stuck);
            // A probe from before the stall that still waits says even more.
            let probe_waited = self.probing.is_some_and(|p| since(p) >= self.window / 2);
            let probe_failed = self.probe_failed.is_some_and(|f| f >= stuck);
            since(stuck) >= self.window && unanswered_since_stuck && (probe_waited || probe_failed)
        });
        let fresh = |t: Option<Instant>| t.is_some_and(|t| since(t) <= self.window * 2);
        let reach = if stalled {
            Reach::Stalled
        } else if fresh(self.last_completion) || fresh(self.probe_answered) {
            Reach::Reachable
        } else {
            Reach::Unknown
        };
        if reach == self.reach {
            return None;
        }
        self.reach = reach;
        Some(reach)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Duration = DEFAULT_WINDOW;
    const TICK: Duration = Duration::from_millis(50);

    /// Polls every 50 ms for `d` with `in_flight` commands and the `completed` total, carrying
    /// out probes with `probe` (None: they never answer). Returns the changes reported.
    fn run(
        w: &mut StallWatch,
        clock: &mut Instant,
        d: Duration,
        in_flight: usize,
        completed: &mut dyn FnMut() -> u64,
        probe: Option<bool>,
    ) -> Vec<Reach> {
        let mut changes = Vec::new();
        let end = *clock + d;
        while *clock < end {
            *clock += TICK;
            let p = w.poll(*clock, in_flight, completed());
            changes.extend(p.changed);
            if p.probe {
                if let Some(answered) = probe {
                    changes.extend(w.probe_finished(*clock, *clock, answered));
                }
            }
        }
        changes
    }

    #[test]
    fn commands_stuck_with_the_monitors_silent_are_reported_stalled_after_the_window() {
        let mut w = StallWatch::default();
        let mut clock = Instant::now();
        let mut n = 0;
        // Busy and completing: reachable.
        let changes = run(
            &mut w,
            &mut clock,
            W,
            4,
            &mut || {
                n += 1;
                n
            },
            Some(true),
        );
        assert_eq!(changes, vec![Reach::Reachable]);
        // The cut: nothing completes, the probe hangs. Still reachable for the window...
        let cut = clock;
        assert!(run(&mut w, &mut clock, W - TICK, 4, &mut || n, None).is_empty());
        // ...then stalled.
        assert_eq!(
            run(&mut w, &mut clock, TICK * 2, 4, &mut || n, None),
            vec![Reach::Stalled]
        );
        assert!(clock.duration_since(cut) <= W + TICK * 2);
        // It stays so as long as nothing answers.
        assert!(run(&mut w, &mut clock, W * 10, 4, &mut || n, None).is_empty());
        // Healed: the stuck commands complete (with an error, blocklisted): reachable.
        assert_eq!(
            run(&mut w, &mut clock, TICK, 0, &mut || n + 4, None),
            vec![Reach::Reachable]
        );
    }

    #[test]
    fn a_configured_window_stays_whatever_the_leaders_grace() {
        let ms = Duration::from_millis;
        let mut w = StallWatch::with_fixed_window(ms(3_000));
        w.set_grace_ms(1_500);
        assert_eq!(w.window(), ms(3_000));
        // Stuck commands and silent monitors: still reachable at 2.9 s, stalled after 3 s.
        let mut clock = Instant::now();
        assert!(run(&mut w, &mut clock, ms(2_900), 4, &mut || 0, None).is_empty());
        assert_eq!(
            run(&mut w, &mut clock, ms(150), 4, &mut || 0, None),
            vec![Reach::Stalled]
        );
    }

    #[test]
    fn the_window_is_half_the_leaders_grace() {
        let mut w = StallWatch::default();
        w.set_grace_ms(0);
        assert_eq!(w.window(), DEFAULT_WINDOW);
        w.set_grace_ms(1_500);
        assert_eq!(w.window(), Duration::from_millis(750));
        w.set_grace_ms(100);
        assert_eq!(w.window(), MIN_WINDOW);
        // With a 1.5 s grace, stuck commands and silent monitors are a stall after 0.75 s.
        let mut w = StallWatch::default();
        w.set_grace_ms(1_500);
        let mut clock = Instant::now();
        let ms = Duration::from_millis;
        assert!(run(&mut w, &mut clock, ms(700), 4, &mut || 0, None).is_empty());
        assert_eq!(
            run(&mut w, &mut clock, ms(150), 4, &mut || 0, None),
            vec![Reach::Stalled]
        );
    }

    #[test]
    fn a_slow_osd_whose_monitors_answer_is_not_a_stall() {
        let mut w = StallWatch::default();
        let mut clock = Instant::now();
        let changes = run(&mut w, &mut clock, W * 10, 4, &mut || 0, Some(true));
        assert_eq!(changes, vec![Reach::Reachable]);
    }

    #[test]
    fn a_failed_probe_counts_as_unanswered() {
        let mut w = StallWatch::default();
        let mut clock = Instant::now();
        let changes = run(&mut w, &mut clock, W * 2, 4, &mut || 0, Some(false));
        assert_eq!(changes, vec![Reach::Stalled]);
    }

    #[test]
    fn monitors_silent_while_commands_complete_is_not_a_stall() {
        // A monitor election: the probe hangs, but the OSDs keep answering.
        let mut w = StallWatch::default();
        let mut clock = Instant::now();
        let mut n = 0;
        let changes = run(
            &mut w,
            &mut clock,
            W * 10,
            4,
            &mut || {
                n += 1;
                n
            },
            None,
        );
        assert_eq!(changes, vec![Reach::Reachable]);
    }

    #[test]
    fn an_idle_gateway_probes_once_per_window_and_says_reachable_or_unknown() {
        let mut w = StallWatch::default();
        let mut clock = Instant::now();
        let mut probes = 0;
        let end = clock + W * 10;
        let mut changes = Vec::new();
        while clock < end {
            clock += TICK;
            let p = w.poll(clock, 0, 0);
            changes.extend(p.changed);
            if p.probe {
                probes += 1;
                changes.extend(w.probe_finished(clock, clock, true));
            }
        }
        assert_eq!(changes, vec![Reach::Reachable]);
        assert!((9..=11).contains(&probes), "{probes} probes in 10 windows");
        // The probes stop answering (no connection left): unknown after two windows, never
        // stalled without commands waiting.
        let changes = run(&mut w, &mut clock, W * 3, 0, &mut || 0, Some(false));
        assert_eq!(changes, vec![Reach::Unknown]);
    }

    #[test]
    fn a_probe_hanging_from_before_the_stall_counts_and_its_late_answer_clears_it() {
        let mut w = StallWatch::default();
        let mut clock = Instant::now();
        // An idle probe is in flight when commands arrive and stop completing.
        let p = w.poll(clock, 0, 0);
        assert!(p.probe);
        let early = clock;
        clock += TICK;
        w.poll(clock, 4, 0);
        // One probe at a time: the early one is the only one, and it does not answer.
        assert_eq!(
            run(&mut w, &mut clock, W * 2, 4, &mut || 0, None),
            vec![Reach::Stalled]
        );
        // It answers at last: the monitors reach this gateway again.
        assert_eq!(w.probe_finished(clock, early, true), Some(Reach::Reachable));
    }

    /// Polls every 50 ms for `d` with `in_flight` commands and the `completed` total, the
    /// monitors answering every probe; OSD probes are started and left waiting. Returns the
    /// start of each OSD probe.
    fn osd_probes_started(
        w: &mut StallWatch,
        clock: &mut Instant,
        d: Duration,
        in_flight: usize,
        completed: u64,
    ) -> Vec<Instant> {
        let mut started = Vec::new();
        let end = *clock + d;
        while *clock < end {
            *clock += TICK;
            let p = w.poll(*clock, in_flight, completed);
            if p.probe {
                w.probe_finished(*clock, *clock, true);
            }
            if let Some(wait) = p.osd_probe {
                assert_eq!(wait, w.window() / 2);
                started.push(*clock);
            }
        }
        started
    }

    #[test]
    fn commands_stuck_with_the_monitors_answering_start_one_osd_probe_after_the_window() {
        let mut w = StallWatch::default();
        let mut clock = Instant::now();
        let stuck = clock + TICK;
        // Stuck for the window, less a tick: no OSD probe yet.
        assert!(osd_probes_started(&mut w, &mut clock, W - TICK, 4, 0).is_empty());
        // Then one, and no second while it waits, however long.
        let started = osd_probes_started(&mut w, &mut clock, W * 5, 4, 0);
        assert_eq!(started.len(), 1, "{started:?}");
        assert!(started[0] - stuck >= W, "after the window");
        assert_eq!(w.reach(), Reach::Reachable, "the monitors answer: no stall");
        // It names osd.3: reported once.
        assert_eq!(
            w.osd_probe_finished(started[0], Some(vec![3])),
            Some(vec![3])
        );
        assert_eq!(w.osds_unanswered(), &[3]);
        // The next one comes a window after the first started (already due), and finding
        // the same reports nothing new.
        let next = osd_probes_started(&mut w, &mut clock, TICK, 4, 0);
        assert_eq!(next.len(), 1);
        assert_eq!(w.osd_probe_finished(next[0], Some(vec![3])), None);
        // One that could not ask (None) changes nothing.
        let next = osd_probes_started(&mut w, &mut clock, W, 4, 0);
        assert_eq!(next.len(), 1);
        assert_eq!(w.osd_probe_finished(next[0], None), None);
        assert_eq!(w.osds_unanswered(), &[3]);
        // All answer now (a slow OSD after all): cleared.
        let next = osd_probes_started(&mut w, &mut clock, W, 4, 0);
        assert_eq!(w.osd_probe_finished(next[0], Some(vec![])), Some(vec![]));
    }

    #[test]
    fn named_osds_are_probed_every_window_until_a_probe_finds_them_answering() {
        let mut w = StallWatch::default();
        let mut clock = Instant::now();
        let started = osd_probes_started(&mut w, &mut clock, W * 2, 4, 0);
        assert_eq!(
            w.osd_probe_finished(started[0], Some(vec![1, 2])),
            Some(vec![1, 2])
        );
        // Commands complete (through other OSDs), then none wait: the report stays, and
        // the OSDs are asked again every window.
        let started = osd_probes_started(&mut w, &mut clock, W * 2, 4, 1);
        assert!(!started.is_empty());
        assert_eq!(
            w.osd_probe_finished(started[0], Some(vec![2])),
            Some(vec![2])
        );
        let mut probes = 0;
        let end = clock + W * 3;
        while clock < end {
            clock += TICK;
            if let Some(_wait) = w.poll(clock, 0, 1).osd_probe {
                probes += 1;
                assert_eq!(w.osd_probe_finished(clock, Some(vec![2])), None);
            }
        }
        assert_eq!(probes, 3, "one per window, none waiting");
        assert_eq!(w.osds_unanswered(), &[2]);
        // All answer: cleared, and an idle gateway stops asking.
        let started = osd_probes_started(&mut w, &mut clock, W, 0, 1);
        assert_eq!(w.osd_probe_finished(started[0], Some(vec![])), Some(vec![]));
        assert!(osd_probes_started(&mut w, &mut clock, W * 3, 0, 1).is_empty());
    }

    #[test]
    fn one_old_command_among_completing_ones_starts_an_osd_probe_once_per_window() {
        let mut w = StallWatch::default();
        let mut clock = Instant::now();
        // Commands complete all along (through the OSDs that answer), none is old yet.
        assert!(osd_probes_started_completing(&mut w, &mut clock, 3 * W).is_empty());
        // One has waited for the window: an OSD probe, then one per window at most.
        w.set_old_command(true);
        let started = osd_probes_started_completing(&mut w, &mut clock, 3 * W);
        assert_eq!(started.len(), 3, "one probe per window: {started:?}");
        // Nothing in flight: an old command cannot be.
        assert!(osd_probes_started(&mut w, &mut clock, 2 * W, 0, 0).is_empty());
    }

    /// [`osd_probes_started`] with a command completing at every poll.
    fn osd_probes_started_completing(
        w: &mut StallWatch,
        clock: &mut Instant,
        d: Duration,
    ) -> Vec<Instant> {
        let mut started = Vec::new();
        let end = *clock + d;
        let mut done = 1_000;
        while *clock < end {
            *clock += TICK;
            done += 1;
            if let Some(_wait) = w.poll(*clock, 4, done).osd_probe {
                w.osd_probe_finished(*clock, Some(Vec::new()));
                started.push(*clock);
            }
        }
        started
    }

    #[test]
    fn no_osd_probe_while_the_monitors_do_not_answer_either() {
        // A cut from the whole cluster is a stall (beaconed); the OSDs are not asked, though
        // a command soon is older than the window.
        let mut w = StallWatch::default();
        let mut clock = Instant::now();
        let end = clock + W * 5;
        while clock < end {
            clock += TICK;
            w.set_old_command(w.stuck_since.is_some_and(|t| clock - t >= W));
            let p = w.poll(clock, 4, 0);
            assert_eq!(p.osd_probe, None);
            if p.probe {
                w.probe_finished(clock, clock, false);
            }
        }
        assert_eq!(w.reach(), Reach::Stalled);
    }
}
