//! Busy polling of an NVMe/TCP queue's socket (`[gateway] tcp_busy_poll_us`), and the
//! adaptive choice of whether to poll at all (`[gateway] tcp_busy_poll_adaptive`).
//!
//! Polling takes away a wake-up per command: after a command came in, the task does not
//! sleep in epoll but keeps asking the socket for the next one (see [`poll_socket`]). Where
//! an idle vCPU halts and every wake-up is a VM exit, that is most of what NVMe/TCP adds at
//! QD1. Where a wake-up is cheap (the guest halt-polls, bare metal), it loses: the CPU it
//! spins is one the librbd and OSD threads lack (README, Performance: memstore QD1 reads
//! 1.42x direct librbd with polling against 0.90x without on one machine, 0.69x against
//! 0.95x on the same machine with guest halt polling on). Which case a gateway is in is a
//! property of the machine, the cluster and the load, so [`Chooser`] measures it: it runs
//! the queue in epochs, one mode each, compares the median time between the host's
//! commands, and keeps the faster mode, trying the other one epoch in
//! [`EPOCHS_BETWEEN_PROBES`] + 1 (no sooner than [`MIN_PROBE_SPACING`] after the last try)
//! and switching when it wins [`WINS_TO_SWITCH`] probes in a row. Polling has to win by
//! [`POLL_MARGIN`] to be chosen, because it costs a CPU.
//!
//! A window opens when the host's bytes came in, and when a completion that the device
//! finished later, on its own thread (an RBD op outlasts a window), leaves the queue at low
//! depth: the host's next command follows its response, and without that window the task
//! would be asleep in epoll when it comes. On by default (adaptive, a 50 µs window,
//! `config::DEFAULT_TCP_BUSY_POLL_US`): a queue whose host sends nothing spins nothing, and
//! a queue spins at most a window per read that brought bytes and per completion.

use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

/// Busy polling only while at most this many commands of the queue are at the device. Deeper
/// queues are woken for batches (a wake-up is shared by many commands), and on a saturated
/// machine the CPU a poll spins is what librbd and the OSDs need: polling at QD16 cost 0.2x
/// of the IOPS on a 2-core machine.
pub const MAX_IN_FLIGHT: usize = 2;
/// Commands a measuring epoch takes: enough for a median that the odd slow op does not move,
/// few enough that a wrong mode costs little (128 QD1 reads: 10-40 ms here).
const EPOCH_SAMPLES: usize = 128;
/// Epochs in the chosen mode before the other one is measured again: the price of checking
/// is one epoch in this many + 1 spent in the (so far) slower mode. At 15, a QD1 queue that
/// chose polling took ~6% of its reads through wake-ups (the sleeping probe epochs); at 63,
/// 3-4%, and its IOPS went from ~0.81 to ~0.90 of the polling target (docs/performance.md,
/// "Adaptive against always polling"). The price: a change is followed 4x later. An epoch of
/// RBD ops at ~0.5 ms lasts ~64 ms (a switch, two winning probes, within ~8 s); of in-memory
/// QD1 reads a few ms, where [`MIN_PROBE_SPACING`] sets the pace instead.
pub const EPOCHS_BETWEEN_PROBES: u32 = 63;
/// The least time from the end of one probe to the start of the next (besides
/// [`EPOCHS_BETWEEN_PROBES`]). Where epochs are short, counting epochs alone probed several
/// times a second: a QD1 queue of in-memory reads (~3 ms epochs) that chose polling still
/// took 1.5% of its reads through wake-ups, 60% of the reads it saw more than 5 µs late
/// (docs/performance.md, "Where a QD1 read's cycle goes"). At 0.5 s that queue probes
/// once in ~170 epochs and follows a change within ~1 s; slower queues are unchanged.
pub const MIN_PROBE_SPACING: Duration = Duration::from_millis(500);
/// How much faster polling must be to be chosen (its median at most 1/(1 + this) of
/// sleeping's): it costs a CPU, so a draw goes to sleeping.
pub const POLL_MARGIN: f64 = 0.05;
/// Probes in a row the other mode must win before a settled queue switches to it. Epoch
/// medians of one mode vary by several % on a shared machine, so one lucky probe would
/// switch a queue to the slower mode for [`EPOCHS_BETWEEN_PROBES`] epochs: with a single
/// win, a queue where polling was slower (no cpuidle driver, QD1 reads: 0.84x direct librbd
/// always polling, 0.90x never) still chose polling after 14% of its epochs. The
/// confirming probe comes after one more epoch of the chosen mode, so each win is against
/// a fresh median of it.
pub const WINS_TO_SWITCH: u32 = 2;

