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
//! The leader may be cut off from those OSDs too (its network shares the reporter's broken
//! link): its own answer then reads as a hung OSD and nothing would move. So a report the
//! leader could not confirm is also put to a **witness**: another gateway that reaches the
//! cluster and reports no OSDs itself, asked in its beacon reply (`BeaconReply.osd_probe`)
//! and answering in its next beacons (`Beacon.osd_probe`). Any of the OSDs answering the
//! witness confirms the report as the leader's own answer would; none answering leaves it
//! shared. One witness is asked at a time, again after `recheck_ms` while the report stands.
//!
//! A report that changes (other OSDs) is checked afresh; an empty one ends it.

use std::collections::BTreeMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Verdict {
    #[default]
    Unchecked,
    Confirmed,
    Shared,
}

#[derive(Debug, Clone, Default)]
struct Report {
    osds: Vec<i32>,
    verdict: Verdict,
    probing: bool,
    last_probe_ms: Option<u64>,
    /// The leader's own probe did not confirm the report: a witness is to be asked.
    wants_witness: bool,
    /// The witness asked and not answered yet.
    witness: Option<WitnessAsk>,
    last_witness_ms: Option<u64>,
    /// Witnesses' answers taken for this report (read by tests, through
    /// `ControlPlane::osd_report_witness_answers`).
    witness_answers: u32,
}

impl Report {
    /// A probe of the report's OSDs (the leader's or a witness's) found `unanswered` not
    /// answering (None: it could not ask, which leaves a verdict already reached).
    fn settle(&mut self, unanswered: Option<&[i32]>) {
        self.verdict = match unanswered {
            None if self.verdict == Verdict::Shared => Verdict::Shared,
            None => Verdict::Unchecked,
            Some(u) if self.osds.iter().any(|o| !u.contains(o)) => Verdict::Confirmed,
            Some(_) => Verdict::Shared,
        };
    }
}

#[derive(Debug, Clone)]
struct WitnessAsk {
    gateway: String,
    id: u64,
}

/// What the leader asks a witness to probe: [`OsdReports::witness_request`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WitnessRequest {
    pub id: u64,
    pub osds: Vec<i32>,
}

/// A witness's answer, for the log: [`OsdReports::witness_answered`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WitnessVerdict {
    /// The gateway whose report it was about.
    pub reporter: String,
    pub osds: Vec<i32>,
    pub verdict: Verdict,
}

#[derive(Debug, Default)]
pub struct OsdReports {
    by_gateway: BTreeMap<String, Report>,
    /// The last witness request's id (0 is "none" on the wire).
    last_witness_id: u64,
}

