//! The group model under scripted and pseudo-random event sequences; the ANA invariant is
//! checked after every event.

use super::*;

const GRACE: u64 = 2_000;
const DELAY: u64 = 1_000;

struct Sim {
    map: GroupMap,
    now: u64,
    /// Fences asked for and not yet reported.
    fences: Vec<(u64, u32, String, FenceScope)>,
    /// Every fence reported done: (gateway, group).
    fenced: Vec<(String, u32)>,
    actions: Vec<Action>,
}

impl Sim {
    fn new() -> Sim {
        Sim {
            map: GroupMap::new(Timing {
                grace_ms: GRACE,
                failback_delay_ms: DELAY,
            }),
            now: 0,
            fences: Vec::new(),
            fenced: Vec::new(),
            actions: Vec::new(),
        }
    }

    fn event(&mut self, e: Event) -> Result<Vec<Action>, MapError> {
        let before: BTreeMap<u32, String> = self
            .map
            .groups
            .iter()
            .map(|(id, g)| (*id, g.holder.clone()))
            .collect();
        let copy = self.map.clone();
        let out = self.map.handle(e);
        match &out {
            Ok(actions) => {
                for a in actions {
                    if let Action::Fence {
                        fence,
                        group,
                        gateway,
                        scope,
                        ..
                    } = a
                    {
                        self.fences
                            .push((*fence, *group, gateway.clone(), scope.clone()));
                    }
                }
                self.actions.extend(actions.iter().cloned());
            }
            Err(_) => assert_eq!(self.map, copy, "an error changed the map"),
        }
        if let Err(e) = self.map.check_invariant() {
            panic!("invariant broken at t={}: {e}\n{:#?}", self.now, self.map);
        }
        // Fencing before takeover: a group only leaves a holder that was fenced for it.
        for (id, g) in &self.map.groups {
            if let Some(old) = before.get(id) {
                if *old != g.holder {
                    assert!(
                        self.fenced.iter().any(|(gw, grp)| gw == old && grp == id),
                        "group {id} moved from {old} to {} without fencing {old}",
                        g.holder
                    );
                }
            }
        }
        out
    }

    fn beacon(&mut self, gw: &str, group: u32, inc: u64) -> Vec<Action> {
        self.beacon_with_groups(gw, group, inc, None)
    }

    /// A beacon now from `gw` (incarnation `inc`, client `127.0.0.1:0/<inc>`) acknowledging
    /// the current epoch, reporting its clients per ANA group (`None`: it does not shard).
    fn beacon_with_groups(
        &mut self,
        gw: &str,
        group: u32,
        inc: u64,
        group_addrs: Option<BTreeMap<u32, Vec<String>>>,
    ) -> Vec<Action> {
        self.beacon_reporting(gw, group, inc, group_addrs, ClusterReach::Unknown)
    }

    /// As [`Sim::beacon_with_groups`], saying whether the gateway is cut off from the cluster.
    fn beacon_reporting(
        &mut self,
        gw: &str,
        group: u32,
        inc: u64,
        group_addrs: Option<BTreeMap<u32, Vec<String>>>,
        cluster: ClusterReach,
    ) -> Vec<Action> {
        let applied = self.map.epoch;
        self.event(Event::Beacon {
            gateway: gw.into(),
            ana_group: group,
            incarnation: inc,
            addrs: vec![format!("127.0.0.1:0/{inc}")],
            group_addrs,
            applied_epoch: applied,
            cluster,
            now_ms: self.now,
        })
        .expect("beacon")
    }

    fn tick(&mut self) -> Vec<Action> {
        self.event(Event::Tick { now_ms: self.now }).expect("tick")
    }

    /// Completes the oldest pending fence.
    fn complete_fence(&mut self) -> Vec<Action> {
        assert!(!self.fences.is_empty(), "no fence pending");
        let (fence, group, gw, _) = self.fences.remove(0);
        self.fenced.push((gw, group));
        // A fence superseded by a later one (its group moved on) is refused; that is fine.
        match self.event(Event::Fenced { fence }) {
            Ok(a) => a,
            Err(MapError::UnknownFence(_)) => Vec::new(),
            Err(e) => panic!("fenced: {e}"),
        }
    }

    fn state(&self, gw: &str, group: u32) -> AnaState {
        self.map.ana_state(gw, group)
    }

    fn holder(&self, group: u32) -> &str {
        &self.map.groups[&group].holder
    }
}

fn two_gateways() -> Sim {
    let mut s = Sim::new();
    s.beacon("gw1", 1, 11);
    s.beacon("gw2", 2, 22);
    s
}

#[test]
fn each_gateway_owns_its_group_optimized_and_sees_the_others_inaccessible() {
    let s = two_gateways();
    assert_eq!(s.state("gw1", 1), AnaState::Optimized);
    assert_eq!(s.state("gw1", 2), AnaState::Inaccessible);
    assert_eq!(s.state("gw2", 2), AnaState::Optimized);
    assert_eq!(s.state("gw2", 1), AnaState::Inaccessible);
    assert_eq!(
        s.map.ana_states("gw2"),
        vec![(1, AnaState::Inaccessible), (2, AnaState::Optimized)]
    );
    assert!(s
        .map
        .gateways
        .values()
        .all(|g| g.availability == Availability::Available));
}

