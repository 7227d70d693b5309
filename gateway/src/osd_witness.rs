//! This gateway as a witness for the control plane's leader (`control_plane::osd_reports`).
//!
//! Why: a gateway that reaches the monitors but not some OSDs reports them
//! (`Beacon.osds_unanswered`), and the leader fails it over only once it knows the OSDs
//! answer someone (a hung OSD answers nobody, and moving groups would not help there). When
//! they do not answer the leader either, the leader may be cut off from them too, so it asks
//! a gateway that reaches the cluster to probe them (`BeaconReply.osd_probe`).
//!
//! This keeps which request was started and the last answer, which every beacon carries
//! (`Beacon.osd_probe`) until the leader asks again: a beacon lost or refused in between
//! costs nothing. Deterministic; the group agent runs the probe.

use control_plane::proto::{OsdProbeAnswer, OsdProbeRequest};

#[derive(Debug, Default)]
pub struct Witness {
    /// The last request started (0: none).
    started: u64,
    answer: Option<OsdProbeAnswer>,
}

impl Witness {
    /// A beacon reply's request (None: it asks nothing). Returns the request's id and OSDs
    /// to probe now, if it is one not started yet (the leader repeats a request in every
    /// reply until the answer reaches it).
    pub fn on_request(&mut self, request: Option<&OsdProbeRequest>) -> Option<(u64, Vec<i32>)> {
        let r = request.filter(|r| r.id != 0 && r.id != self.started)?;
        self.started = r.id;
        Some((r.id, r.osds.clone()))
    }

    /// The probe of request `id` ended: `unanswered` the OSDs that did not answer this
    /// gateway (None: it could not ask). An answer to a request since replaced is dropped.
    pub fn probe_finished(&mut self, id: u64, unanswered: Option<Vec<i32>>) {
        if id != self.started {
            return;
        }
        self.answer = Some(OsdProbeAnswer {
            id,
            not_asked: unanswered.is_none(),
            unanswered: unanswered.unwrap_or_default(),
        });
    }

    /// What the next beacons carry (None: never asked, or the probe still runs).
    pub fn answer(&self) -> Option<OsdProbeAnswer> {
        self.answer.clone().filter(|a| a.id == self.started)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(id: u64, osds: &[i32]) -> OsdProbeRequest {
        OsdProbeRequest {
            id,
            osds: osds.to_vec(),
        }
    }

    #[test]
    fn a_request_is_probed_once_and_its_answer_beaconed_until_the_next_request() {
        let mut w = Witness::default();
        assert_eq!(w.on_request(None), None);
        assert_eq!(
            w.on_request(Some(&request(0, &[3]))),
            None,
            "0 is no request"
        );
        assert_eq!(w.answer(), None);
        assert_eq!(
            w.on_request(Some(&request(7, &[3, 4]))),
            Some((7, vec![3, 4]))
        );
        assert_eq!(
            w.on_request(Some(&request(7, &[3, 4]))),
            None,
            "repeated by the leader until answered: probed once"
        );
        assert_eq!(w.answer(), None, "nothing while the probe runs");
        w.probe_finished(7, Some(vec![4]));
        let answer = OsdProbeAnswer {
            id: 7,
            unanswered: vec![4],
            not_asked: false,
        };
        assert_eq!(w.answer(), Some(answer.clone()));
        assert_eq!(w.on_request(None), None);
        assert_eq!(
            w.answer(),
            Some(answer),
            "kept while the leader asks nothing new"
        );
        // A new request replaces it; a late end of the old probe does not count.
        assert_eq!(w.on_request(Some(&request(9, &[5]))), Some((9, vec![5])));
        assert_eq!(w.answer(), None);
        w.probe_finished(7, Some(vec![]));
        assert_eq!(w.answer(), None);
        w.probe_finished(9, None);
        assert_eq!(
            w.answer(),
            Some(OsdProbeAnswer {
                id: 9,
                unanswered: vec![],
                not_asked: true,
            })
        );
    }
}