/// `[gateway] tcp_busy_poll_us` and `tcp_busy_poll_adaptive`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BusyPollConfig {
    /// How long after a command the task polls.
    pub window: Duration,
    /// Poll only while it is measured to be faster (see the module docs); `false`: always.
    pub adaptive: bool,
}

/// How a queue waits for its host's next command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Poll,
    Sleep,
}

impl Mode {
    fn other(self) -> Mode {
        match self {
            Mode::Poll => Mode::Sleep,
            Mode::Sleep => Mode::Poll,
        }
    }
}

/// Decides, per queue, whether to poll: measures both modes in turn and keeps the faster.
///
/// A sample is the time between two commands that came in while the queue had at most
/// [`MAX_IN_FLIGHT`] at the device (the only time polling happens): at low depth that is
/// the cycle the host sees, device, gateway and both wake-ups. A command the host sent more
/// than `idle_gap` after the response it follows is the host pausing, not a cycle, and its
/// gap is not counted. The device's time is not the host's: an op longer than `idle_gap`
/// (a QD1 op on a real cluster, 0.2-2 ms and more) followed at once by the next command is
/// a cycle. Pure: time is given, so it is tested without a socket.
#[derive(Debug)]
pub struct Chooser {
    adaptive: bool,
    idle_gap: Duration,
    /// The mode a settled queue runs in; the first epochs try both.
    chosen: Mode,
    /// The mode of the epoch being measured.
    measuring: Mode,
    /// Epochs in `chosen` since the other mode was last measured; `None`: still trying both.
    epochs_since_probe: Option<u32>,
    /// Probes in a row the other mode has won (see [`WINS_TO_SWITCH`]).
    other_wins: u32,
    /// When the last probe (or the first try of both modes) ended: the next waits
    /// [`MIN_PROBE_SPACING`] from here.
    last_probe_end: Option<Instant>,
    samples: Vec<Duration>,
    last_arrival: Option<Instant>,
    /// The latest epoch median of each mode.
    poll_median: Option<Duration>,
    sleep_median: Option<Duration>,
}

/// What an epoch's end decided (for counters and logs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub chosen: Mode,
    pub switched: bool,
    pub poll_median: Duration,
    pub sleep_median: Duration,
}

impl Chooser {
    pub fn new(config: BusyPollConfig) -> Self {
        Self {
            adaptive: config.adaptive,
            idle_gap: (config.window * 10).max(Duration::from_millis(1)),
            chosen: Mode::Poll,
            measuring: Mode::Poll,
            epochs_since_probe: None,
            other_wins: 0,
            last_probe_end: None,
            samples: Vec::with_capacity(EPOCH_SAMPLES),
            last_arrival: None,
            poll_median: None,
            sleep_median: None,
        }
    }

    /// Whether the queue polls after the command that just came in.
    pub fn polls(&self) -> bool {
        !self.adaptive || self.measuring == Mode::Poll
    }

    /// Commands came in at `now`; `low_depth`: the queue has at most [`MAX_IN_FLIGHT`] at
    /// the device with them; `last_response`: when the queue last answered a command that a
    /// device completed after it came in (on the device's thread, or handed to the task),
    /// if it ever did. Returns the decision when this ended an epoch.
    pub fn on_commands(
        &mut self,
        now: Instant,
        low_depth: bool,
        last_response: Option<Instant>,
    ) -> Option<Decision> {
        if !self.adaptive {
            return None;
        }
        let previous = self.last_arrival.replace(now);
        if !low_depth {
            // A deep queue never polls, so its cycles say nothing about polling; the next
            // low-depth gap starts from here.
            self.last_arrival = None;
            return None;
        }
        let previous = previous?;
        let gap = now.saturating_duration_since(previous);
        // How long the host took to send this: since a response that went out after the
        // previous command came in, or else (the response went out as that command was
        // read, an op the device completed at once) the whole gap.
        let host_took = match last_response {
            Some(response) if response > previous => now.saturating_duration_since(response),
            _ => gap,
        };
        if host_took > self.idle_gap {
            return None;
        }
        self.samples.push(gap);
        if self.samples.len() < EPOCH_SAMPLES {
            return None;
        }
        Some(self.end_epoch(now))
    }