#[test]
fn group_zero_gets_the_lowest_free_group() {
    let mut s = Sim::new();
    s.beacon("a", 2, 1);
    s.beacon("b", 0, 2);
    s.beacon("c", 0, 3);
    assert_eq!(s.map.gateways["b"].ana_group, 1);
    assert_eq!(s.map.gateways["c"].ana_group, 3);
}

#[test]
fn joining_pushes_every_gateway() {
    let mut s = Sim::new();
    s.beacon("gw1", 1, 1);
    let a = s.beacon("gw2", 2, 2);
    assert!(a.contains(&Action::Push {
        gateway: "gw1".into()
    }));
    assert!(a.contains(&Action::Push {
        gateway: "gw2".into()
    }));
}

#[test]
fn bad_beacons_are_refused_and_change_nothing() {
    let mut s = two_gateways();
    let inc = 99;
    let r = s.event(Event::Beacon {
        gateway: "gw3".into(),
        ana_group: 1,
        incarnation: inc,
        addrs: vec![],
        group_addrs: None,
        applied_epoch: 0,
        cluster: ClusterReach::Unknown,
        now_ms: 0,
    });
    assert_eq!(
        r,
        Err(MapError::GroupTaken {
            group: 1,
            owner: "gw1".into()
        })
    );
    let r = s.event(Event::Beacon {
        gateway: "gw1".into(),
        ana_group: 2,
        incarnation: 11,
        addrs: vec![],
        group_addrs: None,
        applied_epoch: 0,
        cluster: ClusterReach::Unknown,
        now_ms: 0,
    });
    assert!(matches!(r, Err(MapError::WrongGroup { .. })));
    let r = s.event(Event::Beacon {
        gateway: "gw9".into(),
        ana_group: MAX_ANA_GROUP + 1,
        incarnation: 1,
        addrs: vec![],
        group_addrs: None,
        applied_epoch: 0,
        cluster: ClusterReach::Unknown,
        now_ms: 0,
    });
    assert_eq!(r, Err(MapError::GroupRange(MAX_ANA_GROUP + 1)));
    assert_eq!(
        s.event(Event::Fenced { fence: 77 }),
        Err(MapError::UnknownFence(77))
    );
}

#[test]
fn failover_fences_first_and_moves_the_group_only_when_fenced() {
    let mut s = two_gateways();
    // gw2 stops beaconing; gw1 goes on.
    for _ in 0..4 {
        s.now += 500;
        s.beacon("gw1", 1, 11);
        assert!(s.tick().is_empty(), "nothing happens within the grace");
    }
    s.now += 500;
    s.beacon("gw1", 1, 11);
    let a = s.tick();
    assert_eq!(
        s.map.gateways["gw2"].availability,
        Availability::Unavailable
    );
    assert_eq!(
        a,
        vec![Action::Fence {
            fence: 1,
            group: 2,
            gateway: "gw2".into(),
            addrs: vec!["127.0.0.1:0/22".into()],
            scope: FenceScope::Gateway,
        }]
    );
    // However long the fence takes, gw1 does not report group 2 optimized.
    for _ in 0..20 {
        s.now += 500;
        s.beacon("gw1", 1, 11);
        s.tick();
        assert_eq!(s.state("gw1", 2), AnaState::Inaccessible);
        assert_eq!(s.holder(2), "gw2");
        assert_eq!(
            s.map.groups[&2].phase,
            Phase::FailoverWaitFence {
                fence: 1,
                incarnation: 22
            }
        );
    }
    let a = s.complete_fence();
    assert_eq!(s.state("gw1", 2), AnaState::Optimized);
    assert_eq!(s.state("gw1", 1), AnaState::Optimized);
    assert_eq!(s.map.gateways["gw2"].availability, Availability::Fenced);
    assert_eq!(s.map.gateways["gw2"].fenced_incarnation, Some(22));
    assert!(a.contains(&Action::Push {
        gateway: "gw1".into()
    }));
}

#[test]
fn a_failed_fence_is_asked_again_and_blocks_the_takeover() {
    let mut s = two_gateways();
    s.now += GRACE + 1;
    s.beacon("gw1", 1, 11);
    let a = s.tick();
    let Some(Action::Fence { fence, .. }) = a.first().cloned() else {
        panic!("no fence: {a:?}");
    };
    s.fences.clear();
    let again = s.event(Event::FenceFailed { fence }).expect("failed");
    assert!(matches!(
        again.as_slice(),
        [Action::Fence { fence: f, gateway, .. }] if *f == fence && gateway == "gw2"
    ));
    assert_eq!(s.state("gw1", 2), AnaState::Inaccessible);
    s.complete_fence();
    assert_eq!(s.holder(2), "gw1");
}

