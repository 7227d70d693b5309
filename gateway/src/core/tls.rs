//! NVMe/TCP secure channels (TLS 1.3 with pre-shared keys), the core's part: which hosts
//! have PSKs, which subsystems require a secure channel, which listeners are secure (the
//! discovery log says so), and the PSK a handshake uses for the identity a host offers. The
//! handshake itself is the transport's (`tcp::tls`); a queue that arrived over one carries
//! its [`SecureChannel`], and its Connect must name the identity's host and subsystem.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use nvme_auth::tls_psk::{ConfiguredPsk, LabelEncoding, PskIdentity, TlsPsk};

use super::target::Target;
use crate::spec::DISCOVERY_NQN;

/// A host's configured PSK and the HKDF-Expand-Label layout its tools derive with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPsk {
    pub psk: ConfiguredPsk,
    pub derivation: LabelEncoding,
}

impl HostPsk {
    /// The TLS PSK for the identity a host offered, if this key makes one for it.
    pub fn tls_psk(&self, identity: &PskIdentity) -> Option<TlsPsk> {
        self.psk
            .retained(&identity.hostnqn, self.derivation)
            .tls_psk(identity, self.derivation)
    }
}

/// A subsystem's secure-channel settings.
#[derive(Debug, Default)]
pub struct SubsystemTls {
    /// Hosts must connect over TLS (`require_tls`).
    required: AtomicBool,
    /// PSKs by host NQN.
    psks: RwLock<BTreeMap<String, Arc<HostPsk>>>,
}

impl SubsystemTls {
    pub fn set_required(&self, required: bool) {
        self.required.store(required, Ordering::SeqCst);
    }

    pub fn required(&self) -> bool {
        self.required.load(Ordering::SeqCst)
    }

    /// Replaces the hosts' PSKs; connected hosts keep their queues, new handshakes use the
    /// new keys.
    pub fn set_psks(&self, psks: BTreeMap<String, Arc<HostPsk>>) {
        *self.psks.write().unwrap_or_else(|e| e.into_inner()) = psks;
    }

    pub fn psk(&self, hostnqn: &str) -> Option<Arc<HostPsk>> {
        self.psks
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(hostnqn)
            .cloned()
    }

    pub fn all_psks(&self) -> BTreeMap<String, Arc<HostPsk>> {
        self.psks.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// The NVMe/TCP listeners that take TLS connections only, by (address, port) as the
/// discovery log lists them.
#[derive(Debug, Default)]
pub struct SecureListeners {
    secure: RwLock<BTreeSet<(String, u16)>>,
}

impl SecureListeners {
    pub fn set(&self, address: &str, port: u16, secure: bool) {
        let mut set = self.secure.write().unwrap_or_else(|e| e.into_inner());
        if secure {
            set.insert((address.to_string(), port));
        } else {
            set.remove(&(address.to_string(), port));
        }
    }

    pub fn is_secure(&self, address: &str, port: u16) -> bool {
        self.secure
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&(address.to_string(), port))
    }
}

/// The identity a queue's TLS handshake was made with: its Connect must be for this host
/// and subsystem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecureChannel {
    pub hostnqn: String,
    pub subnqn: String,
}

impl From<&PskIdentity> for SecureChannel {
    fn from(identity: &PskIdentity) -> Self {
        Self {
            hostnqn: identity.hostnqn.clone(),
            subnqn: identity.subnqn.clone(),
        }
    }
}

/// The TLS PSK for the identity a host offered: the host's PSK in the subsystem the
/// identity names (for the discovery subsystem: the host's PSK in any subsystem, as a Linux
/// host discovering over TLS offers an identity naming the discovery NQN). `None`: no such
/// host or key, or the identity does not fit the key (another hash, a wrong digest), and
/// the handshake fails.
pub fn tls_psk_for(target: &Target, identity: &PskIdentity) -> Option<TlsPsk> {
    let host_psk = if identity.subnqn == DISCOVERY_NQN {
        target
            .subsystems()
            .iter()
            .find_map(|s| s.tls.psk(&identity.hostnqn))?
    } else {
        let subsystem = target.subsystem(&identity.subnqn)?;
        if !subsystem.allows_host(&identity.hostnqn) {
            return None;
        }
        subsystem.tls.psk(&identity.hostnqn)?
    };
    host_psk.tls_psk(identity)
}
