use super::*;
use crate::core::TransportType;
use crate::tcp::busy_poll::BusyPollConfig;

fn parse(text: &str) -> Result<Config, ConfigError> {
    let c: Config = toml::from_str(text).map_err(|source| ConfigError::Parse {
        path: "test".into(),
        source,
    })?;
    c.validate()?;
    Ok(c)
}

const GOOD: &str = r#"
        [[listener]]
        transport = "tcp"
        address = "127.0.0.1"
        port = 4420

        [[subsystem]]
        nqn = "nqn.2016-06.io.example:demo"
        allow_any_host = true

        [[subsystem.namespace]]
        nsid = 1
        backend = "memory"
        size = "1GiB"
    "#;

#[test]
fn sizes_parse_with_binary_units() {
    assert_eq!(parse_size("1GiB"), Some(1 << 30));
    assert_eq!(parse_size("256 MiB"), Some(256 << 20));
    assert_eq!(parse_size("4096"), Some(4096));
    assert_eq!(parse_size("1 parsec"), None);
    assert_eq!(parse_size("99999999999T"), None, "overflow is refused");
}

#[test]
fn a_good_config_builds_a_target_with_stable_ids() {
    let c = parse(GOOD).unwrap();
    let t1 = c.build_target().unwrap();
    let t2 = c.build_target().unwrap();
    let ns1 = t1
        .subsystem("nqn.2016-06.io.example:demo")
        .unwrap()
        .namespace(1)
        .unwrap();
    let ns2 = t2
        .subsystem("nqn.2016-06.io.example:demo")
        .unwrap()
        .namespace(1)
        .unwrap();
    assert_eq!(
        ns1.nguid, ns2.nguid,
        "same NGUID on every build (restart, other gateway)"
    );
    assert_ne!(ns1.nguid, [0; 16]);
    assert_ne!(ns1.uuid, [0; 16]);
    assert_ne!(ns1.nguid, ns1.uuid);
    assert_eq!(ns1.lba_shift, 9);
    assert_eq!(ns1.device.size_bytes(), 1 << 30);
}

#[test]
fn one_subsystem_is_served_over_tcp_and_rdma_on_the_same_port() {
    let both = GOOD.replace(
            "[[subsystem]]",
            "[[listener]]\n        transport = \"rdma\"\n        address = \"127.0.0.1\"\n        port = 4420\n\n        [[subsystem]]",
        );
    let c = parse(&both).unwrap();
    assert_eq!(c.listen_addrs(), vec!["127.0.0.1:4420".parse().unwrap()]);
    assert_eq!(
        c.rdma_listen_addrs(),
        vec!["127.0.0.1:4420".parse().unwrap()]
    );
    let t = c.build_target().unwrap();
    let transports: Vec<_> = t.listeners().iter().map(|l| l.transport).collect();
    assert_eq!(transports, vec![TransportType::Tcp, TransportType::Rdma]);
    let twice = both.replace("\"tcp\"", "\"rdma\"");
    let e = parse(&twice).unwrap_err().to_string();
    assert!(e.contains("listener[1]"), "{e}");
}

#[test]
fn errors_name_the_bad_field() {
    let cases = [
        (
            GOOD.replace("\"tcp\"", "\"carrier-pigeon\""),
            "listener[0].transport",
        ),
        (
            GOOD.replace("127.0.0.1", "localhost"),
            "listener[0].address",
        ),
        (
            GOOD.replace("nqn.2016-06.io.example:demo", "iqn bad"),
            "subsystem[0].nqn",
        ),
        (
            GOOD.replace("size = \"1GiB\"", "size = \"1GiB\"\nblock_size = 1000"),
            "subsystem[0].namespace[0].block_size",
        ),
        (
            GOOD.replace("nsid = 1", "nsid = 0"),
            "subsystem[0].namespace[0].nsid",
        ),
        (
            GOOD.replace("\"1GiB\"", "\"lots\""),
            "subsystem[0].namespace[0].size",
        ),
        (
            GOOD.replace("\"memory\"", "\"floppy\""),
            "subsystem[0].namespace[0].backend",
        ),
    ];
    for (text, field) in cases {
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.starts_with(field), "{err:?} should name {field}");
    }
}

/// GOOD with its listener's address and port lines replaced by `listener` (TOML lines).
fn with_listener(listener: &str) -> String {
    GOOD.replace("address = \"127.0.0.1\"\n        port = 4420", listener)
}