/// The leader died while fencing (every process killed at once): the next leader loads the
/// stored map, finds the fence pending and asks it again; completing it ends the failover.
#[test]
fn a_new_leader_asks_again_the_fences_the_stored_map_waits_for() {
    let mut s = two_gateways();
    assert!(s.map.pending_fences().is_empty());
    s.now += GRACE + 1;
    s.beacon("gw1", 1, 11);
    let a = s.tick();
    let Some(Action::Fence { fence, .. }) = a.first().cloned() else {
        panic!("no fence: {a:?}");
    };
    s.fences.clear();
    // What the next leader reads back.
    let stored = serde_json::to_vec(&s.map).expect("encode");
    s.map = serde_json::from_slice(&stored).expect("decode");
    assert_eq!(s.map.pending_fences(), vec![fence]);
    let again = s.event(Event::FenceFailed { fence }).expect("asked again");
    assert!(matches!(
        again.as_slice(),
        [Action::Fence { fence: f, gateway, .. }] if *f == fence && gateway == "gw2"
    ));
    s.complete_fence();
    assert_eq!(s.holder(2), "gw1");
    assert!(s.map.pending_fences().is_empty());
}

fn failed_over() -> Sim {
    let mut s = two_gateways();
    s.now += GRACE + 1;
    s.beacon("gw1", 1, 11);
    s.tick();
    s.complete_fence();
    assert_eq!(s.holder(2), "gw1");
    s
}

#[test]
fn a_fenced_gateway_back_without_restart_stays_fenced() {
    let mut s = failed_over();
    for _ in 0..10 {
        s.now += 500;
        s.beacon("gw1", 1, 11);
        s.beacon("gw2", 2, 22);
        s.tick();
        assert_eq!(s.map.gateways["gw2"].availability, Availability::Fenced);
        assert_eq!(s.state("gw2", 2), AnaState::Inaccessible);
        assert_eq!(s.state("gw1", 2), AnaState::Optimized);
    }
}

#[test]
fn failback_drains_the_survivor_fences_it_then_optimizes_the_owner() {
    let mut s = failed_over();
    // gw2 restarts: new incarnation.
    s.now += 100;
    s.beacon("gw2", 2, 23);
    assert_eq!(s.map.gateways["gw2"].availability, Availability::Available);
    // Not before the failback delay.
    s.now += DELAY - 200;
    s.beacon("gw1", 1, 11);
    s.tick();
    assert_eq!(s.map.groups[&2].phase, Phase::Active);
    s.now += 200;
    let epoch_before = s.map.epoch;
    // The survivor is told "change" (drain) ...
    let a = s.beacon("gw2", 2, 23);
    assert!(a.contains(&Action::Push {
        gateway: "gw1".into()
    }));
    assert_eq!(s.state("gw1", 2), AnaState::Change);
    assert_eq!(s.state("gw2", 2), AnaState::Inaccessible);
    assert_eq!(
        s.map.groups[&2].phase,
        Phase::FailbackDraining {
            to: "gw2".into(),
            epoch: epoch_before + 1
        }
    );
    // ... and nothing moves until it reports that state applied.
    s.event(Event::Beacon {
        gateway: "gw1".into(),
        ana_group: 1,
        incarnation: 11,
        addrs: vec![],
        group_addrs: None,
        applied_epoch: epoch_before,
        cluster: ClusterReach::Unknown,
        now_ms: s.now,
    })
    .expect("beacon");
    assert!(matches!(
        s.map.groups[&2].phase,
        Phase::FailbackDraining { .. }
    ));
    let a = s.beacon("gw1", 1, 11);
    assert!(
        matches!(a.as_slice(), [Action::Fence { gateway, group: 2, scope: FenceScope::Group, .. }] if gateway == "gw1"),
        "{a:?}"
    );
    assert_eq!(s.state("gw1", 2), AnaState::Change);
    assert_eq!(s.state("gw2", 2), AnaState::Inaccessible);
    s.complete_fence();
    assert_eq!(s.state("gw2", 2), AnaState::Optimized);
    assert_eq!(s.state("gw1", 2), AnaState::Inaccessible);
    assert_eq!(s.state("gw1", 1), AnaState::Optimized);
    // The survivor keeps serving (only its context for group 2 was fenced).
    assert_eq!(s.map.gateways["gw1"].availability, Availability::Available);
}

#[test]
fn failback_is_cancelled_when_the_owner_dies_while_draining() {
    let mut s = failed_over();
    s.now += 100;
    s.beacon("gw2", 2, 23);
    s.now += DELAY;
    s.beacon("gw1", 1, 11);
    s.tick();
    assert_eq!(s.state("gw1", 2), AnaState::Change);
    // gw2 dies again before gw1 acknowledges the drain.
    s.now += GRACE + 1;
    s.event(Event::Beacon {
        gateway: "gw1".into(),
        ana_group: 1,
        incarnation: 11,
        addrs: vec![],
        group_addrs: None,
        applied_epoch: 0,
        cluster: ClusterReach::Unknown,
        now_ms: s.now,
    })
    .expect("beacon");
    s.tick();
    assert_eq!(s.map.groups[&2].phase, Phase::Active);
    assert_eq!(s.state("gw1", 2), AnaState::Optimized);
}