    fn end_epoch(&mut self, now: Instant) -> Decision {
        let median = median(&mut self.samples);
        self.samples.clear();
        // The first gap of an epoch spans the switch of mode: not one of its cycles.
        self.last_arrival = None;
        match self.measuring {
            Mode::Poll => self.poll_median = Some(median),
            Mode::Sleep => self.sleep_median = Some(median),
        }
        let before = self.chosen;
        let (poll, sleep) = (self.poll_median, self.sleep_median);
        if let (Some(poll), Some(sleep)) = (poll, sleep) {
            let faster = if poll.as_secs_f64() * (1.0 + POLL_MARGIN) < sleep.as_secs_f64() {
                Mode::Poll
            } else {
                Mode::Sleep
            };
            match self.epochs_since_probe.as_mut() {
                // The first try of both modes: take the faster at once.
                None => {
                    self.chosen = faster;
                    self.epochs_since_probe = Some(0);
                    self.last_probe_end = Some(now);
                }
                // A probe of the other mode ended.
                Some(n) if self.measuring != self.chosen => {
                    *n = 0;
                    self.last_probe_end = Some(now);
                    if faster == self.measuring {
                        self.other_wins += 1;
                        if self.other_wins >= WINS_TO_SWITCH {
                            self.chosen = self.measuring;
                            self.other_wins = 0;
                        }
                    } else {
                        self.other_wins = 0;
                    }
                }
                Some(n) => *n += 1,
            }
        }
        self.measuring = match self.epochs_since_probe {
            // Trying both: poll first, then sleep.
            None => self.measuring.other(),
            // Confirming a win: after one fresh epoch of the chosen mode.
            Some(n) if self.other_wins > 0 && n >= 1 => self.chosen.other(),
            Some(n)
                if n >= EPOCHS_BETWEEN_PROBES
                    && self.last_probe_end.is_none_or(|end| {
                        now.saturating_duration_since(end) >= MIN_PROBE_SPACING
                    }) =>
            {
                self.chosen.other()
            }
            Some(_) => self.chosen,
        };
        Decision {
            chosen: self.chosen,
            switched: self.chosen != before,
            poll_median: poll.unwrap_or_default(),
            sleep_median: sleep.unwrap_or_default(),
        }
    }
}

fn median(samples: &mut [Duration]) -> Duration {
    let mid = samples.len() / 2;
    *samples.select_nth_unstable(mid).1
}

/// Bytes a polling probe reads at once: a command capsule with the largest in-capsule data
/// (8 KiB, `IN_CAPSULE_DATA_SIZE`), its header and digests. A larger PDU is read on from
/// the socket into the receive buffer.
pub const PROBE_BYTES: usize = 8192 + 128;

/// How busy polling ended.
pub enum Polled {
    /// The socket was readable: the probe read this many bytes into its buffer (0: the host
    /// closed), or the read failed.
    Read(std::io::Result<usize>),
    /// The window closed: back to sleeping in epoll.
    Expired,
}

/// Polls the socket until it has bytes, which it reads into `buf`, or until `until` passes.
/// The probe is a read, not a peek followed by a read: when the host's command is there, it
/// is taken with one system call (the peek cost one more per command).
pub async fn poll_socket(probe: &OwnedFd, buf: &mut [u8], until: Instant) -> Polled {
    poll_until(until, || {
        match rustix::net::recv(probe, &mut *buf, rustix::net::RecvFlags::DONTWAIT) {
            Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => None,
            Ok((n, _)) => Some(Polled::Read(Ok(n))),
            Err(e) => Some(Polled::Read(Err(e.into()))),
        }
    })
    .await
}

