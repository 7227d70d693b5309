//! Vectors from `tests/tls_psk_reference.py`: libnvme's derivations (src/nvme/linux.c) written
//! again in Python with its standard library; its HKDF checked against `openssl kdf ... HKDF`.

use super::*;

const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:f0000000-0000-0000-0000-00000000000f";
const SUB: &str = "nqn.2016-06.io.ceph-nvmeof-rs:tls";
const KEY_01: &str = "NVMeTLSkey-1:01:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:";
const KEY_02: &str =
    "NVMeTLSkey-1:02:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8gISIjJCUmJygpKissLS4vcSEgBQ==:";
const KEY_00: &str = "NVMeTLSkey-1:00:ZGVmZ2hpamtsbW5vcHFyc3R1dnd4eXp7fH1+f4CBgoOeXryU:";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// (key, identity version, encoding, retained, identity, TLS PSK)
const VECTORS: &[(&str, u8, LabelEncoding, &str, &str, &str)] = &[
    (KEY_01, 0, LabelEncoding::Rfc8446,
     "480200b05d8c5b0a1630c516c4f9c8c71a897a419df444caa816dfb3c7c87a08",
     "NVMe0R01 nqn.2014-08.org.nvmexpress:uuid:f0000000-0000-0000-0000-00000000000f nqn.2016-06.io.ceph-nvmeof-rs:tls",
     "b9b9528a05e9805794162c17dfc09c39c506371ba1b4fb01235cf1b856728c73"),
    (KEY_01, 0, LabelEncoding::LibnvmeCompat,
     "f56e18c02d032d6177bd65d9b97fe9ce3f4cd6855123133d294b2134abce7acc",
     "NVMe0R01 nqn.2014-08.org.nvmexpress:uuid:f0000000-0000-0000-0000-00000000000f nqn.2016-06.io.ceph-nvmeof-rs:tls",
     "6f8a5af5386ae33fd899bc196189962f7f0cf0895cda450ec40b6ae313af154d"),
    (KEY_01, 1, LabelEncoding::Rfc8446,
     "480200b05d8c5b0a1630c516c4f9c8c71a897a419df444caa816dfb3c7c87a08",
     "NVMe1R01 nqn.2014-08.org.nvmexpress:uuid:f0000000-0000-0000-0000-00000000000f nqn.2016-06.io.ceph-nvmeof-rs:tls jQ8kY0CUsYJ2qzDsvVzI59nL5UzScJ4CXGuVGOHzx/w=",
     "e5630bdb7ae525bdd96147033c4ab8c174c6f2412a50b9d8be962c24892b4b19"),
    (KEY_01, 1, LabelEncoding::LibnvmeCompat,
     "f56e18c02d032d6177bd65d9b97fe9ce3f4cd6855123133d294b2134abce7acc",
     "NVMe1R01 nqn.2014-08.org.nvmexpress:uuid:f0000000-0000-0000-0000-00000000000f nqn.2016-06.io.ceph-nvmeof-rs:tls bqXlPWr2ReTwf+rKgXSr1UK4bBusVDBOUDREB+VLwdU=",
     "e7398b5e37ff74773e74f170ce2032ab7866f27eb2f0a50d71936339bc085272"),
    (KEY_02, 0, LabelEncoding::Rfc8446,
     "d66a1d1804cbbd9c08b6cdf998bdb36169d3837bbca62c0d14ce402c04ff4c655d1e1f21caa8b8f9ac4ccc7f136f60a7",
     "NVMe0R02 nqn.2014-08.org.nvmexpress:uuid:f0000000-0000-0000-0000-00000000000f nqn.2016-06.io.ceph-nvmeof-rs:tls",
     "9ccc281bf65aef66afb321bc2ed08704e56c65f03b63349f073eb4d355423c63867e03ec5cef5abcf73d7b3f1b2d4b29"),
    (KEY_02, 0, LabelEncoding::LibnvmeCompat,
     "f578fa4a6e610cb98d74941f15a546b90b2123963a3677a3b2a400f0c3a1e8fadf0ccc7daa3c70ee6543b2a1fbfd42b8",
     "NVMe0R02 nqn.2014-08.org.nvmexpress:uuid:f0000000-0000-0000-0000-00000000000f nqn.2016-06.io.ceph-nvmeof-rs:tls",
     "9d604cff49c7aff0983680d8cea84e9e54be29e165070efbe5866c1fe5e2eb3ea1ea8404938db301474027a18e68e53c"),
    (KEY_02, 1, LabelEncoding::Rfc8446,
     "d66a1d1804cbbd9c08b6cdf998bdb36169d3837bbca62c0d14ce402c04ff4c655d1e1f21caa8b8f9ac4ccc7f136f60a7",
     "NVMe1R02 nqn.2014-08.org.nvmexpress:uuid:f0000000-0000-0000-0000-00000000000f nqn.2016-06.io.ceph-nvmeof-rs:tls V0rtN48Oto3zwDY7iFQhTV9iz0+bjPU52WtzBnwkDKupm/eVuD5WpofVAaS1rwsw",
     "10f14dfd3a16dcce76e83510841155b39aa56f167af7d87a275b20d49fcf775909410aa9bf4c1a0c5fe56b788b4a12fc"),
    (KEY_02, 1, LabelEncoding::LibnvmeCompat,
     "f578fa4a6e610cb98d74941f15a546b90b2123963a3677a3b2a400f0c3a1e8fadf0ccc7daa3c70ee6543b2a1fbfd42b8",
     "NVMe1R02 nqn.2014-08.org.nvmexpress:uuid:f0000000-0000-0000-0000-00000000000f nqn.2016-06.io.ceph-nvmeof-rs:tls EuHqeKbn9538N4nWWND/WPHkgCk/Unb/OrIPuarKhWkGcdD6YhlKS3ghmf+0i9Zw",
     "5af439b80efad250173b2d8ed813eed4ca35be73786b2a3a16bb9c9ca97c67159020b88e7b2b7dfc1b93879bf77f3015"),
    (KEY_00, 0, LabelEncoding::Rfc8446,
     "6465666768696a6b6c6d6e6f707172737475767778797a7b7c7d7e7f80818283",
     "NVMe0R01 nqn.2014-08.org.nvmexpress:uuid:f0000000-0000-0000-0000-00000000000f nqn.2016-06.io.ceph-nvmeof-rs:tls",
     "4596416ff7bd07f3dd635b1a16e13a0f7c3b78e194c768658f35f5d059ad6208"),
    (KEY_00, 0, LabelEncoding::LibnvmeCompat,
     "6465666768696a6b6c6d6e6f707172737475767778797a7b7c7d7e7f80818283",
     "NVMe0R01 nqn.2014-08.org.nvmexpress:uuid:f0000000-0000-0000-0000-00000000000f nqn.2016-06.io.ceph-nvmeof-rs:tls",
     "43e9766678ef2af354832668db5235885aeaabc17aa2fce57fbab43e39688c9c"),
    (KEY_00, 1, LabelEncoding::Rfc8446,
     "6465666768696a6b6c6d6e6f707172737475767778797a7b7c7d7e7f80818283",
     "NVMe1R01 nqn.2014-08.org.nvmexpress:uuid:f0000000-0000-0000-0000-00000000000f nqn.2016-06.io.ceph-nvmeof-rs:tls O1uB1Vm3LJyteIywoblmiV5trA4YU7BaoKyIrzstLH4=",
     "da008df520c74e9bacfceb17c6e9cb03b58f113c530cf15c983145ee1781711c"),
    (KEY_00, 1, LabelEncoding::LibnvmeCompat,
     "6465666768696a6b6c6d6e6f707172737475767778797a7b7c7d7e7f80818283",
     "NVMe1R01 nqn.2014-08.org.nvmexpress:uuid:f0000000-0000-0000-0000-00000000000f nqn.2016-06.io.ceph-nvmeof-rs:tls O1uB1Vm3LJyteIywoblmiV5trA4YU7BaoKyIrzstLH4=",
     "bfd23ef9c8f342d02127ac4614d41b97f4682c024fbdf511c470b49f487707aa"),
];

