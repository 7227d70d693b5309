//! What a fence costs on a cluster, step by step: `osd blocklist add` of two clients' addresses
//! (`v2:` and `v1:` of each, as `rados_getaddrs` reports them: four mon commands) one after
//! the other (as fences did) and all at once (`Client::blocklist_add_all`, as they do now);
//! then `rados_wait_for_latest_osdmap` on the fencing client and on another client (what a
//! survivor waits for), and `osd dump` for the epoch.
//!
//! `CEPH_CONF=... cargo run -p control-plane --example fence_cost [ROUNDS]`
//! (on a throwaway cluster: it blocklists made-up addresses for a minute).

use std::time::{Duration, Instant};

use rbd_backend::rados::Client;
use rbd_backend::rbd::CephSettings;

fn ms(d: Duration) -> String {
    format!("{:.0}", d.as_secs_f64() * 1000.0)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rounds: u32 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5);
    let settings = CephSettings {
        conf: std::env::var_os("CEPH_CONF").map(Into::into),
        keyring: std::env::var_os("CEPH_KEYRING").map(Into::into),
        max_connections: 1,
        ..CephSettings::default()
    };
    let fencer = Client::connect(&settings)?;
    let survivor = Client::connect(&settings)?;
    let expire = Some(Duration::from_secs(60));
    let base = std::process::id() * 1000;
    for round in 0..rounds {
        for at_once in [false, true] {
            let n = base + round * 10 + if at_once { 5 } else { 0 };
            let clients: Vec<String> = (n..n + 2)
                .map(|c| format!("[v2:127.0.0.1:0/{c},v1:127.0.0.1:0/{c}]"))
                .collect();
            let before = fencer.osdmap_epoch()?;
            let t = Instant::now();
            if at_once {
                fencer.blocklist_add_all(&clients, expire)?;
            } else {
                for c in &clients {
                    fencer.blocklist_add(c, expire)?;
                }
            }
            let add = t.elapsed();
            let t = Instant::now();
            fencer.wait_for_latest_osdmap()?;
            let own = t.elapsed();
            let t = Instant::now();
            survivor.wait_for_latest_osdmap()?;
            let other = t.elapsed();
            let t = Instant::now();
            let epoch = fencer.osdmap_epoch()?;
            let dump = t.elapsed();
            println!(
                "round {round} {}: blocklist add (2 clients, 4 addresses) {} ms, {} osdmap epoch(s); wait_for_latest_osdmap: fencer {} ms, survivor {} ms; osd dump {} ms",
                if at_once { "at once    " } else { "one by one" },
                ms(add),
                epoch.saturating_sub(before),
                ms(own),
                ms(other),
                ms(dump)
            );
            std::thread::sleep(Duration::from_millis(1500));
        }
    }
    Ok(())
}
