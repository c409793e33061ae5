//! A luksDump-like description. Salts and digests are public (cryptsetup prints them too);
//! nothing here derives from key material.
use super::json::{parse_u64, SegmentSize};
use super::Luks2Header;
use serde_json::{json, Value};

fn sorted_ids<T>(map: &std::collections::BTreeMap<String, T>) -> Vec<(&String, &T)> {
    let mut v: Vec<_> = map.iter().collect();
    v.sort_by_key(|(k, _)| parse_u64(k).unwrap_or(u64::MAX));
    v
}

pub fn dump(h: &Luks2Header) -> Value {
    let m = &h.meta;
    let segments: Vec<Value> = sorted_ids(&m.segments)
        .into_iter()
        .map(|(id, s)| {
            json!({
                "id": id,
                "type": s.kind,
                "offset": s.offset,
                "size": match s.size { SegmentSize::Dynamic => json!("dynamic"), SegmentSize::Fixed(n) => json!(n) },
                "cipher": s.encryption,
                "sector_size": s.sector_size,
                "iv_tweak": s.iv_tweak,
            })
        })
        .collect();
    let keyslots: Vec<Value> = sorted_ids(&m.keyslots)
        .into_iter()
        .map(|(id, k)| {
            let mut v = json!({
                "id": id,
                "type": k.kind,
                "key_bits": u64::from(k.key_size) * 8,
                "priority": match k.priority.unwrap_or(1) { 0 => "ignored", 2 => "preferred", _ => "normal" },
                "cipher": k.area.encryption,
                "cipher_key_bits": k.area.key_size.map(|n| u64::from(n) * 8),
                "area_offset": k.area.offset,
                "area_length": k.area.size,
            });
            if let Some(kdf) = &k.kdf {
                v["pbkdf"] = json!(kdf.kind);
                if kdf.kind == "pbkdf2" {
                    v["hash"] = json!(kdf.hash);
                    v["iterations"] = json!(kdf.iterations);
                } else {
                    v["time_cost"] = json!(kdf.time);
                    v["memory_kib"] = json!(kdf.memory);
                    v["threads"] = json!(kdf.cpus);
                }
                v["salt"] = json!(kdf.salt);
            }
            if let Some(af) = &k.af {
                v["af_stripes"] = json!(af.stripes);
                v["af_hash"] = json!(af.hash);
            }
            v
        })
        .collect();
    let digests: Vec<Value> = sorted_ids(&m.digests)
        .into_iter()
        .map(|(id, d)| {
            json!({
                "id": id,
                "type": d.kind,
                "hash": d.hash,
                "iterations": d.iterations,
                "keyslots": d.keyslots,
                "segments": d.segments,
                "salt": d.salt,
                "digest": d.digest,
            })
        })
        .collect();
    json!({
        "version": 2,
        "uuid": h.uuid(),
        "label": h.label(),
        "subsystem": h.subsystem(),
        "epoch": h.seqid(),
        "metadata_area": h.hdr_size(),
        "keyslots_area": m.config.keyslots_size,
        "flags": m.config.flags.clone().unwrap_or_default(),
        "requirements": m.config.requirements.as_ref().map(|r| r.mandatory.clone()).unwrap_or_default(),
        "data_offset": h.data_offset(),
        "sector_size": h.sector_size(),
        "segments": segments,
        "keyslots": keyslots,
        "digests": digests,
        "tokens": tokens(m),
    })
}

/// Each token's id, type and keyslots, as `cryptsetup luksDump` lists them. Token JSON is
/// whatever a tool wrote: a missing type or a keyslot that is not a string shows as null.
fn tokens(m: &super::json::Metadata) -> Vec<Value> {
    sorted_ids(&m.tokens)
        .into_iter()
        .map(|(id, t)| {
            json!({
                "id": id,
                "type": t.get("type").and_then(Value::as_str),
                "keyslots": t.get("keyslots").and_then(Value::as_array).cloned().unwrap_or_default(),
            })
        })
        .collect()
}