#[test]
fn derivations_match_the_libnvme_reference() {
    for (key, version, encoding, retained, identity, tls) in VECTORS {
        let psk = ConfiguredPsk::parse(key).expect(key);
        let kept = psk.retained(HOST, *encoding);
        assert_eq!(hex(&kept.key), *retained, "{key} {encoding:?} retained");
        let id = kept.identity(*version, HOST, SUB);
        assert_eq!(id.to_string(), *identity, "{key} {version} identity");
        // The gateway's way: parse what the host sent, derive from it.
        let parsed = PskIdentity::parse(identity.as_bytes()).expect(identity);
        assert_eq!(parsed, id);
        let derived = kept.tls_psk(&parsed, *encoding).expect("derivable");
        assert_eq!(
            hex(derived.key()),
            *tls,
            "{key} {version} {encoding:?} TLS PSK"
        );
    }
}

#[test]
fn interchange_keys_round_trip_and_are_checked() {
    for key in [KEY_00, KEY_01, KEY_02] {
        let psk = ConfiguredPsk::parse(key).expect(key);
        assert_eq!(&*psk.to_interchange(), key);
    }
    assert_eq!(
        ConfiguredPsk::parse(KEY_01).map(|p| p.hash()),
        Ok(PskHash::Sha256)
    );
    assert_eq!(
        ConfiguredPsk::parse(KEY_02).map(|p| p.hash()),
        Ok(PskHash::Sha384)
    );
    // One base64 character changed: the CRC no longer matches.
    let typo = KEY_01.replacen("AAEC", "AAED", 1);
    assert_eq!(ConfiguredPsk::parse(&typo), Err(PskError::Crc));
    // A 48-byte key cannot claim SHA-256.
    let wrong_len = KEY_02.replacen(":02:", ":01:", 1);
    assert!(matches!(
        ConfiguredPsk::parse(&wrong_len),
        Err(PskError::Length { .. })
    ));
    assert_eq!(
        ConfiguredPsk::parse(&KEY_01.replacen(":01:", ":03:", 1)),
        Err(PskError::HashIndicator("03".into()))
    );
    assert_eq!(
        ConfiguredPsk::parse("DHHC-1:01:AAAA:"),
        Err(PskError::Prefix)
    );
    assert_eq!(
        ConfiguredPsk::parse("NVMeTLSkey-1:01:not base64!:"),
        Err(PskError::Base64)
    );
}