/// Calls `probe` until it has an outcome or `until` passes. Between two probes it calls
/// `sched_yield` and yields to the runtime.
///
/// Why both, every probe:
/// - `sched_yield`: a thread that shares this CPU (a librbd or OSD thread, a host on the
///   same machine) runs now instead of at the next tick. Without it a QD1 queue sharing its
///   CPU with its host lost 13-23% (docs/performance.md).
/// - The runtime: the worker's other tasks, and the sockets that became readable for them
///   (a yielding worker with nothing else to run polls its I/O driver without waiting), get
///   in between two probes, as an SPDK poller serves every socket of its group. Yielding
///   only every 20 µs, four queues at QD1 on one worker made 0.52x the IOPS of never
///   polling: each queue's commands waited for the others' polling slices (docs/
///   performance.md, "Several queues at low depth on one worker").
async fn poll_until(until: Instant, mut probe: impl FnMut() -> Option<Polled>) -> Polled {
    loop {
        if let Some(outcome) = probe() {
            return outcome;
        }
        if Instant::now() >= until {
            return Polled::Expired;
        }
        std::thread::yield_now();
        tokio::task::yield_now().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;

    const WINDOW: Duration = Duration::from_micros(1000);

    /// Another queue's task on the same worker gets a turn between every two probes of a
    /// polling one: with turns only every 20 µs, several queues at low depth on one worker
    /// waited for each other's polling (0.52x the IOPS of never polling, four at QD1).
    #[tokio::test]
    async fn a_polling_queue_lets_the_worker_s_other_tasks_run_between_its_probes() {
        let (turns, done) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let other = tokio::spawn({
            let (turns, done) = (turns.clone(), done.clone());
            async move {
                while !done.load(Ordering::Relaxed) {
                    turns.fetch_add(1, Ordering::Relaxed);
                    tokio::task::yield_now().await;
                }
            }
        });
        // The other task starts first, so it has run once before the first probe.
        tokio::task::yield_now().await;
        let mut probes = 0u64;
        let outcome = poll_until(Instant::now() + Duration::from_millis(5), || {
            probes += 1;
            None
        })
        .await;
        assert!(matches!(outcome, Polled::Expired));
        done.store(true, Ordering::Relaxed);
        other.await.expect("the other task");
        let turns = turns.load(Ordering::Relaxed);
        assert!(probes > 10, "{probes} probes in 5 ms");
        assert!(
            turns + 1 >= probes,
            "the other task ran {turns} times during {probes} probes"
        );
    }

    #[tokio::test]
    async fn polling_ends_with_the_probe_s_outcome_or_the_window() {
        let mut left = 3;
        let outcome = poll_until(Instant::now() + Duration::from_secs(60), || {
            left -= 1;
            (left == 0).then_some(Polled::Read(Ok(7)))
        })
        .await;
        assert!(matches!(outcome, Polled::Read(Ok(7))));
        let outcome = poll_until(Instant::now(), || None).await;
        assert!(matches!(outcome, Polled::Expired));
    }

    fn adaptive() -> Chooser {
        Chooser::new(BusyPollConfig {
            window: WINDOW,
            adaptive: true,
        })
    }

    /// Feeds one epoch of commands `cycle` apart (plus the one that starts the epoch's
    /// first gap), as a QD1 host would send them; returns the decision that ended it.
    fn run_epoch(chooser: &mut Chooser, clock: &mut Instant, cycle: Duration) -> Decision {
        assert_eq!(
            chooser.on_commands(*clock, true, None),
            None,
            "an epoch starts"
        );
        for _ in 0..EPOCH_SAMPLES {
            *clock += cycle;
            if let Some(decision) = chooser.on_commands(*clock, true, None) {
                return decision;
            }
        }
        panic!("an epoch of {EPOCH_SAMPLES} gaps did not end");
    }

    /// Runs epochs whose cycle depends on the mode measured, until `epochs` have ended.
    fn run(
        chooser: &mut Chooser,
        epochs: usize,
        poll: Duration,
        sleep: Duration,
    ) -> Vec<(Mode, Decision)> {
        let mut clock = Instant::now();
        (0..epochs)
            .map(|_| {
                let mode = if chooser.polls() {
                    Mode::Poll
                } else {
                    Mode::Sleep
                };
                let cycle = if mode == Mode::Poll { poll } else { sleep };
                (mode, run_epoch(chooser, &mut clock, cycle))
            })
            .collect()
    }

    const FAST: Duration = Duration::from_micros(70);
    const SLOW: Duration = Duration::from_micros(100);

    #[test]
    fn polling_is_kept_where_it_is_faster_and_the_other_mode_rechecked_once_a_period() {
        const PERIOD: usize = EPOCHS_BETWEEN_PROBES as usize + 1;
        let mut chooser = adaptive();
        let epochs = run(&mut chooser, 2 + PERIOD * 2, FAST, SLOW);
        assert_eq!(epochs[0].0, Mode::Poll, "tries polling first");
        assert_eq!(epochs[1].0, Mode::Sleep, "then sleeping");
        for (_, decision) in &epochs[1..] {
            assert_eq!(decision.chosen, Mode::Poll);
        }
        let slept: Vec<usize> = (0..epochs.len())
            .filter(|&i| epochs[i].0 == Mode::Sleep)
            .collect();
        assert_eq!(
            slept,
            [1, 1 + PERIOD, 1 + 2 * PERIOD],
            "probes once a period"
        );
        assert_eq!(epochs[1].1.poll_median, FAST);
        assert_eq!(epochs[1].1.sleep_median, SLOW);
    }

    #[test]
    fn where_epochs_are_short_probes_wait_the_least_spacing() {
        // 10 µs cycles polling (an epoch lasts ~1.3 ms, 63 of them ~81 ms), 20 µs sleeping.
        const QUICK: Duration = Duration::from_micros(10);
        let epoch_of = |cycle: Duration| cycle * EPOCH_SAMPLES as u32;
        let mut chooser = adaptive();
        let mut clock = Instant::now();
        let start = clock;
        // (start, end) of every sleeping epoch after the first try of both modes.
        let mut probes = Vec::new();
        let mut epochs = 0;
        while clock.duration_since(start) < MIN_PROBE_SPACING * 3 {
            let polls = chooser.polls();
            let begun = clock;
            let decision = run_epoch(
                &mut chooser,
                &mut clock,
                if polls { QUICK } else { QUICK * 2 },
            );
            assert_eq!(decision.chosen, Mode::Poll);
            if !polls && epochs > 1 {
                probes.push((begun, clock));
            }
            epochs += 1;
        }
        assert!(
            epochs > 3 * EPOCHS_BETWEEN_PROBES as usize,
            "enough epochs for 3 probes by count: {epochs}"
        );
        assert_eq!(probes.len(), 2, "one probe per spacing, not per 64 epochs");
        // The first try of both modes ended after its sleeping epoch (the second).
        let first_try_end = start + epoch_of(QUICK) + epoch_of(QUICK * 2);
        let mut last_end = first_try_end;
        for (begun, end) in probes {
            let waited = begun.duration_since(last_end);
            assert!(
                waited >= MIN_PROBE_SPACING && waited <= MIN_PROBE_SPACING + epoch_of(QUICK),
                "a probe starts with the first epoch after the spacing: waited {waited:?}"
            );
            last_end = end;
        }
    }

    #[test]
    fn polling_stops_where_it_loses_and_comes_back_when_it_wins_again() {
        let mut chooser = adaptive();
        let epochs = run(&mut chooser, 2, SLOW, FAST);
        assert_eq!(epochs[1].1.chosen, Mode::Sleep);
        assert!(epochs[1].1.switched, "from polling, the first try");
        assert!(!chooser.polls());
        // Conditions change (wake-ups got expensive): the next probe sees it, and after
        // one more epoch of sleeping, a second probe confirms it.
        let n = EPOCHS_BETWEEN_PROBES as usize;
        let epochs = run(&mut chooser, n + 3, FAST, SLOW);
        assert!(epochs[..n].iter().all(|(mode, _)| *mode == Mode::Sleep));
        assert_eq!(epochs[n].0, Mode::Poll, "the probe");
        assert_eq!(epochs[n].1.chosen, Mode::Sleep, "one win does not switch");
        assert_eq!(
            epochs[n + 1].0,
            Mode::Sleep,
            "a fresh epoch of the chosen mode"
        );
        assert_eq!(epochs[n + 2].0, Mode::Poll, "the confirming probe");
        assert_eq!(epochs[n + 2].1.chosen, Mode::Poll);
        assert!(epochs[n + 2].1.switched);
        assert!(chooser.polls());
    }

    #[test]
    fn one_lucky_probe_does_not_switch_a_settled_queue() {
        let mut chooser = adaptive();
        let mut clock = Instant::now();
        // Polling is slower: the queue settles on sleeping.
        run_epoch(&mut chooser, &mut clock, SLOW);
        let decision = run_epoch(&mut chooser, &mut clock, FAST);
        assert_eq!(decision.chosen, Mode::Sleep);
        for _ in 0..EPOCHS_BETWEEN_PROBES {
            assert!(!chooser.polls());
            run_epoch(&mut chooser, &mut clock, FAST);
        }
        // The probe happens to run while the machine is quiet: polling wins it.
        assert!(chooser.polls(), "the probe");
        let decision = run_epoch(&mut chooser, &mut clock, FAST.mul_f64(0.5));
        assert_eq!(decision.chosen, Mode::Sleep);
        assert!(!decision.switched);
        assert!(!chooser.polls(), "a fresh epoch of sleeping first");
        run_epoch(&mut chooser, &mut clock, FAST);
        // The confirming probe sees polling as it is: the queue stays asleep and waits a
        // whole period for the next probe.
        assert!(chooser.polls(), "the confirming probe");
        let decision = run_epoch(&mut chooser, &mut clock, SLOW);
        assert_eq!(decision.chosen, Mode::Sleep);
        for _ in 0..EPOCHS_BETWEEN_PROBES {
            assert!(!chooser.polls());
            run_epoch(&mut chooser, &mut clock, FAST);
        }
        assert!(chooser.polls());
    }

    #[test]
    fn a_draw_goes_to_sleeping_because_polling_costs_a_cpu() {
        let mut chooser = adaptive();
        let nearly = SLOW.mul_f64(1.0 / (1.0 + POLL_MARGIN / 2.0));
        let epochs = run(&mut chooser, 2, nearly, SLOW);
        assert_eq!(epochs[1].1.chosen, Mode::Sleep);
        let mut chooser = adaptive();
        let clearly = SLOW.mul_f64(1.0 / (1.0 + POLL_MARGIN * 2.0));
        let epochs = run(&mut chooser, 2, clearly, SLOW);
        assert_eq!(epochs[1].1.chosen, Mode::Poll);
    }

    #[test]
    fn the_median_ignores_the_odd_slow_op_and_idle_gaps_are_not_cycles() {
        let mut chooser = adaptive();
        let mut clock = Instant::now();
        assert_eq!(chooser.on_commands(clock, true, None), None);
        let mut decision = None;
        for i in 0..EPOCH_SAMPLES + 10 {
            // A few slow ops (a tenth of them), and the host pausing for a second twice.
            let gap = match i {
                7 | 40 => Duration::from_secs(1),
                _ if i % 10 == 0 => Duration::from_micros(900),
                _ => FAST,
            };
            clock += gap;
            if let Some(d) = chooser.on_commands(clock, true, None) {
                decision = Some((i, d));
                break;
            }
        }
        let (i, decision) = decision.expect("the epoch ends");
        assert_eq!(i, EPOCH_SAMPLES + 1, "the two idle gaps were not samples");
        assert_eq!(decision.poll_median, FAST);
    }

    /// Commands `device + host` apart: each op takes `device` at the device and completes
    /// on the device's thread, and the host sends the next command `host` after that
    /// response. Returns the index of the command whose gap ended the epoch, if one did.
    fn feed_async_ops(
        chooser: &mut Chooser,
        clock: &mut Instant,
        commands: usize,
        device: impl Fn(usize) -> Duration,
        host: impl Fn(usize) -> Duration,
    ) -> Option<(usize, Decision)> {
        let mut last_response = None;
        for i in 0..commands {
            if let Some(decision) = chooser.on_commands(*clock, true, last_response) {
                return Some((i, decision));
            }
            *clock += device(i);
            last_response = Some(*clock);
            *clock += host(i);
        }
        None
    }

    #[test]
    fn ops_longer_than_the_idle_gap_are_cycles_when_the_host_answers_at_once() {
        // The tests' window makes the idle gap 10 ms; these ops take 20 ms (a slow cluster)
        // and the host sends its next command 30 µs after each response.
        let op = Duration::from_millis(20);
        let turnaround = Duration::from_micros(30);
        let mut chooser = adaptive();
        let mut clock = Instant::now();
        let (i, decision) = feed_async_ops(
            &mut chooser,
            &mut clock,
            EPOCH_SAMPLES + 1,
            |_| op,
            |_| turnaround,
        )
        .expect("the epoch ends");
        assert_eq!(i, EPOCH_SAMPLES, "every gap was a sample");
        assert_eq!(decision.poll_median, op + turnaround);
        // Known only by their gaps (no response time), the same commands look like a host
        // that pauses between them: nothing is measured.
        let mut chooser = adaptive();
        for _ in 0..EPOCH_SAMPLES * 2 {
            clock += op + turnaround;
            assert_eq!(chooser.on_commands(clock, true, None), None);
        }
        assert!(chooser.samples.is_empty());
    }

    #[test]
    fn a_host_pausing_after_a_response_is_not_a_cycle() {
        let op = Duration::from_millis(2);
        let mut chooser = adaptive();
        let mut clock = Instant::now();
        // The host waits a second after two of the responses.
        let (i, decision) = feed_async_ops(
            &mut chooser,
            &mut clock,
            EPOCH_SAMPLES + 10,
            |_| op,
            |i| match i {
                7 | 40 => Duration::from_secs(1),
                _ => FAST,
            },
        )
        .expect("the epoch ends");
        assert_eq!(i, EPOCH_SAMPLES + 2, "the two pauses were not samples");
        assert_eq!(decision.poll_median, op + FAST);
        // A response from before the previous command (that command went out with
        // another still at the device) says nothing of this gap: the gap itself decides.
        let mut chooser = adaptive();
        let mut clock = Instant::now();
        let stale = Some(clock);
        clock += FAST;
        assert_eq!(chooser.on_commands(clock, true, stale), None);
        clock += Duration::from_secs(1);
        assert_eq!(chooser.on_commands(clock, true, stale), None);
        assert!(chooser.samples.is_empty(), "a 1 s gap is a pause");
        clock += FAST;
        assert_eq!(chooser.on_commands(clock, true, stale), None);
        assert_eq!(chooser.samples, [FAST]);
    }

    #[test]
    fn deep_queues_are_not_measured() {
        let mut chooser = adaptive();
        let mut clock = Instant::now();
        for _ in 0..EPOCH_SAMPLES * 4 {
            clock += FAST;
            assert_eq!(chooser.on_commands(clock, false, None), None);
        }
        assert!(chooser.polls(), "still the first try");
        // Only a gap between two low-depth commands counts.
        clock += FAST;
        assert_eq!(chooser.on_commands(clock, true, None), None);
        assert_eq!(chooser.samples.len(), 0);
        clock += FAST;
        assert_eq!(chooser.on_commands(clock, true, None), None);
        assert_eq!(chooser.samples, [FAST]);
    }

    #[test]
    fn fixed_polling_always_polls_and_measures_nothing() {
        let mut chooser = Chooser::new(BusyPollConfig {
            window: WINDOW,
            adaptive: false,
        });
        let mut clock = Instant::now();
        for _ in 0..EPOCH_SAMPLES * 40 {
            clock += SLOW;
            assert_eq!(chooser.on_commands(clock, true, None), None);
            assert!(chooser.polls());
        }
    }
}
