//! Per-host namespace visibility in the group state: a namespace added with
//! `--no-auto-visible` is visible only to the hosts on its list (`namespace add-host`,
//! `namespace del-host`); any other namespace to every host allowed on its subsystem. The
//! list is stored in the namespace's entry ([`NamespaceEntry::hosts`]) and pushed with it in
//! every gateway's assignment; each gateway hides the namespace from the other hosts'
//! controllers (an inactive NSID to them) and tells exactly the controllers whose view
//! changed.
//!
//! A host on a namespace's list need not be allowed on the subsystem, as with ceph-nvmeof's
//! `namespace add_host` (which checks only that the namespace is not visible to all): the
//! list only narrows which of the allowed hosts see the namespace, a host gets its
//! namespaces ready before it is allowed to connect, and removing a host from the subsystem
//! (`host del`) revokes its access without rewriting every namespace's list. The reply says
//! when a host added is not allowed yet.

use crate::state::{ConfigError, GroupState, NamespaceEntry};

/// Hosts a namespace may be visible to: a hypervisor cluster's nodes with room to spare
/// (ceph-nvmeof stops at 16 by default). Each gateway checks a host against a namespace's
/// list with one lookup, whatever its length (see the gateway's `core::visibility`).
pub const MAX_HOSTS_PER_NAMESPACE: usize = 1024;
// A hypervisor cluster's 64 nodes at least (issue 25).
const _: () = assert!(MAX_HOSTS_PER_NAMESPACE >= 64);

impl GroupState {
    fn restricted_namespace(
        &mut self,
        nqn: &str,
        nsid: u32,
    ) -> Result<&mut NamespaceEntry, ConfigError> {
        if !self.subsystems.contains_key(nqn) {
            return Err(ConfigError::NoSubsystem(nqn.to_string()));
        }
        let ns =
            self.namespaces
                .get_mut(&(nqn.to_string(), nsid))
                .ok_or(ConfigError::NoNamespace {
                    nqn: nqn.into(),
                    nsid,
                })?;
        if !ns.no_auto_visible {
            return Err(ConfigError::NamespaceAutoVisible {
                nqn: nqn.into(),
                nsid,
            });
        }
        Ok(ns)
    }

    /// Makes namespace `nsid` of `nqn` (added with `no_auto_visible`) visible to `host`.
    /// Refused, changing nothing: an unknown subsystem or namespace, a namespace visible to
    /// every host, an invalid host NQN, a host already on the list, a full list.
    pub fn add_namespace_host(
        &mut self,
        nqn: &str,
        nsid: u32,
        host: &str,
    ) -> Result<(), ConfigError> {
        crate::state::check_nqn("host NQN", host)?;
        let ns = self.restricted_namespace(nqn, nsid)?;
        if ns.hosts.contains(host) {
            return Err(ConfigError::NamespaceHostExists {
                nqn: nqn.into(),
                nsid,
                host: host.into(),
            });
        }
        if ns.hosts.len() >= MAX_HOSTS_PER_NAMESPACE {
            return Err(ConfigError::TooManyNamespaceHosts {
                nqn: nqn.into(),
                nsid,
                max: MAX_HOSTS_PER_NAMESPACE,
            });
        }
        ns.hosts.insert(host.to_string());
        Ok(())
    }

    /// Hides namespace `nsid` of `nqn` from `host` again. Refused, changing nothing: an
    /// unknown subsystem or namespace, a namespace visible to every host, a host not on its
    /// list.
    pub fn del_namespace_host(
        &mut self,
        nqn: &str,
        nsid: u32,
        host: &str,
    ) -> Result<(), ConfigError> {
        let ns = self.restricted_namespace(nqn, nsid)?;
        if !ns.hosts.remove(host) {
            return Err(ConfigError::NoNamespaceHost {
                nqn: nqn.into(),
                nsid,
                host: host.into(),
            });
        }
        Ok(())
    }

