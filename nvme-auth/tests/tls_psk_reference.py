#!/usr/bin/env python3
"""Reference for nvme-auth's TLS PSK derivations (src/tls_psk_tests.rs takes its vectors from
here): libnvme's src/nvme/linux.c (derive_retained_key, derive_psk_digest, derive_tls_key,
gen_tls_identity, nvme_export_tls_key_versioned) written again with Python's standard
library only, in both HKDF-Expand-Label layouts (RFC 8446, and libnvme's before its August
2025 fix, "compat"). Run: python3 nvme-auth/tests/tls_psk_reference.py"""
import base64, hashlib, hmac, struct, zlib

HASH = {1: hashlib.sha256, 2: hashlib.sha384}


def hkdf_expand_label(h, key, label, context, length, compat):
    prk = hmac.new(b"\0" * h().digest_size, key, h).digest()
    lab = b"tls13 " + label
    if compat:
        info = struct.pack("<H", length) + lab + context
    else:
        info = struct.pack(">H", length) + bytes([len(lab)]) + lab + bytes([len(context)]) + context
    out, block, i = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([i]), h).digest()
        out += block
        i += 1
    return out[:length]


def interchange(key, hmac_id):
    crc = zlib.crc32(key) & 0xFFFFFFFF
    return "NVMeTLSkey-1:%02x:%s:" % (hmac_id, base64.b64encode(key + struct.pack("<I", crc)).decode())


def derive(key, hmac_id, hostnqn, subnqn, version, compat):
    cipher = hmac_id if hmac_id else {32: 1, 48: 2}[len(key)]
    if hmac_id == 0:
        retained = key
    else:
        retained = hkdf_expand_label(HASH[hmac_id], key, b"HostNQN", hostnqn.encode(), len(key), compat)
    if version == 0:
        identity = "NVMe0R%02d %s %s" % (cipher, hostnqn, subnqn)
        context = identity.encode()
    else:
        mac = hmac.new(retained, (hostnqn + " " + subnqn + " NVMe-over-Fabrics").encode(), HASH[cipher]).digest()
        digest = base64.b64encode(mac).decode()
        identity = "NVMe1R%02d %s %s %s" % (cipher, hostnqn, subnqn, digest)
        context = ("%02d %s" % (cipher, digest)).encode()
    tls = hkdf_expand_label(HASH[cipher], retained, b"nvme-tls-psk", context, len(key), compat)
    return retained, identity, tls


HOST = "nqn.2014-08.org.nvmexpress:uuid:f0000000-0000-0000-0000-00000000000f"
SUB = "nqn.2016-06.io.ceph-nvmeof-rs:tls"
for hmac_id, key in ((1, bytes(range(32))), (2, bytes(range(48))), (0, bytes(range(100, 132)))):
    for version in (0, 1):
        for compat in (False, True):
            retained, identity, tls = derive(key, hmac_id, HOST, SUB, version, compat)
            print(interchange(key, hmac_id), version, "compat" if compat else "rfc8446")
            print("  retained", retained.hex())
            print("  identity", identity)
            print("  tls_psk ", tls.hex())
