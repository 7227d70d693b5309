//! Device events turned into NVMe asynchronous events.

use std::sync::{Arc, Weak};

use rbd_backend::{DeviceEvent, DeviceEventSink};

use crate::core::Subsystem;
use crate::spec::ana;

/// Forwards a namespace's device events to every controller of its subsystem: a resize
/// becomes a Namespace Attribute Changed notice and an entry in the Changed Namespace List.
pub struct NamespaceEvents {
    subsystem: Weak<Subsystem>,
    nsid: u32,
}

impl NamespaceEvents {
    pub fn new(subsystem: &Arc<Subsystem>, nsid: u32) -> Self {
        Self {
            subsystem: Arc::downgrade(subsystem),
            nsid,
        }
    }
}

impl DeviceEventSink for NamespaceEvents {
    fn device_event(&self, event: DeviceEvent) {
        let Some(subsystem) = self.subsystem.upgrade() else {
            return;
        };
        match event {
            DeviceEvent::Resized { new_size } => {
                // Auto-resize off: hosts keep seeing the frozen size while the image is
                // larger (no notice: nothing changed for them). An image that reaches it
                // exactly may be the growth of a frozen namespace's resize whose new frozen
                // size was pushed before librbd told us: hosts are told then (a notice for
                // an unchanged size costs a host one rescan; a missed one leaves it at the
                // old size). An image shrunk below it changes what they see too.
                let frozen = subsystem
                    .namespace(self.nsid)
                    .and_then(|ns| ns.frozen_size.get());
                if let Some(frozen) = frozen.filter(|f| new_size > *f) {
                    tracing::info!(
                        subsystem = subsystem.nqn(),
                        nsid = self.nsid,
                        new_size,
                        frozen,
                        "namespace's image resized; auto-resize off: hosts keep its frozen size"
                    );
                    return;
                }
                tracing::info!(
                    subsystem = subsystem.nqn(),
                    nsid = self.nsid,
                    new_size,
                    "namespace resized"
                );
                subsystem.notify_namespace_changed(self.nsid);
            }
            DeviceEvent::Fenced => {
                // Every namespace of the group shares the fenced client: the whole group is
                // inaccessible through this gateway until the control plane gives it back
                // (and the group agent reopens its images on a fresh client).
                let Some(ns) = subsystem.namespace(self.nsid) else {
                    return;
                };
                if subsystem.ana_state(ns.ana_group) != ana::INACCESSIBLE {
                    tracing::error!(
                        subsystem = subsystem.nqn(),
                        nsid = self.nsid,
                        ana_group = ns.ana_group,
                        "fenced: ANA group reported inaccessible"
                    );
                    subsystem.set_ana_state(ns.ana_group, ana::INACCESSIBLE);
                }
            }
        }
    }
}