#[test]
fn ipv6_listener_addresses_parse_with_or_without_brackets_and_port() {
    let cases = [
        ("address = \"::1\"\nport = 4420", "[::1]:4420"),
        ("address = \"[::1]\"\nport = 4420", "[::1]:4420"),
        ("address = \"[::1]:4420\"", "[::1]:4420"),
        ("address = \"[::]:4420\"\nport = 4420", "[::]:4420"),
        ("address = \"[0:0::1]:4421\"", "[::1]:4421"),
        ("address = \"0.0.0.0:4422\"", "0.0.0.0:4422"),
    ];
    for (lines, want) in cases {
        let c = parse(&with_listener(lines)).unwrap_or_else(|e| panic!("{lines}: {e}"));
        let want: SocketAddr = want.parse().unwrap();
        assert_eq!(c.listen_addrs(), vec![want], "{lines}");
        // The discovery log's TRADDR is the canonical text: no brackets, no port.
        let t = c.build_target().unwrap();
        let l = &t.listeners()[0];
        assert_eq!(l.address, want.ip().to_string(), "{lines}");
        assert_eq!(l.port, want.port(), "{lines}");
    }
}

#[test]
fn bad_listener_addresses_name_the_field_and_the_problem() {
    let cases = [
        (
            "address = \"[::1]:4420\"\nport = 4421",
            "listener[0].port",
            "differs",
        ),
        ("address = \"[::1]\"", "listener[0].port", "[::1]:4420"),
        (
            "address = \"192.0.2.1\"",
            "listener[0].port",
            "192.0.2.1:4420",
        ),
        ("address = \"[::1]:0\"", "listener[0].port", "must not be 0"),
        (
            "address = \"::1:4420\"",
            "listener[0].port",
            "is read as the address ::1:4420",
        ),
        (
            "address = \"[127.0.0.1]\"\nport = 1",
            "listener[0].address",
            "not a numeric",
        ),
        (
            "address = \"[::1\"\nport = 1",
            "listener[0].address",
            "not a numeric",
        ),
        (
            "address = \"::1]:4420\"",
            "listener[0].address",
            "not a numeric",
        ),
        (
            "address = \"localhost:4420\"",
            "listener[0].address",
            "not a numeric",
        ),
        (
            "address = \"\"\nport = 1",
            "listener[0].address",
            "not a numeric",
        ),
        (
            "address = \" ::1\"\nport = 1",
            "listener[0].address",
            "not a numeric",
        ),
        (
            "address = \"[fe80::1%2]:4420\"",
            "listener[0].address",
            "scoped",
        ),
    ];
    for (lines, field, words) in cases {
        let err = parse(&with_listener(lines)).unwrap_err().to_string();
        assert!(
            err.starts_with(field),
            "{lines}: {err:?} should name {field}"
        );
        assert!(err.contains(words), "{lines}: {err:?} should say {words:?}");
    }
}

#[test]
fn busy_polling_is_adaptive_by_default_off_at_zero_and_bounded() {
    let with_poll = |us: &str| format!("[gateway]\ntcp_busy_poll_us = {us}\n{GOOD}");
    let default_window =
        std::time::Duration::from_micros(u64::from(super::DEFAULT_TCP_BUSY_POLL_US));
    assert_eq!(
        parse(GOOD).expect("valid").tcp_busy_poll(),
        Some(BusyPollConfig {
            window: default_window,
            adaptive: true
        }),
        "on and adaptive when unset"
    );
    assert_eq!(parse(&with_poll("0")).expect("valid").tcp_busy_poll(), None);
    let window = std::time::Duration::from_micros(250);
    assert_eq!(
        parse(&with_poll("250")).expect("valid").tcp_busy_poll(),
        Some(BusyPollConfig {
            window,
            adaptive: true
        }),
        "adaptive unless told otherwise"
    );
    let always =
        format!("[gateway]\ntcp_busy_poll_us = 250\ntcp_busy_poll_adaptive = false\n{GOOD}");
    assert_eq!(
        parse(&always).expect("valid").tcp_busy_poll(),
        Some(BusyPollConfig {
            window,
            adaptive: false
        })
    );
    let not_bool = format!("[gateway]\ntcp_busy_poll_us = 250\ntcp_busy_poll_adaptive = 1\n{GOOD}");
    assert!(parse(&not_bool).is_err());
    // Alone it applies to the default window.
    let alone = format!("[gateway]\ntcp_busy_poll_adaptive = false\n{GOOD}");
    assert_eq!(
        parse(&alone)
            .expect("valid: always polling")
            .tcp_busy_poll(),
        Some(BusyPollConfig {
            window: default_window,
            adaptive: false
        })
    );
    let off = format!("[gateway]\ntcp_busy_poll_us = 0\ntcp_busy_poll_adaptive = true\n{GOOD}");
    assert_eq!(parse(&off).expect("valid: off").tcp_busy_poll(), None);
    let err = parse(&with_poll("10001")).unwrap_err().to_string();
    assert!(err.starts_with("gateway.tcp_busy_poll_us"), "{err}");
    assert!(err.contains("more than 10000"), "{err}");
    assert!(parse(&with_poll("-1")).is_err());
}