#[test]
fn a_leaving_gateway_drains_is_fenced_and_its_group_moves() {
    let mut s = two_gateways();
    s.now += 100;
    let epoch = s.map.epoch;
    let a = s
        .event(Event::Leave {
            gateway: "gw1".into(),
            now_ms: s.now,
        })
        .expect("leave");
    assert!(a.contains(&Action::Push {
        gateway: "gw1".into()
    }));
    assert_eq!(s.state("gw1", 1), AnaState::Change);
    assert_eq!(s.state("gw2", 1), AnaState::Inaccessible);
    // Nothing is fenced before gw1 applied the drain ...
    s.event(Event::Beacon {
        gateway: "gw1".into(),
        ana_group: 1,
        incarnation: 11,
        addrs: vec!["127.0.0.1:0/11".into()],
        group_addrs: None,
        applied_epoch: epoch,
        cluster: ClusterReach::Unknown,
        now_ms: s.now,
    })
    .expect("beacon");
    assert!(s.fences.is_empty());
    // ... then gw1 is fenced whole (it is going away) and group 1 moves to gw2.
    let a = s.beacon("gw1", 1, 11);
    assert!(
        matches!(a.as_slice(), [Action::Fence { gateway, group: 1, scope: FenceScope::Gateway, addrs, .. }] if gateway == "gw1" && addrs == &vec!["127.0.0.1:0/11".to_string()]),
        "{a:?}"
    );
    s.complete_fence();
    assert_eq!(s.state("gw2", 1), AnaState::Optimized);
    assert_eq!(s.state("gw2", 2), AnaState::Optimized);
    assert_eq!(s.map.gateways["gw1"].availability, Availability::Fenced);
    // It restarts: failback as usual.
    s.now += 100;
    s.beacon("gw1", 1, 12);
    assert!(!s.map.gateways["gw1"].leaving);
    s.now += DELAY;
    s.beacon("gw1", 1, 12);
    s.beacon("gw2", 2, 22);
    s.complete_fence();
    assert_eq!(s.state("gw1", 1), AnaState::Optimized);
}

#[test]
fn a_leaving_gateway_takes_nothing_over_and_keeps_its_group_without_a_target() {
    let mut s = Sim::new();
    s.beacon("gw1", 1, 1);
    s.event(Event::Leave {
        gateway: "gw1".into(),
        now_ms: 0,
    })
    .expect("leave");
    // No one to move to: it keeps serving.
    assert_eq!(s.state("gw1", 1), AnaState::Optimized);
    assert_eq!(
        s.event(Event::Leave {
            gateway: "nobody".into(),
            now_ms: 0
        }),
        Err(MapError::UnknownGateway("nobody".into()))
    );
}

#[test]
fn the_only_gateway_dying_orphans_its_group_and_gets_it_back_unfenced() {
    let mut s = Sim::new();
    s.beacon("gw1", 1, 1);
    s.now += GRACE + 1;
    let a = s.tick();
    assert!(!a.iter().any(|x| matches!(x, Action::Fence { .. })));
    assert_eq!(s.map.groups[&1].phase, Phase::Orphan { fenced: false });
    s.now += 10;
    s.beacon("gw1", 1, 1);
    assert_eq!(s.map.groups[&1].phase, Phase::Active);
    assert_eq!(s.state("gw1", 1), AnaState::Optimized);
}

#[test]
fn an_orphan_moves_to_a_new_gateway_only_after_fencing() {
    let mut s = Sim::new();
    s.beacon("gw1", 1, 1);
    s.now += GRACE + 1;
    s.tick();
    s.beacon("gw2", 2, 2);
    assert!(matches!(
        s.map.groups[&1].phase,
        Phase::FailoverWaitFence { .. }
    ));
    assert_eq!(s.state("gw2", 1), AnaState::Inaccessible);
    s.complete_fence();
    assert_eq!(s.state("gw2", 1), AnaState::Optimized);
}

#[test]
fn a_takeover_goes_to_the_least_loaded_survivor() {
    let mut s = Sim::new();
    for (i, n) in ["a", "b", "c"].iter().enumerate() {
        s.beacon(n, i as u32 + 1, i as u64);
    }
    // c dies: its group goes to a (fewest held groups, name order).
    s.now += GRACE + 1;
    s.beacon("a", 1, 0);
    s.beacon("b", 2, 1);
    s.tick();
    s.complete_fence();
    assert_eq!(s.holder(3), "a");
    // a dies: both its groups go to b.
    s.now += GRACE + 1;
    s.beacon("b", 2, 1);
    s.tick();
    assert_eq!(s.fences.len(), 2);
    s.complete_fence();
    s.complete_fence();
    assert_eq!(s.holder(1), "b");
    assert_eq!(s.holder(3), "b");
    assert_eq!(s.state("b", 1), AnaState::Optimized);
    assert_eq!(s.state("b", 3), AnaState::Optimized);
}

#[test]
fn a_leader_restart_starts_the_grace_at_its_first_tick() {
    let s = two_gateways();
    let json = serde_json::to_string(&s.map).expect("json");
    let mut map: GroupMap = serde_json::from_str(&json).expect("parse");
    assert!(map.gateways.values().all(|g| g.last_beacon_ms.is_none()));
    let a = map.handle(Event::Tick { now_ms: 1_000_000 }).expect("tick");
    assert!(a.is_empty());
    let a = map
        .handle(Event::Tick {
            now_ms: 1_000_000 + GRACE + 1,
        })
        .expect("tick");
    assert_eq!(
        a.iter()
            .filter(|x| matches!(x, Action::Fence { .. }))
            .count(),
        0,
        "no survivor: orphans, no fence"
    );
    map.check_invariant().expect("invariant");
}

