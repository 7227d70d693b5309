//! Gateways' reports of OSDs that do not answer them (`Beacon.osds_unanswered`), checked by
//! the leader before it acts on them: pure and deterministic (no I/O, times in ms come in).
//!
//! Why: a gateway whose network reaches the monitors but not an OSD host has its commands
//! wait there while every monitor probe answers, so it never reports the cluster stalled. It
//! names the OSDs that do not answer it (`gateway/src/stall.rs`). The same report comes from
//! every gateway when an OSD process hangs, and moving groups cannot help there; so the leader
//! asks those OSDs itself (`rbd_backend::osd_probe::probe_these_osds`):
//!
//! - **confirmed**: at least one of them answered the leader: the gateway, not the OSD, is
//!   cut off. The server then takes the gateway's beacons as reporting the cluster stalled
//!   (`control_plane::ana`: unavailable while another gateway reaches the cluster; fenced,
//!   its groups move; available again once its report is empty).
//! - **shared**: none answered the leader either (a hung OSD, or the leader cut off too):
//!   nothing is done; asked again after `recheck_ms` while the report stands.
//! - **unchecked**: not asked yet, or the leader could not ask (no cluster connection).
//!
//! A report that changes (other OSDs) is checked afresh; an empty one ends it.

use std::collections::BTreeMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Unchecked,
    Confirmed,
    Shared,
}

#[derive(Debug, Clone)]
struct Report {
    osds: Vec<i32>,
    verdict: Verdict,
    probing: bool,
    last_probe_ms: Option<u64>,
}

#[derive(Debug, Default)]
pub struct OsdReports {
    by_gateway: BTreeMap<String, Report>,
}

impl OsdReports {
    /// A beacon of `gateway` names `osds` (sorted and deduplicated here; empty: none).
    /// Returns whether its report is confirmed: the beacon is then to be taken as reporting
    /// the cluster stalled.
    pub fn on_beacon(&mut self, gateway: &str, osds: &[i32]) -> bool {
        let mut osds = osds.to_vec();
        osds.sort_unstable();
        osds.dedup();
        if osds.is_empty() {
            if self.by_gateway.remove(gateway).is_some() {
                tracing::info!(
                    gateway,
                    "gateway no longer reports OSDs that do not answer it"
                );
            }
            return false;
        }
        let r = self
            .by_gateway
            .entry(gateway.to_string())
            .or_insert_with(|| Report {
                osds: Vec::new(),
                verdict: Verdict::Unchecked,
                probing: false,
                last_probe_ms: None,
            });
        if r.osds != osds {
            tracing::warn!(gateway, osds = ?osds, "gateway reports OSDs that do not answer it");
            *r = Report {
                osds,
                verdict: Verdict::Unchecked,
                probing: false,
                last_probe_ms: None,
            };
        }
        r.verdict == Verdict::Confirmed
    }

    /// The OSDs the leader should ask now for `gateway`'s report, if any: a report not
    /// confirmed, no probe of it running, and none in the last `recheck_ms`. The caller
    /// reports the probe with [`OsdReports::probe_finished`].
    pub fn probe_due(&mut self, gateway: &str, now_ms: u64, recheck_ms: u64) -> Option<Vec<i32>> {
        let r = self.by_gateway.get_mut(gateway)?;
        let due = r.verdict != Verdict::Confirmed
            && !r.probing
            && r.last_probe_ms
                .is_none_or(|t| now_ms.saturating_sub(t) >= recheck_ms);
        if !due {
            return None;
        }
        r.probing = true;
        r.last_probe_ms = Some(now_ms);
        Some(r.osds.clone())
    }

    /// The leader asked `osds` for `gateway`'s report: `unanswered` those that did not answer
    /// it (None: it could not ask). Returns the verdict, or None if the report changed
    /// meanwhile (the answer is about another one: dropped).
    pub fn probe_finished(
        &mut self,
        gateway: &str,
        osds: &[i32],
        unanswered: Option<&[i32]>,
    ) -> Option<Verdict> {
        let r = self.by_gateway.get_mut(gateway)?;
        if r.osds != osds {
            return None;
        }
        r.probing = false;
        r.verdict = match unanswered {
            None => Verdict::Unchecked,
            Some(u) if osds.iter().any(|o| !u.contains(o)) => Verdict::Confirmed,
            Some(_) => Verdict::Shared,
        };
        Some(r.verdict)
    }