#[test]
fn the_tcp_data_budget_is_a_size_of_at_least_one_transfer() {
    let with_budget = |size: &str| format!("[gateway]\ntcp_data_budget = \"{size}\"\n{GOOD}");
    assert_eq!(
        parse(GOOD).expect("valid").tcp_data_budget(),
        256 << 20,
        "the default"
    );
    assert_eq!(
        parse(&with_budget("2GiB"))
            .expect("valid")
            .tcp_data_budget(),
        2 << 30
    );
    assert_eq!(
        parse(&with_budget("1MiB"))
            .expect("valid")
            .tcp_data_budget(),
        1 << 20
    );
    for (size, words) in [
        ("512KiB", "less than one command's largest transfer"),
        ("lots", "not a size"),
        ("", "not a size"),
    ] {
        let err = parse(&with_budget(size)).unwrap_err().to_string();
        assert!(err.starts_with("gateway.tcp_data_budget"), "{err}");
        assert!(err.contains(words), "{size}: {err}");
    }
}

#[test]
fn the_metrics_address_needs_a_port_and_its_own_socket() {
    let with_metrics = |addr: &str| format!("[gateway]\nmetrics_listen = \"{addr}\"\n{GOOD}");
    let ok = parse(&with_metrics("[::]:10008")).expect("valid");
    assert_eq!(ok.metrics_addr(), Some("[::]:10008".parse().unwrap()));
    assert_eq!(
        parse(GOOD).expect("valid").metrics_addr(),
        None,
        "off unless set"
    );
    for (addr, words) in [
        ("127.0.0.1", "missing the port: \"127.0.0.1:10008\""),
        ("127.0.0.1:0", "must not be 0"),
        ("metrics.example:10008", "not a numeric"),
        (
            "0.0.0.0:4420",
            "overlaps the NVMe/TCP listener 127.0.0.1:4420",
        ),
    ] {
        let err = parse(&with_metrics(addr)).unwrap_err().to_string();
        assert!(
            err.starts_with("gateway.metrics_listen") && err.contains(words),
            "{addr}: {err:?} should name the field and say {words:?}"
        );
    }
}

#[test]
fn listeners_that_cannot_both_bind_are_refused() {
    let two = |a: &str, b: &str| {
        with_listener(&format!(
                "address = \"{a}\"\n\n        [[listener]]\n        transport = \"tcp\"\n        address = \"{b}\""
            ))
    };
    for (a, b, words) in [
        ("[::]:4420", "127.0.0.1:4420", "overlaps listener[0]"),
        ("127.0.0.1:4420", "[::]:4420", "overlaps listener[0]"),
        ("0.0.0.0:4420", "10.0.0.1:4420", "overlaps listener[0]"),
        ("[::]:4420", "[::1]:4420", "overlaps listener[0]"),
        ("[::1]:4420", "[0::1]:4420", "listed twice"),
        ("[::ffff:127.0.0.1]:4420", "127.0.0.1:4420", "listed twice"),
    ] {
        let err = parse(&two(a, b)).unwrap_err().to_string();
        assert!(err.starts_with("listener[1]"), "{a} + {b}: {err:?}");
        assert!(err.contains(words), "{a} + {b}: {err:?}");
    }
    // Different ports, or an IPv4 wildcard next to an IPv6 address: both bind.
    for (a, b) in [
        ("[::]:4420", "127.0.0.1:4421"),
        ("0.0.0.0:4420", "[::1]:4420"),
        ("[::1]:4420", "127.0.0.1:4420"),
    ] {
        let c = parse(&two(a, b)).unwrap_or_else(|e| panic!("{a} + {b}: {e}"));
        assert_eq!(c.listen_addrs().len(), 2);
    }
}

const RBD: &str = r#"
        [[listener]]
        transport = "tcp"
        address = "127.0.0.1"
        port = 4420

        [[subsystem]]
        nqn = "nqn.2016-06.io.example:demo"
        allow_any_host = true

        [[subsystem.namespace]]
        nsid = 1
        backend = "memory"
        size = "1GiB"

        [[subsystem.namespace]]
        nsid = 2
        backend = "rbd"
        pool = "rbd"
        image = "img0"

        [ceph]
        client_name = "admin"
        args = "--rados_osd_op_timeout=30"
        connections = 2

        [ceph.options]
        rados_mon_op_timeout = 30
        rbd_cache = false
    "#;