/// A small deterministic generator (xorshift), so the sequences are reproducible.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Random runs: gateways stop, restart (new incarnation), resume (same incarnation); fences
/// complete or fail late. After every event the invariant and fencing-before-takeover hold;
/// the same seed gives the same map.
fn random_run(seed: u64) -> (GroupMap, Vec<Action>) {
    let mut rng = Rng(seed | 1);
    let mut s = Sim::new();
    let names = ["gw1", "gw2", "gw3"];
    let mut alive = [true; 3];
    let mut inc = [100u64, 200, 300];
    // Rounds a leaving gateway still runs before it exits.
    let mut leaving = [0u32; 3];
    for (i, n) in names.iter().enumerate() {
        s.beacon(n, i as u32 + 1, inc[i]);
    }
    for _ in 0..400 {
        s.now += 100 + rng.below(600);
        match rng.below(10) {
            0 => {
                let i = rng.below(3) as usize;
                alive[i] = !alive[i];
                if alive[i] && rng.below(2) == 0 {
                    inc[i] += 1; // restarted rather than resumed
                }
                if !alive[i] && rng.below(2) == 0 {
                    // Its control stream ends too (the process died, or the network broke).
                    s.event(Event::StreamEnded {
                        gateway: names[i].into(),
                        incarnation: inc[i],
                        now_ms: s.now,
                    })
                    .expect("stream end");
                }
            }
            3 => {
                // A planned shutdown: the gateway leaves, then stops (and later restarts).
                let i = rng.below(3) as usize;
                if alive[i] {
                    let _ = s.event(Event::Leave {
                        gateway: names[i].into(),
                        now_ms: s.now,
                    });
                    leaving[i] = 8;
                }
            }
            1 | 2 if !s.fences.is_empty() => {
                if rng.below(4) == 0 {
                    let (fence, ..) = s.fences.remove(0);
                    if let Ok(again) = s.event(Event::FenceFailed { fence }) {
                        assert!(!again.is_empty());
                    }
                } else {
                    s.complete_fence();
                }
            }
            _ => {}
        }
        for i in 0..3 {
            if leaving[i] > 0 {
                leaving[i] -= 1;
                if leaving[i] == 0 {
                    alive[i] = false;
                    inc[i] += 1; // it exits; it restarts as a new process
                }
            }
            if alive[i] {
                s.beacon(names[i], i as u32 + 1, inc[i]);
            }
        }
        s.tick();
    }
    // Quiesce: fences done, everyone alive (restarted when fenced): every group goes back
    // to its owner.
    for _ in 0..40 {
        s.now += 500;
        while !s.fences.is_empty() {
            s.complete_fence();
        }
        for (i, n) in names.iter().enumerate() {
            if s.map.gateways[*n].availability == Availability::Fenced || s.map.gateways[*n].leaving
            {
                inc[i] += 1;
            }
            s.beacon(n, i as u32 + 1, inc[i]);
        }
        s.tick();
    }
    for (id, g) in &s.map.groups {
        assert_eq!(g.holder, g.owner, "seed {seed}: group {id} not failed back");
        assert_eq!(g.phase, Phase::Active, "seed {seed}: group {id}");
    }
    (s.map, s.actions)
}

