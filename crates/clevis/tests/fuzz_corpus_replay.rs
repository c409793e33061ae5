//! Stable-Rust stand-in for the `clevis_token` fuzz target: the committed corpus (tokens
//! `clevis luks bind` wrote) and bounded, deterministic mutations of it go through
//! `parse_token`, which must answer an error, never panic. Every field the recovery needs,
//! removed or given the wrong type, is an error.
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use cryptblk_clevis::{parse_token, TokenError};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/clevis_token")
}

fn seeds() -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(corpus_dir())
        .expect("fuzz/corpus/clevis_token must exist")
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

/// What the fuzz target does with an input.
fn exercise(data: &[u8]) -> Option<Result<(), TokenError>> {
    let value: Value = serde_json::from_slice(data).ok()?;
    Some(parse_token("0", &value).map(drop))
}

fn no_panic(data: &[u8], what: &str) -> Option<Result<(), TokenError>> {
    match std::panic::catch_unwind(|| exercise(data)) {
        Ok(r) => r,
        Err(_) => {
            let out = std::env::temp_dir().join(format!("clevis-crash-{}", std::process::id()));
            std::fs::write(&out, data).unwrap();
            panic!(
                "{what}: parse_token panicked; input saved to {}",
                out.display()
            );
        }
    }
}

#[test]
fn the_corpus_parses_and_random_mutations_never_panic() {
    let seeds = seeds();
    assert!(seeds.len() >= 2);
    let mut rng = StdRng::seed_from_u64(0x7a9);
    for (name, data) in &seeds {
        if name.starts_with("tang_") {
            let r = no_panic(data, name).expect("a seed is JSON");
            assert!(r.is_ok(), "{name}: {r:?}");
        }
        for round in 0..1500 {
            let mut m = data.clone();
            for _ in 0..rng.gen_range(1..4) {
                let i = rng.gen_range(0..m.len());
                match rng.gen_range(0..3) {
                    0 => m[i] = rng.gen(),
                    1 => m.truncate(i),
                    _ => m.insert(i, b"{}[]\",:0"[rng.gen_range(0..8)]),
                }
                if m.is_empty() {
                    break;
                }
            }
            no_panic(&m, &format!("{name} mutation {round}"));
        }
    }
}

/// The seed's token and its decoded protected header.
fn split(seed: &[u8]) -> (Value, Value) {
    let token: Value = serde_json::from_slice(seed).unwrap();
    let protected = token["jwe"]["protected"].as_str().unwrap();
    let header = serde_json::from_slice(&URL_SAFE_NO_PAD.decode(protected).unwrap()).unwrap();
    (token, header)
}

fn join(mut token: Value, header: &Value) -> Value {
    token["jwe"]["protected"] = URL_SAFE_NO_PAD
        .encode(serde_json::to_vec(header).unwrap())
        .into();
    token
}

/// Sets (or with `None` removes) the member at `path`.
fn edit(v: &mut Value, path: &[&str], to: Option<Value>) {
    let (last, parents) = path.split_last().unwrap();
    let mut at = v;
    for p in parents {
        at = &mut at[*p];
    }
    let obj = at.as_object_mut().unwrap();
    match to {
        Some(new) => {
            obj.insert(last.to_string(), new);
        }
        None => {
            obj.remove(*last);
        }
    }
}

#[test]
fn every_needed_field_missing_or_mistyped_is_an_error() {
    let seed = &seeds()
        .into_iter()
        .find(|(n, _)| n == "tang_p521_clevis_luks_bind")
        .unwrap()
        .1;
    let wrong = [
        json!(null),
        json!(7),
        json!([]),
        json!({}),
        json!("!!"),
        json!(""),
    ];
    let token_fields: &[&[&str]] = &[
        &["keyslots"],
        &["jwe"],
        &["jwe", "protected"],
        &["jwe", "iv"],
        &["jwe", "ciphertext"],
        &["jwe", "tag"],
    ];
    for path in token_fields {
        for to in std::iter::once(None).chain(wrong.iter().cloned().map(Some)) {
            let (mut token, _) = split(seed);
            edit(&mut token, path, to.clone());
            let r = no_panic(&serde_json::to_vec(&token).unwrap(), "token edit");
            // An empty ciphertext is a valid JWE (the decryption refuses it later).
            let lenient = path.last() == Some(&"ciphertext") && to == Some(json!(""));
            if !lenient {
                assert!(r.unwrap().is_err(), "{path:?} = {to:?} was accepted");
            }
        }
    }
    let header_fields: &[&[&str]] = &[
        &["alg"],
        &["enc"],
        &["kid"],
        &["epk"],
        &["epk", "crv"],
        &["epk", "x"],
        &["epk", "y"],
        &["epk", "kty"],
        &["clevis"],
        &["clevis", "pin"],
        &["clevis", "tang"],
        &["clevis", "tang", "url"],
        &["clevis", "tang", "adv"],
        &["clevis", "tang", "adv", "keys"],
    ];
    for path in header_fields {
        for to in std::iter::once(None).chain(wrong.iter().cloned().map(Some)) {
            let (token, mut header) = split(seed);
            edit(&mut header, path, to.clone());
            let token = join(token, &header);
            let r = no_panic(&serde_json::to_vec(&token).unwrap(), "header edit");
            // Any string is a URL to parse_token (the request refuses a bad one).
            let lenient = path.last() == Some(&"url") && matches!(to, Some(Value::String(_)));
            if !lenient {
                assert!(r.unwrap().is_err(), "{path:?} = {to:?} was accepted");
            }
        }
    }
}

#[test]
fn other_pins_and_algorithms_are_unsupported_not_malformed() {
    let seed = &seeds()[0].1;
    for (path, to) in [
        (&["clevis", "pin"][..], json!("sss")),
        (&["alg"][..], json!("ECDH-ES+A128KW")),
        (&["enc"][..], json!("A128CBC-HS256")),
        (&["epk", "crv"][..], json!("X25519")),
    ] {
        let (token, mut header) = split(seed);
        edit(&mut header, path, Some(to.clone()));
        let e = parse_token("2", &join(token, &header)).unwrap_err();
        assert!(
            matches!(e, TokenError::Unsupported(_)),
            "{path:?} = {to}: {e}"
        );
    }
}
