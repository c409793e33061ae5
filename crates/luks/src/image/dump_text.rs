//! `cryptsetup luksDump`-like text for LUKS2, rendered from the JSON dump so the two can never
//! disagree.
use serde_json::Value;
use std::fmt::Write;

fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "(no value)".to_string(),
        other => other.to_string(),
    }
}

pub(super) fn luks2(d: &Value) -> String {
    let mut o = String::new();
    // Writing into a String cannot fail.
    let _ = writeln!(o, "LUKS header information");
    let _ = writeln!(o, "Version:       \t2");
    let _ = writeln!(o, "Epoch:         \t{}", s(&d["epoch"]));
    let _ = writeln!(o, "Metadata area: \t{} [bytes]", s(&d["metadata_area"]));
    let _ = writeln!(o, "Keyslots area: \t{} [bytes]", s(&d["keyslots_area"]));
    let _ = writeln!(o, "UUID:          \t{}", s(&d["uuid"]));
    let label = d["label"].as_str().unwrap_or("(no label)");
    let _ = writeln!(o, "Label:         \t{label}");
    let subsystem = d["subsystem"].as_str().unwrap_or("(no subsystem)");
    let _ = writeln!(o, "Subsystem:     \t{subsystem}");
    let flags = list(&d["flags"]);
    let _ = writeln!(
        o,
        "Flags:       \t{}",
        if flags.is_empty() {
            "(no flags)".into()
        } else {
            flags
        }
    );
    let reqs = list(&d["requirements"]);
    if !reqs.is_empty() {
        let _ = writeln!(o, "Requirements:\t{reqs}");
    }
    let _ = writeln!(o, "\nData segments:");
    for seg in d["segments"].as_array().into_iter().flatten() {
        let _ = writeln!(o, "  {}: {}", s(&seg["id"]), s(&seg["type"]));
        let _ = writeln!(o, "\toffset: {} [bytes]", s(&seg["offset"]));
        let size = &seg["size"];
        let size = if size.is_string() {
            s(size)
        } else {
            format!("{} [bytes]", s(size))
        };
        let _ = writeln!(o, "\tlength: {size}");
        let _ = writeln!(o, "\tcipher: {}", s(&seg["cipher"]));
        let _ = writeln!(o, "\tsector: {} [bytes]", s(&seg["sector_size"]));
    }
    let _ = writeln!(o, "\nKeyslots:");
    for ks in d["keyslots"].as_array().into_iter().flatten() {
        let _ = writeln!(o, "  {}: {}", s(&ks["id"]), s(&ks["type"]));
        let _ = writeln!(o, "\tKey:        {} bits", s(&ks["key_bits"]));
        let _ = writeln!(o, "\tPriority:   {}", s(&ks["priority"]));
        let _ = writeln!(o, "\tCipher:     {}", s(&ks["cipher"]));
        let _ = writeln!(o, "\tCipher key: {} bits", s(&ks["cipher_key_bits"]));
        let _ = writeln!(o, "\tPBKDF:      {}", s(&ks["pbkdf"]));
        if ks["pbkdf"] == "pbkdf2" {
            let _ = writeln!(o, "\tHash:       {}", s(&ks["hash"]));
            let _ = writeln!(o, "\tIterations: {}", s(&ks["iterations"]));
        } else {
            let _ = writeln!(o, "\tTime cost:  {}", s(&ks["time_cost"]));
            let _ = writeln!(o, "\tMemory:     {}", s(&ks["memory_kib"]));
            let _ = writeln!(o, "\tThreads:    {}", s(&ks["threads"]));
        }
        let _ = writeln!(o, "\tSalt:       {}", s(&ks["salt"]));
        let _ = writeln!(o, "\tAF stripes: {}", s(&ks["af_stripes"]));
        let _ = writeln!(o, "\tAF hash:    {}", s(&ks["af_hash"]));
        let _ = writeln!(o, "\tArea offset:{} [bytes]", s(&ks["area_offset"]));
        let _ = writeln!(o, "\tArea length:{} [bytes]", s(&ks["area_length"]));
    }
    let _ = writeln!(o, "Tokens:");
    for t in d["tokens"].as_array().into_iter().flatten() {
        let _ = writeln!(o, "  {}: {}", s(&t["id"]), s(&t["type"]));
        for slot in t["keyslots"].as_array().into_iter().flatten() {
            let _ = writeln!(o, "\tKeyslot:    {}", s(slot));
        }
    }
    let _ = writeln!(o, "Digests:");
    for dg in d["digests"].as_array().into_iter().flatten() {
        let _ = writeln!(o, "  {}: {}", s(&dg["id"]), s(&dg["type"]));
        let _ = writeln!(o, "\tHash:       {}", s(&dg["hash"]));
        let _ = writeln!(o, "\tIterations: {}", s(&dg["iterations"]));
        let _ = writeln!(o, "\tSalt:       {}", s(&dg["salt"]));
        let _ = writeln!(o, "\tDigest:     {}", s(&dg["digest"]));
    }
    o
}

fn list(v: &Value) -> String {
    v.as_array()
        .map(|a| a.iter().map(s).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}