#[test]
fn random_sequences_keep_the_invariant_and_fail_back_in_the_end() {
    let mut fences = 0;
    for seed in 1..200u64 {
        let (_, actions) = random_run(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        fences += actions
            .iter()
            .filter(|a| matches!(a, Action::Fence { .. }))
            .count();
    }
    assert!(fences > 1000, "the runs exercise failover: {fences} fences");
}

#[test]
fn the_same_events_give_the_same_map_and_actions() {
    let a = random_run(42);
    let b = random_run(42);
    assert_eq!(a, b);
}

#[test]
fn namespaces_spread_over_groups_and_cntlid_ranges_are_disjoint() {
    let mut counts = BTreeMap::new();
    let groups = [1, 2, 3];
    let mut placed = Vec::new();
    for _ in 0..9 {
        let g = pick_group(&groups, &counts).expect("group");
        *counts.entry(g).or_insert(0) += 1;
        placed.push(g);
    }
    assert_eq!(placed, vec![1, 2, 3, 1, 2, 3, 1, 2, 3]);
    assert_eq!(pick_group(&[], &counts), None);
    assert_eq!(cntlid_range(1), Some((1, 2040)));
    assert_eq!(cntlid_range(2), Some((2041, 4080)));
    assert_eq!(cntlid_range(0), None);
    assert_eq!(cntlid_range(MAX_ANA_GROUP + 1), None);
    let (_, last_max) = cntlid_range(MAX_ANA_GROUP).expect("last");
    assert!(u32::from(last_max) <= CNTLID_MAX);
    for g in 1..MAX_ANA_GROUP {
        let (_, a) = cntlid_range(g).expect("a");
        let (b, _) = cntlid_range(g + 1).expect("b");
        assert!(a < b);
    }
}

#[test]
fn ana_codes_are_the_spec_values() {
    assert_eq!(AnaState::Optimized.code(), 0x01);
    assert_eq!(AnaState::NonOptimized.code(), 0x02);
    assert_eq!(AnaState::Inaccessible.code(), 0x03);
    assert_eq!(AnaState::PersistentLoss.code(), 0x04);
    assert_eq!(AnaState::Change.code(), 0x0f);
    for s in [
        AnaState::Optimized,
        AnaState::NonOptimized,
        AnaState::Inaccessible,
        AnaState::PersistentLoss,
        AnaState::Change,
    ] {
        assert_eq!(AnaState::from_code(s.code()), Some(s));
    }
    assert_eq!(AnaState::from_code(0), None);
}

/// A gateway's clients for groups 1 and 2 as it reports them when its librados connections
/// are sharded per ANA group.
fn sharded_addrs(inc: u64) -> BTreeMap<u32, Vec<String>> {
    (1..=2)
        .map(|g| (g, vec![format!("127.0.0.1:0/{inc}{g}")]))
        .collect()
}

impl Sim {
    fn sharded_beacon(&mut self, gw: &str, group: u32, inc: u64) -> Vec<Action> {
        self.beacon_with_groups(gw, group, inc, Some(sharded_addrs(inc)))
    }

    /// A sharded gateway's beacon that says the cluster answers it.
    fn reaching_beacon(&mut self, gw: &str, group: u32, inc: u64) -> Vec<Action> {
        self.beacon_reporting(
            gw,
            group,
            inc,
            Some(sharded_addrs(inc)),
            ClusterReach::Reachable,
        )
    }
}

/// One fence as [`fences_of`] lists it: `gateway`'s client `addr`, for `group`.
fn fence(
    group: u32,
    gateway: &str,
    addr: &str,
    scope: FenceScope,
) -> (u32, String, Vec<String>, FenceScope) {
    (group, gateway.to_string(), vec![addr.to_string()], scope)
}

/// Whether a gateway's beacons report its clients per ANA group.
#[derive(Clone, Copy)]
enum Sharded {
    Yes,
    No,
}

impl Sim {
    /// gw1 dies: time passes beyond the grace with only gw2 (group 2, incarnation 22)
    /// beaconing, every 250 ms. Returns the fences ordered meanwhile.
    fn only_gw2_beacons_past_the_grace(
        &mut self,
        sharded: Sharded,
    ) -> Vec<(u32, String, Vec<String>, FenceScope)> {
        let mut fences = Vec::new();
        while self.now < GRACE + 500 {
            self.now += 250;
            match sharded {
                Sharded::Yes => self.sharded_beacon("gw2", 2, 22),
                Sharded::No => self.beacon("gw2", 2, 22),
            };
            fences.extend(fences_of(&self.tick()));
        }
        fences
    }
}

fn fences_of(actions: &[Action]) -> Vec<(u32, String, Vec<String>, FenceScope)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Fence {
                group,
                gateway,
                addrs,
                scope,
                ..
            } => Some((*group, gateway.clone(), addrs.clone(), scope.clone())),
            _ => None,
        })
        .collect()
}

#[test]
fn sharded_gateways_are_fenced_only_for_the_group_that_moves() {
    let mut s = Sim::new();
    s.sharded_beacon("gw1", 1, 11);
    s.sharded_beacon("gw2", 2, 22);
    // gw1 dies: only its clients for group 1 are blocklisted.
    let fences = s.only_gw2_beacons_past_the_grace(Sharded::Yes);
    assert_eq!(
        fences,
        vec![fence(1, "gw1", "127.0.0.1:0/111", FenceScope::Group)]
    );
    s.complete_fence();
    assert_eq!(s.holder(1), "gw2");
    // gw1 restarts: failback fences gw2's clients for group 1 only, never those of its own
    // group 2 (which keeps serving there).
    let mut fences = Vec::new();
    for _ in 0..20 {
        s.now += 250;
        fences.extend(fences_of(&s.sharded_beacon("gw1", 1, 12)));
        fences.extend(fences_of(&s.sharded_beacon("gw2", 2, 22)));
        fences.extend(fences_of(&s.tick()));
    }
    assert_eq!(
        fences,
        vec![fence(1, "gw2", "127.0.0.1:0/221", FenceScope::Group)]
    );
    s.complete_fence();
    assert_eq!(s.holder(1), "gw1");
    assert_eq!(s.state("gw1", 1), AnaState::Optimized);
    assert_eq!(s.state("gw2", 2), AnaState::Optimized);
    assert_eq!(s.state("gw2", 1), AnaState::Inaccessible);
}

#[test]
fn a_gateway_that_does_not_shard_is_fenced_whole_on_failover() {
    let mut s = two_gateways();
    let fences = s.only_gw2_beacons_past_the_grace(Sharded::No);
    assert_eq!(
        fences,
        vec![fence(1, "gw1", "127.0.0.1:0/11", FenceScope::Gateway)]
    );
}

#[test]
fn a_gateway_fenced_per_group_serves_again_once_it_dropped_its_fenced_clients() {
    let mut s = Sim::new();
    s.sharded_beacon("gw1", 1, 11);
    s.sharded_beacon("gw2", 2, 22);
    s.only_gw2_beacons_past_the_grace(Sharded::Yes);
    s.complete_fence();
    assert_eq!(s.holder(1), "gw2");
    assert_eq!(s.map.gateways["gw1"].availability, Availability::Fenced);
    // Back without restarting, still reporting the blocklisted client: stays fenced.
    for _ in 0..8 {
        s.now += 250;
        s.sharded_beacon("gw1", 1, 11);
        s.sharded_beacon("gw2", 2, 22);
        s.tick();
    }
    assert_eq!(s.map.gateways["gw1"].availability, Availability::Fenced);
    assert_eq!(s.holder(1), "gw2");
    // It dropped that client (group 1 has none now, group 2 the same as before): available
    // again, and group 1 fails back to it through the usual drain and fence.
    let mut fresh = sharded_addrs(11);
    fresh.remove(&1);
    for _ in 0..20 {
        s.now += 250;
        s.beacon_with_groups("gw1", 1, 11, Some(fresh.clone()));
        s.sharded_beacon("gw2", 2, 22);
        s.tick();
        if !s.fences.is_empty() {
            s.complete_fence();
        }
    }
    assert_eq!(s.map.gateways["gw1"].availability, Availability::Available);
    assert_eq!(s.holder(1), "gw1");
    assert_eq!(s.state("gw1", 1), AnaState::Optimized);
}

