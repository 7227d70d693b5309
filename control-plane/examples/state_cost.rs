//! In-memory cost of one namespace add on the control plane's cached state, by state size:
//! what is left of an add's O(state) work once no update reads the RADOS object (see
//! `control-plane/README.md`, Scale figures). No cluster: the pure `GroupState` steps an
//! update takes, timed, against the baseline of copying one namespace entry.
//!
//! ```sh
//! cargo run --release -p control-plane --example state_cost
//! ```

use std::time::Instant;

use control_plane::ana::{Event, GroupMap, Timing};
use control_plane::state::{GroupState, NamespaceEntry};

const NQN: &str = "nqn.2016-06.io.ceph-nvmeof-rs:scale";
const ROUNDS: u32 = 200;

fn entry(i: u32) -> NamespaceEntry {
    NamespaceEntry {
        subsystem_nqn: NQN.into(),
        nsid: i,
        pool: "rbd".into(),
        rados_namespace: String::new(),
        image: format!("scale-{i:05}"),
        block_size: 512,
        ana_group: 1,
        moving_from: 0,
        no_auto_visible: false,
        hosts: Default::default(),
        qos: Default::default(),
        nguid: String::new(),
        uuid: String::new(),
        trash_image: false,
        frozen_size: None,
    }
}

fn state_with(n: u32) -> GroupState {
    let mut map = GroupMap::new(Timing::default());
    map.handle(Event::Beacon {
        gateway: "gw1".into(),
        ana_group: 1,
        incarnation: 1,
        addrs: vec![],
        group_addrs: None,
        applied_epoch: 0,
        cluster: control_plane::ana::ClusterReach::Unknown,
        now_ms: 0,
    })
    .expect("beacon");
    let mut st = GroupState {
        map: Some(map),
        ..GroupState::default()
    };
    st.add_subsystem(NQN, "", true, 0).expect("subsystem");
    for i in 1..=n {
        st.add_namespace(entry(i)).expect("namespace");
    }
    st
}

/// Mean microseconds of `f` over ROUNDS runs.
fn time(mut f: impl FnMut()) -> f64 {
    let started = Instant::now();
    for _ in 0..ROUNDS {
        f();
    }
    started.elapsed().as_secs_f64() * 1e6 / f64::from(ROUNDS)
}

fn main() {
    println!("namespaces  copy_us  check_us  diff_us      encode_all_us  baseline_entry_copy_us");
    for n in [0u32, 100, 500, 1000] {
        let st = state_with(n);
        let new = entry(n + 1);
        let copy = time(|| {
            std::hint::black_box(st.clone());
        });
        let check = time(|| {
            std::hint::black_box(st.check_namespace(new.clone()).expect("check"));
        });
        let mut next = st.clone();
        next.add_namespace(new.clone()).expect("add");
        let diff = time(|| {
            std::hint::black_box(next.diff(&st));
        });
        // What every update did before: encode the whole state (twice, plus a decode).
        let encode = time(|| {
            std::hint::black_box(st.to_omap());
        });
        let base = time(|| {
            std::hint::black_box(new.clone());
        });
        println!("{n:>10}  {copy:>7.1}  {check:>8.1}  {diff:>11.1}  {encode:>13.1}  {base:>22.2}");
        println!(
            "scale: state_cost namespaces={n} copy_us={copy:.1} check_us={check:.1} diff_us={diff:.1} encode_all_us={encode:.1} entry_copy_us={base:.2}"
        );
    }
}
