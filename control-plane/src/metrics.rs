//! The control plane replica's metrics in Prometheus' text format, served by
//! `nvmeof-control --metrics-listen`: who leads, the gateways and their beacons, the ANA
//! groups (owner, the gateway holding them optimized, phase) and what the group serves.
//!
//! Read at scrape time from what `nvmeofctl gateway list` and `ana show` answer: the live
//! map on the leader, the stored one on other replicas.

use metrics_exposition::Family;

use crate::server::ControlPlane;

/// The exposition text for replica `cp`.
pub fn render(cp: &ControlPlane) -> String {
    let mut out = String::with_capacity(2048);
    Family::new(
        &mut out,
        "nvmeof_control_info",
        "gauge",
        "This control plane replica: its ID and version (always 1).",
    )
    .sample(
        &[("id", cp.id()), ("version", env!("CARGO_PKG_VERSION"))],
        1,
    );
    Family::new(
        &mut out,
        "nvmeof_control_leader",
        "gauge",
        "1 while this replica holds the leader lease (it decides failovers), else 0.",
    )
    .sample(&[], u8::from(cp.is_leader()));
    let state = cp.snapshot();
    Family::new(
        &mut out,
        "nvmeof_control_state_version",
        "gauge",
        "Version of the group state this replica has (bumped on every change).",
    )
    .sample(&[], state.version);
    Family::new(
        &mut out,
        "nvmeof_control_subsystems",
        "gauge",
        "Subsystems in the group's configuration.",
    )
    .sample(&[], state.subsystems.len());
    Family::new(
        &mut out,
        "nvmeof_control_namespaces",
        "gauge",
        "Namespaces in the group's configuration.",
    )
    .sample(&[], state.namespaces.len());

    let gateways = cp.gateway_infos();
    let mut f = Family::new(
        &mut out,
        "nvmeof_control_gateway_info",
        "gauge",
        "A gateway of the group, its ANA group, availability and whether it reaches Ceph, as its \
         last beacon said (always 1).",
    );
    for g in &gateways {
        let group = g.ana_group.to_string();
        f.sample(
            &[
                ("gateway", &g.name),
                ("ana_group", &group),
                ("availability", &g.availability),
                ("cluster", &g.cluster),
            ],
            1,
        );
    }
    let mut f = Family::new(
        &mut out,
        "nvmeof_control_gateway_beacon_age_seconds",
        "gauge",
        "Time since the gateway's last beacon, as this replica saw it.",
    );
    for g in &gateways {
        f.sample(
            &[("gateway", &g.name)],
            g.last_beacon_ms_ago as f64 / 1000.0,
        );
    }

    let ana = cp.ana_show();
    let mut f = Family::new(
        &mut out,
        "nvmeof_control_ana_group_info",
        "gauge",
        "An ANA group: its owner, the gateway holding it optimized (empty: none) and the \
         phase of a failover or failback (always 1).",
    );
    for g in &ana.groups {
        let group = g.ana_group.to_string();
        f.sample(
            &[
                ("ana_group", &group),
                ("owner", &g.owner),
                ("holder", &g.holder),
                ("phase", &g.phase),
            ],
            1,
        );
    }
    let mut f = Family::new(
        &mut out,
        "nvmeof_control_ana_group_namespaces",
        "gauge",
        "Namespaces in the ANA group.",
    );
    for g in &ana.groups {
        let group = g.ana_group.to_string();
        f.sample(&[("ana_group", &group)], g.namespaces);
    }
    out
}