#[test]
fn a_gateway_fenced_whole_needs_a_restart() {
    let mut s = two_gateways();
    s.only_gw2_beacons_past_the_grace(Sharded::No);
    s.complete_fence();
    for _ in 0..20 {
        s.now += 250;
        s.beacon("gw1", 1, 11);
        s.beacon("gw2", 2, 22);
        s.tick();
    }
    assert_eq!(s.map.gateways["gw1"].availability, Availability::Fenced);
}

#[test]
fn a_restarted_gateway_s_previous_clients_are_blocklisted() {
    let mut s = two_gateways();
    s.now += 100;
    let a = s.beacon("gw1", 1, 12);
    assert!(
        a.contains(&Action::Blocklist {
            gateway: "gw1".into(),
            addrs: vec!["127.0.0.1:0/11".into()],
        }),
        "{a:?}"
    );
    // Same incarnation again: nothing more.
    s.now += 100;
    let a = s.beacon("gw1", 1, 12);
    assert!(
        !a.iter().any(|x| matches!(x, Action::Blocklist { .. })),
        "{a:?}"
    );
    // Still optimized for its group: a restart within the grace moves nothing.
    assert_eq!(s.state("gw1", 1), AnaState::Optimized);
}

#[test]
fn a_stream_end_fences_at_once_and_moves_the_group_only_when_fenced() {
    let mut s = two_gateways();
    s.now += 10; // well within the grace
    let a = s
        .event(Event::StreamEnded {
            gateway: "gw2".into(),
            incarnation: 22,
            now_ms: s.now,
        })
        .expect("stream end");
    assert_eq!(
        a,
        vec![Action::Fence {
            fence: 1,
            group: 2,
            gateway: "gw2".into(),
            addrs: vec!["127.0.0.1:0/22".into()],
            scope: FenceScope::Gateway,
        }]
    );
    assert_eq!(
        s.map.gateways["gw2"].availability,
        Availability::Unavailable
    );
    // Until the fence is done nobody else is optimized for group 2.
    s.now += 100;
    s.beacon("gw1", 1, 11);
    s.tick();
    assert_eq!(s.state("gw1", 2), AnaState::Inaccessible);
    assert_eq!(s.holder(2), "gw2");
    let a = s.complete_fence();
    assert_eq!(s.state("gw1", 2), AnaState::Optimized);
    assert_eq!(s.map.gateways["gw2"].availability, Availability::Fenced);
    assert!(a.contains(&Action::Push {
        gateway: "gw1".into()
    }));
}

#[test]
fn a_gateway_beaconing_again_after_its_stream_ended_is_still_fenced() {
    // A network blip on a live gateway: its stream ends, it beacons on. It must still be
    // fenced before anyone else writes, and stays fenced.
    let mut s = two_gateways();
    s.event(Event::StreamEnded {
        gateway: "gw2".into(),
        incarnation: 22,
        now_ms: s.now,
    })
    .expect("stream end");
    s.now += 50;
    s.beacon("gw2", 2, 22);
    s.beacon("gw1", 1, 11);
    s.tick();
    assert!(matches!(
        s.map.groups[&2].phase,
        Phase::FailoverWaitFence {
            incarnation: 22,
            ..
        }
    ));
    assert_eq!(s.state("gw2", 2), AnaState::Optimized, "still its holder");
    s.complete_fence();
    assert_eq!(s.holder(2), "gw1");
    for _ in 0..5 {
        s.now += 500;
        s.beacon("gw1", 1, 11);
        s.beacon("gw2", 2, 22);
        s.tick();
        assert_eq!(s.map.gateways["gw2"].availability, Availability::Fenced);
        assert_eq!(s.state("gw2", 2), AnaState::Inaccessible);
    }
}

#[test]
fn a_stream_end_of_another_process_or_an_unknown_gateway_does_nothing() {
    let mut s = two_gateways();
    // gw2 restarted (incarnation 23): the old process's stream ends after that.
    s.now += 100;
    s.beacon("gw2", 2, 23);
    s.actions.clear();
    for (gateway, incarnation) in [("gw2", 22), ("gw9", 1)] {
        let a = s
            .event(Event::StreamEnded {
                gateway: gateway.into(),
                incarnation,
                now_ms: s.now,
            })
            .expect("stream end");
        assert!(a.is_empty(), "{gateway}/{incarnation}: {a:?}");
    }
    assert_eq!(s.map.gateways["gw2"].availability, Availability::Available);
    assert_eq!(s.state("gw2", 2), AnaState::Optimized);
}

