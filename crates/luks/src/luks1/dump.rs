//! Human and machine readable dumps of a LUKS1 header. Salts and digests are public (as in
//! `cryptsetup luksDump`); no key material is ever part of a dump.
use super::phdr::Phdr;
use serde_json::json;
use std::fmt::Write;

fn spaced_hex(bytes: &[u8]) -> String {
    // cryptsetup ends every byte with a space, including the last one.
    bytes.iter().map(|b| format!("{b:02x} ")).collect()
}

pub(super) fn json(p: &Phdr) -> serde_json::Value {
    let keyslots: Vec<_> = p
        .keyslots
        .iter()
        .enumerate()
        .map(|(i, ks)| {
            json!({
                "slot": i,
                "active": ks.active,
                "iterations": ks.iterations,
                "salt": hex_string(&ks.salt),
                "key_material_offset_sectors": ks.key_material_offset,
                "stripes": ks.stripes,
            })
        })
        .collect();
    json!({
        "version": 1,
        "uuid": p.uuid,
        "cipher_name": p.cipher_name,
        "cipher_mode": p.cipher_mode,
        "hash_spec": p.hash_spec,
        "payload_offset_sectors": p.payload_offset,
        "key_bytes": p.key_bytes,
        "mk_digest": hex_string(&p.mk_digest),
        "mk_digest_salt": hex_string(&p.mk_digest_salt),
        "mk_digest_iterations": p.mk_digest_iter,
        "keyslots": keyslots,
    })
}

fn hex_string(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Laid out like `cryptsetup luksDump` of a LUKS1 header, so existing habits and scripts that
/// grep it keep working.
pub(super) fn text(p: &Phdr) -> String {
    let mut s = String::new();
    // Writing into a String cannot fail.
    let _ = writeln!(s, "LUKS header information\n");
    let _ = writeln!(s, "Version:       \t1");
    let _ = writeln!(s, "Cipher name:   \t{}", p.cipher_name);
    let _ = writeln!(s, "Cipher mode:   \t{}", p.cipher_mode);
    let _ = writeln!(s, "Hash spec:     \t{}", p.hash_spec);
    let _ = writeln!(s, "Payload offset:\t{}", p.payload_offset);
    let _ = writeln!(s, "MK bits:       \t{}", u64::from(p.key_bytes) * 8);
    let _ = writeln!(s, "MK digest:     \t{}", spaced_hex(&p.mk_digest));
    let _ = writeln!(
        s,
        "MK salt:       \t{}",
        spaced_hex(&p.mk_digest_salt[..16])
    );
    let _ = writeln!(
        s,
        "               \t{}",
        spaced_hex(&p.mk_digest_salt[16..])
    );
    let _ = writeln!(s, "MK iterations: \t{}", p.mk_digest_iter);
    let _ = writeln!(s, "UUID:          \t{}\n", p.uuid);
    for (i, ks) in p.keyslots.iter().enumerate() {
        if !ks.active {
            let _ = writeln!(s, "Key Slot {i}: DISABLED");
            continue;
        }
        let _ = writeln!(s, "Key Slot {i}: ENABLED");
        let _ = writeln!(s, "\tIterations:         \t{}", ks.iterations);
        let _ = writeln!(s, "\tSalt:               \t{}", spaced_hex(&ks.salt[..16]));
        let _ = writeln!(
            s,
            "\t                      \t{}",
            spaced_hex(&ks.salt[16..])
        );
        let _ = writeln!(s, "\tKey material offset:\t{}", ks.key_material_offset);
        let _ = writeln!(s, "\tAF stripes:            \t{}", ks.stripes);
    }
    s
}
