//! What one DH-HMAC-CHAP transaction costs the controller per DH group: a fresh key pair
//! (g^x mod p), the session key from the host's value (y^x mod p), and the HMACs of a
//! bidirectional exchange. Prints a table of CPU time per transaction (the median of the
//! rounds), with its ratio to the NULL group's, which is only the HMACs.
//!
//! `cargo bench -p nvme-auth --bench transaction [-- --rounds N]`

use std::time::{Duration, Instant};

use nvme_auth::{
    augmented_challenge, controller_response, host_response, DhGroup, DhKeyPair, HashFunction,
    ResponseInput,
};

/// The controller's work for one transaction with `group`, given the host's public value.
fn transaction(group: DhGroup, host_value: &[u8]) -> usize {
    let hash = HashFunction::Sha512;
    let input = ResponseInput {
        hash,
        seqnum: 7,
        t_id: 1,
        hostnqn: "nqn.2014-08.org.nvmexpress:uuid:bench-host",
        subnqn: "nqn.2016-06.io.example:bench",
    };
    let challenge = [0x5a; 64];
    let session = match group {
        DhGroup::Null => None,
        group => {
            let pair = DhKeyPair::generate(group).expect("key pair");
            Some(pair.shared_secret(host_value).expect("host value"))
        }
    };
    let ca = augmented_challenge(hash, &challenge, session.as_deref().map(Vec::as_slice));
    let r1 = host_response(&input, &[0x11; 64], &ca);
    let r2 = controller_response(&input, &[0x22; 64], &ca);
    r1.len() + r2.len()
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn main() {
    let mut rounds = 21;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--rounds" {
            rounds = args.next().and_then(|n| n.parse().ok()).unwrap_or(rounds);
        }
    }
    println!("DH-HMAC-CHAP, the controller's CPU per transaction (SHA-512, bidirectional), median of {rounds}");
    println!("| DH group | us per transaction | x NULL |");
    println!("| --- | ---: | ---: |");
    let mut null = Duration::ZERO;
    for group in DhGroup::ALL {
        let host_value = match group {
            DhGroup::Null => Vec::new(),
            group => DhKeyPair::generate(group)
                .expect("host key pair")
                .public_value()
                .to_vec(),
        };
        let samples: Vec<Duration> = (0..rounds)
            .map(|_| {
                let start = Instant::now();
                std::hint::black_box(transaction(group, &host_value));
                start.elapsed()
            })
            .collect();
        let m = median(samples);
        if group == DhGroup::Null {
            null = m;
        }
        println!(
            "| {group} | {:.1} | {:.0} |",
            m.as_secs_f64() * 1e6,
            m.as_secs_f64() / null.as_secs_f64().max(1e-9)
        );
    }
}