    /// Whether `host` may connect to subsystem `nqn` now (any host, or on its list).
    pub fn host_allowed(&self, nqn: &str, host: &str) -> bool {
        self.subsystems.get(nqn).is_some_and(|s| {
            s.allow_any_host
                || self
                    .hosts
                    .contains_key(&(nqn.to_string(), host.to_string()))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ana::{Event, GroupMap, Timing};

    const NQN: &str = "nqn.2016-06.io.test:vis";
    const HOST_A: &str = "nqn.2014-08.org.nvmexpress:uuid:a";
    const HOST_B: &str = "nqn.2014-08.org.nvmexpress:uuid:b";

    /// One gateway, a subsystem allowing host A, namespace 1 visible to all and 2 (added
    /// with no_auto_visible) to nobody yet.
    fn state() -> GroupState {
        let mut map = GroupMap::new(Timing::default());
        map.handle(Event::Beacon {
            gateway: "gw1".into(),
            ana_group: 1,
            incarnation: 1,
            addrs: vec![],
            group_addrs: None,
            applied_epoch: 0,
            cluster: crate::ana::ClusterReach::Unknown,
            now_ms: 0,
        })
        .expect("beacon");
        let mut st = GroupState {
            map: Some(map),
            ..GroupState::default()
        };
        st.add_subsystem(NQN, "", false, 0).expect("subsystem");
        st.add_host(NQN, HOST_A).expect("host");
        for (nsid, restricted) in [(1, false), (2, true)] {
            st.add_namespace(NamespaceEntry {
                subsystem_nqn: NQN.into(),
                nsid,
                pool: "rbd".into(),
                rados_namespace: String::new(),
                image: format!("img{nsid}"),
                block_size: 512,
                ana_group: 1,
                moving_from: 0,
                no_auto_visible: restricted,
                hosts: Default::default(),
                qos: Default::default(),
                nguid: String::new(),
                uuid: String::new(),
                trash_image: false,
                frozen_size: None,
            })
            .expect("namespace");
        }
        st
    }

    fn hosts_of(st: &GroupState, nsid: u32) -> Vec<&str> {
        st.namespaces[&(NQN.to_string(), nsid)]
            .hosts
            .iter()
            .map(String::as_str)
            .collect()
    }

    #[test]
    fn hosts_are_added_and_removed_and_survive_the_omap() {
        let mut st = state();
        st.add_namespace_host(NQN, 2, HOST_A).expect("allowed host");
        // Not allowed on the subsystem (yet): taken, as ceph-nvmeof takes it.
        assert!(!st.host_allowed(NQN, HOST_B));
        st.add_namespace_host(NQN, 2, HOST_B)
            .expect("not yet allowed host");
        assert_eq!(hosts_of(&st, 2), [HOST_A, HOST_B]);
        // Stored and loaded again (another replica), and written as a one-key delta.
        let old = st.clone();
        st.del_namespace_host(NQN, 2, HOST_A).expect("del");
        assert_eq!(hosts_of(&st, 2), [HOST_B]);
        let (set, remove) = st.diff(&old);
        assert_eq!(set.len(), 1, "{set:?}");
        assert!(remove.is_empty());
        let mut replica = old.clone();
        replica.apply(&set, &remove).expect("apply");
        assert_eq!(replica.namespaces, st.namespaces);
        let mut omap = st.to_omap();
        omap.insert("version".into(), b"3".to_vec());
        let loaded = GroupState::from_omap(&omap).expect("load");
        assert_eq!(loaded.namespaces, st.namespaces);
        // A namespace visible to all encodes as before visibility existed.
        let key = omap
            .keys()
            .find(|k| k.ends_with("0000000001"))
            .expect("ns 1");
        let text = String::from_utf8_lossy(&omap[key]).to_string();
        assert!(
            !text.contains("hosts") && !text.contains("auto_visible"),
            "{text}"
        );
    }

    #[test]
    fn bad_requests_are_refused_and_change_nothing() {
        let mut st = state();
        st.add_namespace_host(NQN, 2, HOST_A).expect("host");
        let before = st.clone();
        let other = "nqn.2016-06.io.test:other";
        let cases: Vec<(ConfigError, Result<(), ConfigError>)> = vec![
            (
                ConfigError::NoSubsystem(other.into()),
                st.add_namespace_host(other, 2, HOST_A),
            ),
            (
                ConfigError::NoNamespace {
                    nqn: NQN.into(),
                    nsid: 9,
                },
                st.add_namespace_host(NQN, 9, HOST_A),
            ),
            (
                ConfigError::NamespaceAutoVisible {
                    nqn: NQN.into(),
                    nsid: 1,
                },
                st.add_namespace_host(NQN, 1, HOST_A),
            ),
            (
                ConfigError::NamespaceAutoVisible {
                    nqn: NQN.into(),
                    nsid: 1,
                },
                st.del_namespace_host(NQN, 1, HOST_A),
            ),
            (
                ConfigError::NamespaceHostExists {
                    nqn: NQN.into(),
                    nsid: 2,
                    host: HOST_A.into(),
                },
                st.add_namespace_host(NQN, 2, HOST_A),
            ),
            (
                ConfigError::NoNamespaceHost {
                    nqn: NQN.into(),
                    nsid: 2,
                    host: HOST_B.into(),
                },
                st.del_namespace_host(NQN, 2, HOST_B),
            ),
            (
                ConfigError::NoNamespace {
                    nqn: NQN.into(),
                    nsid: 9,
                },
                st.del_namespace_host(NQN, 9, HOST_A),
            ),
        ];
        for (want, got) in cases {
            assert_eq!(got, Err(want));
        }
        assert!(matches!(
            st.add_namespace_host(NQN, 2, "bad host"),
            Err(ConfigError::InvalidNqn { .. })
        ));
        assert_eq!(st, before);
    }

    #[test]
    fn a_namespace_takes_up_to_the_limit_of_hosts() {
        let mut st = state();
        for i in 0..MAX_HOSTS_PER_NAMESPACE {
            st.add_namespace_host(NQN, 2, &format!("nqn.2014-08.org.nvmexpress:uuid:h{i}"))
                .expect("within the limit");
        }
        let before = st.clone();
        assert_eq!(
            st.add_namespace_host(NQN, 2, HOST_B),
            Err(ConfigError::TooManyNamespaceHosts {
                nqn: NQN.into(),
                nsid: 2,
                max: MAX_HOSTS_PER_NAMESPACE
            })
        );
        assert_eq!(st, before);
    }
}
