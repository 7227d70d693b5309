//! When a closing queue pair may be disconnected: the decision, without verbs or clocks of
//! its own, so it is tested without RDMA hardware.
//!
//! `rdma_disconnect` moves the QP to the error state, and the adapter then flushes every work
//! request it has not finished, a SEND it has not transmitted yet included. The core often
//! asks for a response and a close in the same turn (an authentication Failure2 ends the
//! controller, a fatal Connect error, a keep-alive that arrives too late), so disconnecting
//! at once can drop the reply the host waits for: seen with Soft-RoCE, where the Linux host
//! then timed the Fabrics command out and `nvme connect` hung (issue 26, item 2). A close
//! therefore first lets the signaled sends already posted complete, for at most
//! [`SEND_DRAIN_TIMEOUT`] (NVMe/TCP has the same rule: its writer flushes before the socket
//! closes). It also waits, briefly, for `RDMA_CM_EVENT_ESTABLISHED`: before it the CM sends no
//! disconnect request, and the host would never learn that its QP is gone.

use std::time::Duration;

use tokio::time::Instant;

/// How long a close waits for the completions of sends already posted.
pub const SEND_DRAIN_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a connection closing before `ESTABLISHED` waits for it (to disconnect properly).
pub const ESTABLISH_WAIT: Duration = Duration::from_secs(2);

/// What the connection sees when it asks what to do next.
#[derive(Debug, Clone, Copy)]
pub struct Observed {
    /// `RDMA_CM_EVENT_ESTABLISHED` seen.
    pub established: bool,
    /// The host or the device ended the connection already (a disconnect would send nothing
    /// and the QP is flushing anyway).
    pub disconnected: bool,
    /// The QP can still complete what was posted (no failed post, no fatal event).
    pub qp_usable: bool,
    /// Signaled send-queue requests posted and not yet completed.
    pub sends_in_flight: usize,
    pub now: Instant,
}

/// The next step of a close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseStep {
    /// Poll the completion queue until this instant, then ask again.
    WaitSends(Instant),
    /// Wait for `ESTABLISHED` until this instant, then ask again.
    WaitEstablished(Instant),
    /// Call `rdma_disconnect`, then tear down. `unconfirmed` sends were still in flight when
    /// the wait for them expired (the host may not get them: worth a warning).
    Disconnect { unconfirmed: usize },
    /// No disconnect to send: tear down.
    Teardown,
}

/// The decision, from the moment the connection decided to close.
#[derive(Debug)]
pub struct CloseSequence {
    sends_deadline: Instant,
    established_deadline: Instant,
}

impl CloseSequence {
    pub fn new(started: Instant) -> Self {
        Self {
            sends_deadline: started + SEND_DRAIN_TIMEOUT,
            established_deadline: started + ESTABLISH_WAIT,
        }
    }

    pub fn next(&self, o: &Observed) -> CloseStep {
        if o.disconnected {
            return CloseStep::Teardown;
        }
        let unconfirmed = if o.qp_usable { o.sends_in_flight } else { 0 };
        if unconfirmed > 0 && o.now < self.sends_deadline {
            return CloseStep::WaitSends(self.sends_deadline);
        }
        if !o.established && o.now < self.established_deadline {
            return CloseStep::WaitEstablished(self.established_deadline);
        }
        CloseStep::Disconnect { unconfirmed }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn observed(now: Instant, sends_in_flight: usize) -> Observed {
        Observed {
            established: true,
            disconnected: false,
            qp_usable: true,
            sends_in_flight,
            now,
        }
    }

    #[test]
    fn a_reply_posted_before_the_close_completes_before_the_disconnect() {
        // The Failure2 case: the core answered and asked for a close in the same turn, so the
        // reply's SEND is still posted when the close starts.
        let t0 = Instant::now();
        let close = CloseSequence::new(t0);
        let step = close.next(&observed(t0, 1));
        assert_eq!(step, CloseStep::WaitSends(t0 + SEND_DRAIN_TIMEOUT));
        let later = t0 + Duration::from_millis(20);
        assert!(matches!(
            close.next(&observed(later, 1)),
            CloseStep::WaitSends(_)
        ));
        // Its completion came: now the disconnect may flush the rest.
        assert_eq!(
            close.next(&observed(later, 0)),
            CloseStep::Disconnect { unconfirmed: 0 }
        );
    }

    #[test]
    fn nothing_posted_disconnects_at_once() {
        let t0 = Instant::now();
        assert_eq!(
            CloseSequence::new(t0).next(&observed(t0, 0)),
            CloseStep::Disconnect { unconfirmed: 0 }
        );
    }

    #[test]
    fn the_wait_for_sends_is_bounded_and_says_what_it_left() {
        let t0 = Instant::now();
        let close = CloseSequence::new(t0);
        assert_eq!(
            close.next(&observed(t0 + SEND_DRAIN_TIMEOUT, 3)),
            CloseStep::Disconnect { unconfirmed: 3 }
        );
    }

    #[test]
    fn a_broken_queue_pair_or_a_gone_host_is_not_waited_for() {
        let t0 = Instant::now();
        let close = CloseSequence::new(t0);
        let broken = Observed {
            qp_usable: false,
            ..observed(t0, 2)
        };
        assert_eq!(
            close.next(&broken),
            CloseStep::Disconnect { unconfirmed: 0 }
        );
        let gone = Observed {
            disconnected: true,
            ..observed(t0, 2)
        };
        assert_eq!(close.next(&gone), CloseStep::Teardown);
    }

    #[test]
    fn before_established_the_close_waits_for_it_after_the_sends() {
        let t0 = Instant::now();
        let close = CloseSequence::new(t0);
        let early = Observed {
            established: false,
            ..observed(t0, 1)
        };
        assert!(matches!(close.next(&early), CloseStep::WaitSends(_)));
        let sent = Observed {
            sends_in_flight: 0,
            ..early
        };
        assert_eq!(
            close.next(&sent),
            CloseStep::WaitEstablished(t0 + ESTABLISH_WAIT)
        );
        let late = Observed {
            now: t0 + ESTABLISH_WAIT,
            ..sent
        };
        assert_eq!(close.next(&late), CloseStep::Disconnect { unconfirmed: 0 });
    }
}