    /// The verdict on `gateway`'s report (None: it reports none).
    pub fn verdict(&self, gateway: &str) -> Option<Verdict> {
        self.by_gateway.get(gateway).map(|r| r.verdict)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RECHECK: u64 = 2_000;

    #[test]
    fn a_report_whose_osds_answer_the_leader_is_confirmed() {
        let mut r = OsdReports::default();
        assert!(!r.on_beacon("gw1", &[7, 3, 3]));
        assert_eq!(r.probe_due("gw1", 0, RECHECK), Some(vec![3, 7]));
        // One probe at a time.
        assert_eq!(r.probe_due("gw1", 10, RECHECK), None);
        assert!(
            !r.on_beacon("gw1", &[3, 7]),
            "not before the leader's answer"
        );
        // osd.3 answers the leader (osd.7 does not): the gateway is the one cut off.
        assert_eq!(
            r.probe_finished("gw1", &[3, 7], Some(&[7])),
            Some(Verdict::Confirmed)
        );
        assert!(r.on_beacon("gw1", &[7, 3]));
        assert_eq!(
            r.probe_due("gw1", 100_000, RECHECK),
            None,
            "confirmed: not asked again"
        );
        // Its report ends: no longer confirmed, nothing to ask.
        assert!(!r.on_beacon("gw1", &[]));
        assert_eq!(r.verdict("gw1"), None);
        assert_eq!(r.probe_due("gw1", 200_000, RECHECK), None);
    }

    #[test]
    fn osds_that_answer_nobody_are_not_the_gateways_fault_and_are_asked_again_later() {
        let mut r = OsdReports::default();
        r.on_beacon("gw1", &[3]);
        assert_eq!(r.probe_due("gw1", 0, RECHECK), Some(vec![3]));
        assert_eq!(
            r.probe_finished("gw1", &[3], Some(&[3])),
            Some(Verdict::Shared)
        );
        assert!(!r.on_beacon("gw1", &[3]));
        assert_eq!(r.probe_due("gw1", RECHECK - 1, RECHECK), None);
        assert_eq!(r.probe_due("gw1", RECHECK, RECHECK), Some(vec![3]));
        // Now it answers the leader (the gateway's network is what is left broken).
        assert_eq!(
            r.probe_finished("gw1", &[3], Some(&[])),
            Some(Verdict::Confirmed)
        );
        assert!(r.on_beacon("gw1", &[3]));
    }

    #[test]
    fn a_changed_report_is_checked_afresh_and_a_stale_answer_dropped() {
        let mut r = OsdReports::default();
        r.on_beacon("gw1", &[3]);
        assert_eq!(r.probe_due("gw1", 0, RECHECK), Some(vec![3]));
        // The report changes while the leader asks.
        assert!(!r.on_beacon("gw1", &[3, 4]));
        assert_eq!(
            r.probe_finished("gw1", &[3], Some(&[])),
            None,
            "about the old report"
        );
        assert_eq!(r.verdict("gw1"), Some(Verdict::Unchecked));
        assert_eq!(
            r.probe_due("gw1", 1, RECHECK),
            Some(vec![3, 4]),
            "at once, not after the recheck"
        );
        // The leader could not ask: unchecked, asked again after the recheck.
        assert_eq!(
            r.probe_finished("gw1", &[3, 4], None),
            Some(Verdict::Unchecked)
        );
        assert!(!r.on_beacon("gw1", &[4, 3]));
        assert_eq!(r.probe_due("gw1", 2, RECHECK), None);
        assert_eq!(r.probe_due("gw1", 1 + RECHECK, RECHECK), Some(vec![3, 4]));
    }

    #[test]
    fn reports_are_per_gateway() {
        let mut r = OsdReports::default();
        r.on_beacon("gw1", &[3]);
        r.on_beacon("gw2", &[3]);
        assert_eq!(r.probe_due("gw1", 0, RECHECK), Some(vec![3]));
        assert_eq!(
            r.probe_finished("gw1", &[3], Some(&[])),
            Some(Verdict::Confirmed)
        );
        assert!(r.on_beacon("gw1", &[3]));
        assert!(
            !r.on_beacon("gw2", &[3]),
            "gw2's own report is not checked yet"
        );
        assert_eq!(r.probe_due("gw3", 0, RECHECK), None);
    }
}