impl OsdReports {
    /// Witness requests numbered from `first_id` on. A gateway keeps answering the last
    /// request it got, also to the next leader: a leader seeds its ids from the clock, so
    /// that an answer to its predecessor never passes for one to itself.
    pub fn with_witness_ids_from(first_id: u64) -> Self {
        Self {
            last_witness_id: first_id.saturating_sub(1),
            ..Self::default()
        }
    }
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
        let r = self.by_gateway.entry(gateway.to_string()).or_default();
        if r.osds != osds {
            tracing::warn!(gateway, osds = ?osds, "gateway reports OSDs that do not answer it");
            *r = Report {
                osds,
                ..Report::default()
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
        r.settle(unanswered);
        r.wants_witness = r.verdict != Verdict::Confirmed;
        if !r.wants_witness {
            r.witness = None;
        }
        Some(r.verdict)
    }

    /// What to ask `witness` (a gateway that reaches the cluster, is not fenced and reports
    /// no OSDs itself) in its beacon reply, if anything: the request it was asked and has not
    /// answered yet (sent again in every reply until it answers), or a report the leader
    /// could not confirm whose last witness was asked at least `recheck_ms` ago.
    pub fn witness_request(
        &mut self,
        witness: &str,
        now_ms: u64,
        recheck_ms: u64,
    ) -> Option<WitnessRequest> {
        let pending = self.by_gateway.values().find_map(|r| {
            r.witness
                .as_ref()
                .filter(|w| w.gateway == witness)
                .map(|w| WitnessRequest {
                    id: w.id,
                    osds: r.osds.clone(),
                })
        });
        if pending.is_some() {
            return pending;
        }
        let (_, r) = self.by_gateway.iter_mut().find(|(reporter, r)| {
            reporter.as_str() != witness
                && r.wants_witness
                && r.last_witness_ms
                    .is_none_or(|t| now_ms.saturating_sub(t) >= recheck_ms)
        })?;
        self.last_witness_id += 1;
        r.witness = Some(WitnessAsk {
            gateway: witness.to_string(),
            id: self.last_witness_id,
        });
        r.last_witness_ms = Some(now_ms);
        Some(WitnessRequest {
            id: self.last_witness_id,
            osds: r.osds.clone(),
        })
    }

    /// `witness` answered request `id`: `unanswered` the OSDs that did not answer it (None: it
    /// could not ask). Returns the verdict on the report it was about, or None if no report
    /// waits for that answer (already answered, or the report changed or ended).
    pub fn witness_answered(
        &mut self,
        witness: &str,
        id: u64,
        unanswered: Option<&[i32]>,
    ) -> Option<WitnessVerdict> {
        let (reporter, r) = self.by_gateway.iter_mut().find(|(_, r)| {
            r.witness
                .as_ref()
                .is_some_and(|w| w.gateway == witness && w.id == id)
        })?;
        r.witness = None;
        r.witness_answers += 1;
        if r.verdict != Verdict::Confirmed {
            r.settle(unanswered);
        }
        r.wants_witness = r.verdict != Verdict::Confirmed;
        Some(WitnessVerdict {
            reporter: reporter.clone(),
            osds: r.osds.clone(),
            verdict: r.verdict,
        })
    }

    /// The verdict on `gateway`'s report (None: it reports none).
    pub fn verdict(&self, gateway: &str) -> Option<Verdict> {
        self.by_gateway.get(gateway).map(|r| r.verdict)
    }

    /// How many witnesses' answers were taken for `gateway`'s current report (None: it
    /// reports none). A changed report starts again from 0.
    pub fn witness_answers(&self, gateway: &str) -> Option<u32> {
        self.by_gateway.get(gateway).map(|r| r.witness_answers)
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

    /// gw1's report of osd.3, which did not answer the leader either.
    fn shared_by_the_leader() -> OsdReports {
        let mut r = OsdReports::default();
        r.on_beacon("gw1", &[3]);
        assert_eq!(r.probe_due("gw1", 0, RECHECK), Some(vec![3]));
        assert_eq!(
            r.witness_request("gw2", 0, RECHECK),
            None,
            "no witness before the leader's own answer"
        );
        assert_eq!(
            r.probe_finished("gw1", &[3], Some(&[3])),
            Some(Verdict::Shared)
        );
        r
    }

    #[test]
    fn a_report_the_leader_cannot_confirm_is_confirmed_by_a_witness_the_osds_answer() {
        let mut r = shared_by_the_leader();
        assert_eq!(
            r.witness_request("gw1", 10, RECHECK),
            None,
            "the reporter is no witness of its own report"
        );
        let asked = r.witness_request("gw2", 10, RECHECK).expect("gw2 asked");
        assert_eq!(asked.osds, vec![3]);
        assert_ne!(asked.id, 0, "0 is no request on the wire");
        assert_eq!(
            r.witness_request("gw2", 20, RECHECK),
            Some(asked.clone()),
            "asked again until it answers"
        );
        assert_eq!(
            r.witness_request("gw3", 20, RECHECK),
            None,
            "one witness at a time"
        );
        assert_eq!(
            r.witness_answered("gw3", asked.id, Some(&[])),
            None,
            "gw3 was not asked"
        );
        assert!(!r.on_beacon("gw1", &[3]), "not before the witness answers");
        assert_eq!(r.witness_answers("gw1"), Some(0));
        assert_eq!(
            r.witness_answered("gw2", asked.id, Some(&[])),
            Some(WitnessVerdict {
                reporter: "gw1".into(),
                osds: vec![3],
                verdict: Verdict::Confirmed,
            })
        );
        assert!(r.on_beacon("gw1", &[3]), "taken as cut off");
        assert_eq!(
            r.witness_answered("gw2", asked.id, Some(&[])),
            None,
            "answered once"
        );
        assert_eq!(r.witness_answers("gw1"), Some(1), "counted once");
        assert_eq!(r.witness_answers("gw2"), None, "gw2 reports nothing");
        assert_eq!(r.witness_request("gw2", 100_000, RECHECK), None);
        assert_eq!(r.probe_due("gw1", 100_000, RECHECK), None);
    }

    #[test]
    fn osds_that_answer_no_witness_either_leave_the_report_shared_until_the_recheck() {
        let mut r = shared_by_the_leader();
        let first = r.witness_request("gw2", 0, RECHECK).expect("gw2 asked");
        assert_eq!(
            r.witness_answered("gw2", first.id, Some(&[3])),
            Some(WitnessVerdict {
                reporter: "gw1".into(),
                osds: vec![3],
                verdict: Verdict::Shared,
            })
        );
        assert!(!r.on_beacon("gw1", &[3]));
        assert_eq!(r.witness_request("gw2", RECHECK - 1, RECHECK), None);
        let second = r
            .witness_request("gw3", RECHECK, RECHECK)
            .expect("asked again after the recheck");
        assert_ne!(second.id, first.id);
        // A witness that could not ask changes nothing.
        assert_eq!(
            r.witness_answered("gw3", second.id, None)
                .map(|v| v.verdict),
            Some(Verdict::Shared)
        );
        assert!(!r.on_beacon("gw1", &[3]));
    }

    #[test]
    fn the_leaders_own_confirmation_or_a_changed_report_ends_the_witness_request() {
        let mut r = shared_by_the_leader();
        let asked = r.witness_request("gw2", 0, RECHECK).expect("gw2 asked");
        // The leader's recheck finds osd.3 answering before gw2 answers.
        assert_eq!(r.probe_due("gw1", RECHECK, RECHECK), Some(vec![3]));
        assert_eq!(
            r.probe_finished("gw1", &[3], Some(&[])),
            Some(Verdict::Confirmed)
        );
        assert_eq!(r.witness_request("gw2", RECHECK, RECHECK), None);
        assert_eq!(r.witness_answered("gw2", asked.id, Some(&[3])), None);
        assert!(r.on_beacon("gw1", &[3]), "still confirmed");

        let mut r = shared_by_the_leader();
        let asked = r.witness_request("gw2", 0, RECHECK).expect("gw2 asked");
        assert!(!r.on_beacon("gw1", &[3, 4]));
        assert_eq!(
            r.witness_answered("gw2", asked.id, Some(&[])),
            None,
            "about the old report"
        );
        assert_eq!(
            r.witness_request("gw2", 1, RECHECK),
            None,
            "the new report goes to the leader first"
        );
    }
}