#[test]
fn debug_never_shows_key_material() {
    let psk = ConfiguredPsk::parse(KEY_01).expect("key");
    let retained = psk.retained(HOST, LabelEncoding::Rfc8446);
    let tls = retained
        .tls_psk(&retained.identity(0, HOST, SUB), LabelEncoding::Rfc8446)
        .expect("tls");
    for shown in [
        format!("{psk:?}"),
        format!("{retained:?}"),
        format!("{tls:?}"),
    ] {
        assert!(
            !shown.contains("AAEC") && !shown.contains("4802") && !shown.contains("b9b9"),
            "{shown}"
        );
    }
}

#[test]
fn identities_that_do_not_fit_are_refused() {
    for bad in [
        "".as_bytes(),
        b"NVMe0R01",
        b"NVMe0R01 host",
        b"NVMe0R03 host sub",
        b"NVMe2R01 host sub",
        b"NVMe0G01 host sub",
        b"NVMe0R01 host sub extra",
        b"NVMe1R01 host sub",
        b"NVMe1R01 host sub digest more",
        b"NVMe0R01  sub",
        &[0xff, 0xfe, 0x20],
    ] {
        assert_eq!(PskIdentity::parse(bad), Err(PskError::Identity), "{bad:?}");
    }
}

#[test]
fn a_digest_or_hash_that_is_not_the_keys_gets_no_psk() {
    let retained = ConfiguredPsk::parse(KEY_01)
        .expect("key")
        .retained(HOST, LabelEncoding::Rfc8446);
    let mut id = retained.identity(1, HOST, SUB);
    id.digest = Some("bm90IHRoZSBkaWdlc3Q=".into());
    assert!(retained.tls_psk(&id, LabelEncoding::Rfc8446).is_none());
    let mut id = retained.identity(0, HOST, SUB);
    id.hash = PskHash::Sha384;
    assert!(retained.tls_psk(&id, LabelEncoding::Rfc8446).is_none());
}