#[test]
fn rbd_namespaces_and_the_ceph_section_parse() {
    let c = parse(RBD).unwrap();
    let ns = &c.subsystems[0].namespaces[1];
    assert_eq!(ns.pool.as_deref(), Some("rbd"));
    assert_eq!(ns.image.as_deref(), Some("img0"));
    let s = c.ceph.as_ref().unwrap().settings();
    assert_eq!(s.entity_name(), "client.admin");
    assert_eq!(s.max_connections, 2);
    assert_eq!(s.args, vec!["--rados_osd_op_timeout=30".to_string()]);
    assert_eq!(
        s.options,
        vec![
            ("rados_mon_op_timeout".to_string(), "30".to_string()),
            ("rbd_cache".to_string(), "false".to_string())
        ]
    );
    let spec = rbd_spec("x", ns).unwrap();
    assert_eq!(spec.to_string(), "rbd/img0");
    let with_ns = parse(&RBD.replace(
        "image = \"img0\"",
        "image = \"img0\"\nrados_namespace = \"tenant1\"",
    ))
    .unwrap();
    let spec = rbd_spec("x", &with_ns.subsystems[0].namespaces[1]).unwrap();
    assert_eq!(spec.to_string(), "rbd/tenant1/img0");
}

#[test]
fn rbd_errors_name_the_bad_field() {
    let cases = [
            (RBD.replace("pool = \"rbd\"\n", ""), "subsystem[0].namespace[1].pool"),
            (RBD.replace("image = \"img0\"", "image = \"\""), "subsystem[0].namespace[1].image"),
            (RBD.replace("image = \"img0\"", "image = \"a/b\""), "subsystem[0].namespace[1].image"),
            (RBD.replace("image = \"img0\"", "image = \"img0\"\nsize = \"1GiB\""), "subsystem[0].namespace[1].size"),
            (RBD.replace("size = \"1GiB\"", "size = \"1GiB\"\nimage = \"x\""), "subsystem[0].namespace[0].image"),
            (RBD.replace("image = \"img0\"", "image = \"img0\"\nrados_namespace = \"a@b\""), "subsystem[0].namespace[1].rados_namespace"),
            (RBD.replace("connections = 2", "connections = 0"), "ceph.connections"),
            (RBD.replace("--rados_osd_op_timeout=30", "rados_osd_op_timeout=30"), "ceph.args"),
            (RBD.replace("client_name = \"admin\"", "conf = \"/nonexistent/ceph.conf\""), "ceph.conf"),
            (
                RBD.replace(
                    "[ceph]",
                    "[[subsystem]]\nnqn = \"nqn.2016-06.io.example:two\"\n[[subsystem.namespace]]\nnsid = 1\nbackend = \"rbd\"\npool = \"rbd\"\nimage = \"img0\"\n[ceph]",
                ),
                "subsystem[1].namespace[0].image",
            ),
        ];
    for (text, field) in cases {
        let err = match parse(&text) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("accepted, should fail on {field}:\n{text}"),
        };
        assert!(err.starts_with(field), "{err:?} should name {field}");
    }
}