#[test]
fn a_stream_end_of_a_gateway_holding_nothing_fences_nothing() {
    let mut s = failed_over(); // gw2 fenced, gw1 holds both groups
    s.now += 100;
    s.beacon("gw2", 2, 23); // restarted: available, not yet failed back
    s.event(Event::StreamEnded {
        gateway: "gw2".into(),
        incarnation: 23,
        now_ms: s.now,
    })
    .expect("stream end");
    assert!(s.fences.is_empty());
    assert_eq!(
        s.map.gateways["gw2"].availability,
        Availability::Unavailable
    );
    // No failback to it meanwhile; it beacons again: available, and failback follows.
    for _ in 0..4 {
        s.now += 500;
        s.beacon("gw1", 1, 11);
        s.tick();
        assert_eq!(s.holder(2), "gw1");
    }
    s.beacon("gw2", 2, 23);
    assert_eq!(s.map.gateways["gw2"].availability, Availability::Available);
}

/// gw1 and gw2 sharded; every 250 ms both beacon, gw1 reaching the cluster and gw2 saying
/// `gw2_reach`, and the leader ticks; fences are completed as they come. Returns the fences
/// ordered.
fn beacons_for(
    s: &mut Sim,
    rounds: usize,
    gw2_addrs: &BTreeMap<u32, Vec<String>>,
    gw2_reach: ClusterReach,
) -> Vec<(u32, String, Vec<String>, FenceScope)> {
    let mut fences = Vec::new();
    for _ in 0..rounds {
        s.now += 250;
        fences.extend(fences_of(&s.reaching_beacon("gw1", 1, 11)));
        fences.extend(fences_of(&s.beacon_reporting(
            "gw2",
            2,
            22,
            Some(gw2_addrs.clone()),
            gw2_reach,
        )));
        fences.extend(fences_of(&s.tick()));
        while !s.fences.is_empty() {
            s.complete_fence();
        }
    }
    fences
}

#[test]
fn a_gateway_cut_off_from_the_cluster_but_beaconing_is_failed_over_and_back_once_it_reaches_it() {
    let mut s = Sim::new();
    s.sharded_beacon("gw1", 1, 11);
    s.sharded_beacon("gw2", 2, 22);
    // gw2 still beacons, but its Ceph network is gone: fenced for its group, which moves to
    // gw1 although gw2 never missed a beacon.
    let fences = beacons_for(&mut s, 1, &sharded_addrs(22), ClusterReach::Stalled);
    assert_eq!(
        fences,
        vec![fence(2, "gw2", "127.0.0.1:0/222", FenceScope::Group)]
    );
    assert_eq!(s.holder(2), "gw1");
    assert_eq!(s.state("gw2", 2), AnaState::Inaccessible);
    // It dropped its fenced clients, but it still cannot reach the cluster: it stays out and
    // takes nothing back, however long that lasts.
    let mut dropped = sharded_addrs(22);
    dropped.remove(&2);
    assert!(beacons_for(&mut s, 20, &dropped, ClusterReach::Stalled).is_empty());
    assert_ne!(s.map.gateways["gw2"].availability, Availability::Available);
    assert_eq!(s.holder(2), "gw1");
    // It reaches the cluster again: available, and group 2 fails back through the usual drain
    // of gw1 and its fence.
    let fences = beacons_for(&mut s, 20, &dropped, ClusterReach::Reachable);
    assert_eq!(
        fences,
        vec![fence(2, "gw1", "127.0.0.1:0/112", FenceScope::Group)]
    );
    assert_eq!(s.map.gateways["gw2"].availability, Availability::Available);
    assert_eq!(s.holder(2), "gw2");
    assert_eq!(s.state("gw2", 2), AnaState::Optimized);
}

#[test]
fn a_stalled_gateway_is_failed_over_only_while_another_reports_the_cluster_reachable() {
    let mut s = Sim::new();
    s.sharded_beacon("gw1", 1, 11);
    s.sharded_beacon("gw2", 2, 22);
    // A whole-cluster outage: gw2 reports it first, gw1 (idle, say) has nothing to say yet,
    // then reports it too. Nobody is fenced, nothing moves.
    for k in 0..12 {
        s.now += 250;
        let gw1 = if k < 4 {
            ClusterReach::Unknown
        } else {
            ClusterReach::Stalled
        };
        let mut a = s.beacon_reporting("gw1", 1, 11, Some(sharded_addrs(11)), gw1);
        a.extend(s.beacon_reporting("gw2", 2, 22, Some(sharded_addrs(22)), ClusterReach::Stalled));
        a.extend(s.tick());
        assert!(fences_of(&a).is_empty(), "fenced: {a:?}");
    }
    for gw in ["gw1", "gw2"] {
        assert_eq!(s.map.gateways[gw].availability, Availability::Available);
    }
    assert_eq!((s.holder(1), s.holder(2)), ("gw1", "gw2"));
    // The cluster is back for gw1 only: gw2, still stalled, is failed over at its next beacon.
    let fences = beacons_for(&mut s, 1, &sharded_addrs(22), ClusterReach::Stalled);
    assert_eq!(
        fences,
        vec![fence(2, "gw2", "127.0.0.1:0/222", FenceScope::Group)]
    );
    assert_eq!(s.holder(2), "gw1");
}