/// The cluster in this conf has no monitors, so the image cannot be opened (on a machine
/// without librbd, the library is missing: same outcome). The namespace is left out and
/// reported; the memory namespace still serves.
#[test]
fn a_namespace_whose_image_cannot_be_opened_is_skipped_and_reported() {
    let dir = std::env::temp_dir().join(format!("cfgtest-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let conf = dir.join("ceph.conf");
    std::fs::write(&conf, "[global]\nlog_file = /dev/null\n").unwrap();
    let text = RBD
        .replace(
            "client_name = \"admin\"",
            &format!(
                "client_name = \"admin\"\nconf = \"{}\"\nuse_ceph_args_env = false",
                conf.display()
            ),
        )
        .replace("--rados_osd_op_timeout=30", "--client_mount_timeout=2");
    let c = parse(&text).unwrap();
    let (target, skipped) = c.build_target_report().unwrap();
    let sub = target.subsystem("nqn.2016-06.io.example:demo").unwrap();
    assert!(sub.namespace(1).is_some(), "the memory namespace serves");
    assert!(sub.namespace(2).is_none(), "the rbd namespace is left out");
    assert_eq!(skipped.len(), 1);
    assert_eq!(skipped[0].field, "subsystem[0].namespace[1]");
    assert_eq!(skipped[0].device, "rbd/img0");
    assert_eq!(skipped[0].nsid, 2);
    assert!(!skipped[0].error.is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn unknown_keys_are_refused() {
    let err = parse(&GOOD.replace("port = 4420", "port = 4420\nprot = 1")).unwrap_err();
    assert!(err.to_string().contains("prot"), "{err}");
}

const SPEC_KEY: &str = "DHHC-1:00:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:";

fn with_hosts(hosts: &str, gateway: &str) -> String {
    format!(
        r#"
        [gateway]
        {gateway}

        [[listener]]
        transport = "tcp"
        address = "127.0.0.1"
        port = 4420

        [[subsystem]]
        nqn = "nqn.2016-06.io.example:demo"
        hosts = [{hosts}]
        "#
    )
}

#[test]
fn hosts_may_carry_dhchap_keys_which_the_target_requires() {
    let text = with_hosts(
        &format!(
            r#""nqn.2014-08.org.example:plain",
               {{ nqn = "nqn.2014-08.org.example:keyed", dhchap_key = "{SPEC_KEY}" }},
               {{ nqn = "nqn.2014-08.org.example:both", dhchap_key = "{SPEC_KEY}", dhchap_ctrl_key = "{SPEC_KEY}" }}"#
        ),
        r#"dhchap_hashes = ["sha256"]
           dhchap_dhgroups = ["ffdhe3072", "null"]"#,
    );
    let c = parse(&text).unwrap();
    let target = c.build_target().unwrap();
    assert_eq!(
        target.auth_policy(),
        &crate::core::AuthPolicy {
            hashes: vec![crate::auth::HashFunction::Sha256],
            dhgroups: vec![crate::auth::DhGroup::Ffdhe3072, crate::auth::DhGroup::Null],
        }
    );
    let sub = target.subsystem("nqn.2016-06.io.example:demo").unwrap();
    for host in ["plain", "keyed", "both"] {
        assert!(sub.allows_host(&format!("nqn.2014-08.org.example:{host}")));
    }
    assert!(sub.host_keys("nqn.2014-08.org.example:plain").is_none());
    let keyed = sub.host_keys("nqn.2014-08.org.example:keyed").unwrap();
    assert!(keyed.ctrl.is_none());
    assert!(sub
        .host_keys("nqn.2014-08.org.example:both")
        .unwrap()
        .ctrl
        .is_some());
    // The keys never show in the configuration's Debug output.
    assert!(!format!("{c:?}").contains("ia6z"));
}

#[test]
fn bad_keys_and_preferences_name_the_field_without_the_secret() {
    let bad_key = with_hosts(
        r#"{ nqn = "nqn.2014-08.org.example:h", dhchap_key = "DHHC-1:00:ia7zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:" }"#,
        "",
    );
    let e = parse(&bad_key).unwrap_err().to_string();
    assert!(e.starts_with("subsystem[0].hosts[0].dhchap_key: "), "{e}");
    assert!(e.contains("CRC"), "{e}");
    assert!(
        !e.contains("ia7z"),
        "the secret stays out of the message: {e}"
    );

    let ctrl_only = with_hosts(
        &format!(r#"{{ nqn = "nqn.2014-08.org.example:h", dhchap_ctrl_key = "{SPEC_KEY}" }}"#),
        "",
    );
    let e = parse(&ctrl_only).unwrap_err().to_string();
    assert!(
        e.starts_with("subsystem[0].hosts[0].dhchap_ctrl_key: needs dhchap_key"),
        "{e}"
    );

    let typo = with_hosts(
        r#"{ nqn = "nqn.2014-08.org.example:h", dhchap_secret = "x" }"#,
        "",
    );
    let e = parse(&typo).unwrap_err().to_string();
    assert!(e.contains("unknown field `dhchap_secret`"), "{e}");

    let twice = with_hosts(
        r#""nqn.2014-08.org.example:h", { nqn = "nqn.2014-08.org.example:h" }"#,
        "",
    );
    let e = parse(&twice).unwrap_err().to_string();
    assert!(e.starts_with("subsystem[0].hosts[1]: "), "{e}");

    for (prefs, expect) in [
        (
            r#"dhchap_hashes = ["md5"]"#,
            "gateway.dhchap_hashes: \"md5\" is not one of",
        ),
        (
            r#"dhchap_hashes = []"#,
            "gateway.dhchap_hashes: must name at least one",
        ),
        (
            r#"dhchap_dhgroups = ["null", "null"]"#,
            "gateway.dhchap_dhgroups: \"null\" is listed twice",
        ),
        (
            r#"dhchap_dhgroups = ["modp2048"]"#,
            "gateway.dhchap_dhgroups: \"modp2048\" is not one of",
        ),
    ] {
        let e = parse(&with_hosts(r#""nqn.2014-08.org.example:h""#, prefs))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with(expect), "{prefs}: {e}");
    }
}

#[test]
fn reservations_are_on_by_default_and_persisted_in_a_group() {
    let target = parse(GOOD).unwrap().build_target().unwrap();
    assert!(target.reservations_enabled());
    assert!(!target.reservations_persisted(), "alone: in memory");
    let off = GOOD.replace(
        "[[listener]]",
        "[gateway]\nreservations = false\n\n[[listener]]",
    );
    assert!(!parse(&off)
        .unwrap()
        .build_target()
        .unwrap()
        .reservations_enabled());
    let grouped = format!(
        "[gateway]\nname = \"gw1\"\nreservations = true\n\n[group]\ncontrol_plane = [\"127.0.0.1:5500\"]\n{GOOD}"
    );
    let target = parse(&grouped).unwrap().build_target().unwrap();
    assert!(target.reservations_enabled() && target.reservations_persisted());
    let grouped_default = grouped.replace("reservations = true\n", "");
    let target = parse(&grouped_default).unwrap().build_target().unwrap();
    assert!(target.reservations_enabled(), "on by default in a group");
    assert!(
        target.reservations_persisted(),
        "stored with the image in a group"
    );
    let grouped_off = grouped.replace("reservations = true", "reservations = false");
    let target = parse(&grouped_off).unwrap().build_target().unwrap();
    assert!(!target.reservations_enabled(), "the switch");
}

#[test]
fn only_a_group_gateway_may_have_no_listener() {
    let no_listener = "[gateway]\nname = \"gw1\"\n";
    let e = parse(no_listener).expect_err("a standalone gateway needs a listener");
    assert!(
        e.to_string()
            .contains("at least one [[listener]] is required"),
        "{e}"
    );
    let c = parse(&format!(
        "{no_listener}\n[group]\ncontrol_plane = [\"127.0.0.1:5500\"]\n"
    ))
    .expect("a group gateway gets its listeners from the control plane");
    assert!(c.listeners.is_empty());
}

/// Subsystem and host NQNs as Linux nvmet takes them: a name outside the NVMe formats
/// (`testnqn`, as nvmetcli configurations and test suites use) with a warning naming the
/// field; 224 bytes, a space or a control character refused, the error naming the field.
#[test]
fn nqns_are_taken_as_linux_nvmet_takes_them_with_a_warning_outside_the_spec() {
    let named = GOOD.replace("nqn.2016-06.io.example:demo", "testnqn");
    let c = parse(&named).expect("testnqn is taken");
    let warnings = c.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].starts_with("subsystem[0].nqn \"testnqn\" is not in the NVMe formats"),
        "{warnings:?}"
    );
    assert!(c.build_target().unwrap().subsystem("testnqn").is_some());
    assert!(
        parse(GOOD).unwrap().warnings().is_empty(),
        "spec names: no warning"
    );

    let host = with_hosts(r#""testhost""#, "");
    let warnings = parse(&host)
        .expect("a host NQN outside the formats")
        .warnings();
    assert!(
        warnings.len() == 1 && warnings[0].starts_with("subsystem[0].hosts[0] \"testhost\""),
        "{warnings:?}"
    );

    let too_long = "n".repeat(224);
    for bad in [too_long.as_str(), "test nqn", "test\u{1}nqn"] {
        let toml_string = format!("{bad:?}").replace("\\u{1}", "\\u0001");
        let text = GOOD.replace("\"nqn.2016-06.io.example:demo\"", &toml_string);
        let e = parse(&text).expect_err(bad).to_string();
        assert!(e.starts_with("subsystem[0].nqn"), "{bad:?}: {e}");
        let text = with_hosts(&toml_string, "");
        let e = parse(&text).expect_err(bad).to_string();
        assert!(e.starts_with("subsystem[0].hosts[0]"), "{bad:?}: {e}");
    }
}

#[test]
fn tls_psks_and_secure_listeners_are_checked_without_showing_the_key() {
    const PSK: &str = "NVMeTLSkey-1:01:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:";
    let good = with_hosts(
        &format!(
            r#"{{ nqn = "nqn.2014-08.org.example:h", psk = "{PSK}", psk_derivation = "libnvme-compat" }}"#
        ),
        "",
    );
    let c = parse(&good).expect("valid");
    let psk = c.subsystems[0].hosts[0]
        .tls_psk()
        .expect("valid")
        .expect("set");
    assert_eq!(psk.derivation, LabelEncoding::LibnvmeCompat);
    assert!(
        !format!("{c:?}").contains("AAEC"),
        "the key in Debug output"
    );

    let typo = with_hosts(
        &format!(
            r#"{{ nqn = "nqn.2014-08.org.example:h", psk = "{}" }}"#,
            PSK.replacen("AAEC", "AAED", 1)
        ),
        "",
    );
    let e = parse(&typo).unwrap_err().to_string();
    assert!(e.starts_with("subsystem[0].hosts[0].psk: "), "{e}");
    assert!(e.contains("CRC") && !e.contains("AAED"), "{e}");

    let derivation = with_hosts(
        &format!(
            r#"{{ nqn = "nqn.2014-08.org.example:h", psk = "{PSK}", psk_derivation = "v2" }}"#
        ),
        "",
    );
    let e = parse(&derivation).unwrap_err().to_string();
    assert!(
        e.starts_with("subsystem[0].hosts[0].psk_derivation: "),
        "{e}"
    );

    let rdma = with_hosts(r#""nqn.2014-08.org.example:h""#, "").replace(
        "port = 4420",
        "port = 4420\n        secure = true\n\n        [[listener]]\n        transport = \"rdma\"\n        address = \"127.0.0.1\"\n        port = 4421\n        secure = true",
    );
    let e = parse(&rdma).unwrap_err().to_string();
    assert!(e.starts_with("listener[1].secure: "), "{e}");
}

/// `auto_visible` and `hosts` of a namespace: a list only with `auto_visible = false`, each
/// host a valid NQN once, at most MAX_HOSTS_PER_NAMESPACE; each error names its field.
#[test]
fn namespace_hosts_are_checked() {
    let with = |lines: &str| GOOD.replace("size = \"1GiB\"", &format!("size = \"1GiB\"\n{lines}"));
    let host = |i: usize| format!("\"nqn.2014-08.org.nvmexpress:uuid:{i:08}\"");
    let ok = parse(&with(&format!(
        "auto_visible = false\nhosts = [{}]",
        host(1)
    )))
    .expect("valid");
    let ns = &ok.subsystems[0].namespaces[0];
    assert_eq!(
        ns.visibility(),
        crate::core::Visibility::Only(
            ["nqn.2014-08.org.nvmexpress:uuid:00000001".to_string()].into()
        )
    );
    parse(&with("auto_visible = false")).expect("visible to no host yet");
    let many: Vec<String> = (0..=MAX_HOSTS_PER_NAMESPACE).map(host).collect();
    let cases = [
        (
            with(&format!("hosts = [{}]", host(1))),
            "subsystem[0].namespace[0].hosts",
        ),
        (
            with(&format!(
                "auto_visible = false\nhosts = [{}, {}]",
                host(1),
                host(1)
            )),
            "subsystem[0].namespace[0].hosts[1]",
        ),
        (
            with("auto_visible = false\nhosts = [\"bad host\"]"),
            "subsystem[0].namespace[0].hosts[0]",
        ),
        (
            with(&format!(
                "auto_visible = false\nhosts = [{}]",
                many.join(", ")
            )),
            "subsystem[0].namespace[0].hosts",
        ),
    ];
    for (text, field) in cases {
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.starts_with(field), "{err:?} should name {field}");
    }
    let at_limit = &many[..MAX_HOSTS_PER_NAMESPACE];
    parse(&with(&format!(
        "auto_visible = false\nhosts = [{}]",
        at_limit.join(", ")
    )))
    .expect("the limit itself is taken");
}

/// GOOD with namespace 1 as `namespace` (TOML lines).
fn with_namespace(namespace: &str) -> Result<Config, ConfigError> {
    parse(&GOOD.replace(
        "nsid = 1\n        backend = \"memory\"\n        size = \"1GiB\"",
        namespace,
    ))
}

fn identity_of(c: &Config) -> ([u8; 16], [u8; 16]) {
    let s = &c.subsystems[0];
    super::build::namespace_identity(&s.nqn, &s.namespaces[0])
}

#[test]
fn another_image_under_an_nsid_is_another_namespace_to_hosts() {
    let rbd = |image: &str| {
        with_namespace(&format!(
            "nsid = 1\n        backend = \"rbd\"\n        pool = \"rbd\"\n        image = \"{image}\""
        ))
        .expect("valid")
    };
    let (a, a_again, b) = (rbd("a"), rbd("a"), rbd("b"));
    assert_eq!(
        identity_of(&a),
        identity_of(&a_again),
        "every gateway, every start"
    );
    assert_ne!(
        identity_of(&a).0,
        identity_of(&b).0,
        "NGUID reused for another image"
    );
    assert_ne!(
        identity_of(&a).1,
        identity_of(&b).1,
        "UUID reused for another image"
    );
    let in_pool = |pool: &str, rados_ns: &str| {
        with_namespace(&format!(
            "nsid = 1\n        backend = \"rbd\"\n        pool = \"{pool}\"\n        rados_namespace = \"{rados_ns}\"\n        image = \"a\""
        ))
        .expect("valid")
    };
    assert_ne!(
        identity_of(&in_pool("rbd", "x")),
        identity_of(&in_pool("rbd", "y"))
    );
    assert_ne!(
        identity_of(&in_pool("rbd", "x")),
        identity_of(&in_pool("other", "x"))
    );
    // An in-memory namespace keeps the identity it always had (UUIDv5 of "<nqn>/<nsid>" and
    // "nguid:<nqn>/<nsid>"; the same values from Python's uuid.uuid5).
    let memory = with_namespace("nsid = 1\n        backend = \"memory\"\n        size = \"1GiB\"")
        .expect("valid");
    let (nguid, uuid) = identity_of(&memory);
    assert_eq!(
        uuid::Uuid::from_bytes(nguid).simple().to_string(),
        "42b1a0c108f657b68f08d9378e269a1d"
    );
    assert_eq!(
        uuid::Uuid::from_bytes(uuid).hyphenated().to_string(),
        "4bedead6-c57f-522e-8691-39fc53a5e3a1"
    );
}

#[test]
fn a_pinned_identity_is_served_and_checked() {
    let pinned = with_namespace(
        "nsid = 1\n        backend = \"memory\"\n        size = \"1MiB\"\n        \
         uuid = \"3F2504E0-4F89-41D3-9A0C-0305E82C3301\"\n        \
         nguid = \"00112233445566778899aabbccddeeff\"",
    )
    .expect("valid");
    let target = pinned.build_target().expect("build");
    let ns = target
        .subsystem("nqn.2016-06.io.example:demo")
        .and_then(|s| s.namespace(1))
        .expect("namespace 1");
    assert_eq!(
        uuid::Uuid::from_bytes(ns.uuid).to_string(),
        "3f2504e0-4f89-41d3-9a0c-0305e82c3301"
    );
    assert_eq!(
        uuid::Uuid::from_bytes(ns.nguid).simple().to_string(),
        "00112233445566778899aabbccddeeff"
    );
    for (line, field) in [
        ("uuid = \"00000000-0000-0000-0000-000000000000\"", "uuid"),
        ("nguid = \"0011\"", "nguid"),
        ("nguid = \"not hex at all, not 32 digits\"", "nguid"),
    ] {
        let e = with_namespace(&format!(
            "nsid = 1\n        backend = \"memory\"\n        size = \"1MiB\"\n        {line}"
        ))
        .expect_err(line);
        assert!(
            e.to_string()
                .contains(&format!("subsystem[0].namespace[0].{field}")),
            "{e}"
        );
    }
    // Two namespaces with one UUID would be one namespace to hosts (multipath joins them).
    let twice = with_namespace(
        "nsid = 1\n        backend = \"memory\"\n        size = \"1MiB\"\n        \
         uuid = \"3f2504e0-4f89-41d3-9a0c-0305e82c3301\"\n\n        \
         [[subsystem.namespace]]\n        nsid = 2\n        backend = \"memory\"\n        \
         size = \"1MiB\"\n        uuid = \"3f2504e0-4f89-41d3-9a0c-0305e82c3301\"",
    )
    .expect_err("the same UUID twice");
    assert!(
        twice
            .to_string()
            .contains("subsystem[0].namespace[1].uuid: the same UUID as subsystem[0].namespace[0]"),
        "{twice}"
    );
}

#[test]
fn previous_identities_are_printed_for_unpinned_rbd_namespaces_only() {
    let c = parse(
        r#"
        [[listener]]
        transport = "tcp"
        address = "127.0.0.1"
        port = 4420

        [[subsystem]]
        nqn = "nqn.2016-06.io.example:disks"
        allow_any_host = true

        [[subsystem.namespace]]
        nsid = 3
        backend = "rbd"
        pool = "rbd"
        image = "vm1"

        [[subsystem.namespace]]
        nsid = 4
        backend = "rbd"
        pool = "rbd"
        image = "vm2"
        uuid = "3f2504e0-4f89-41d3-9a0c-0305e82c3301"

        [[subsystem.namespace]]
        nsid = 5
        backend = "memory"
        size = "1MiB"
    "#,
    )
    .expect("valid");
    // The group's legacy derivation and the one gateways used: one and the same.
    let (nguid, uuid) = control_plane::state::legacy_ids("nqn.2016-06.io.example:disks", 3);
    assert_eq!(
        c.previous_identity_pins(),
        format!(
            "# subsystem[0].namespace[0]: nqn.2016-06.io.example:disks NSID 3 (rbd/vm1)\n\
             uuid = \"{uuid}\"\nnguid = \"{nguid}\"\n"
        )
    );
    // Pinned with them, the namespace is served as before.
    let pinned = GOOD.replace(
        "nsid = 1\n        backend = \"memory\"\n        size = \"1GiB\"",
        &format!(
            "nsid = 3\n        backend = \"rbd\"\n        pool = \"rbd\"\n        image = \"vm1\"\n        uuid = \"{uuid}\"\n        nguid = \"{nguid}\""
        ),
    )
    .replace("nqn.2016-06.io.example:demo", "nqn.2016-06.io.example:disks");
    let pinned = parse(&pinned).expect("pinned");
    let (g, u) = identity_of(&pinned);
    assert_eq!(uuid::Uuid::from_bytes(u).hyphenated().to_string(), uuid);
    assert_eq!(uuid::Uuid::from_bytes(g).simple().to_string(), nguid);
}
