//! Against the real tang and clevis: a JWE `clevis encrypt tang` made is decrypted by
//! cryptblk's recovery; the failures (server down, keys replaced) say what is wrong.
#[path = "support/tang_server.rs"]
mod tang_server;

use cryptblk_clevis::{parse_token, recover_passphrase, TokenError};
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;
use tang_server::{require, TangServer};

/// `clevis encrypt tang` of `secret`, stored as `clevis luks bind` stores it: a token with
/// the flattened JWE (`jose jwe fmt`).
fn bind(url: &str, secret: &[u8]) -> serde_json::Value {
    require("clevis", "clevis");
    require("jose", "jose");
    let mut enc = Command::new("clevis")
        .args(["encrypt", "tang", &format!("{{\"url\":\"{url}\"}}"), "-y"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    enc.stdin.take().unwrap().write_all(secret).unwrap();
    let out = enc.wait_with_output().unwrap();
    assert!(out.status.success(), "clevis encrypt: {out:?}");
    let mut fmt = Command::new("jose")
        .args(["jwe", "fmt", "-i-", "-o-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    fmt.stdin.take().unwrap().write_all(&out.stdout).unwrap();
    let flat = fmt.wait_with_output().unwrap();
    assert!(flat.status.success(), "jose jwe fmt: {flat:?}");
    let jwe: serde_json::Value = serde_json::from_slice(&flat.stdout).unwrap();
    serde_json::json!({"type": "clevis", "keyslots": ["1"], "jwe": jwe})
}

#[test]
fn recovers_what_clevis_encrypted_and_names_the_server_when_it_fails() {
    let mut tang = TangServer::start();
    let secret = b"correct horse \x00 battery\n";
    let token = parse_token("0", &bind(&tang.url, secret)).unwrap();
    assert_eq!(token.url(), tang.url);
    assert_eq!(token.keyslots, ["1"]);
    let got = recover_passphrase(&token, Duration::from_secs(10)).unwrap();
    assert_eq!(got.as_slice(), secret);

    // Keys replaced: the server no longer knows the token's key.
    tang.replace_keys();
    let e = recover_passphrase(&token, Duration::from_secs(10)).unwrap_err();
    assert!(matches!(e, TokenError::ServerKeyGone { .. }), "{e}");
    assert!(e.to_string().contains(&tang.url), "{e}");

    // Server down.
    tang.stop();
    let e = recover_passphrase(&token, Duration::from_secs(10)).unwrap_err();
    assert!(e.is_unreachable(), "{e}");
    assert!(e.to_string().contains(&tang.url), "{e}");
}

#[test]
fn a_token_altered_after_binding_is_refused_not_decrypted() {
    let tang = TangServer::start();
    let mut token = bind(&tang.url, b"secret");
    // Flip one byte of the ciphertext: the GCM tag no longer verifies.
    let ct = token["jwe"]["ciphertext"].as_str().unwrap().to_owned();
    let flipped = format!(
        "{}{}",
        if ct.starts_with('A') { "B" } else { "A" },
        &ct[1..]
    );
    token["jwe"]["ciphertext"] = flipped.into();
    let token = parse_token("3", &token).unwrap();
    let e = recover_passphrase(&token, Duration::from_secs(10)).unwrap_err();
    assert!(matches!(e, TokenError::WrongServerKey { .. }), "{e}");
}

#[test]
fn every_curve_tang_advertises_works() {
    for crv in ["P-256", "P-384", "P-521"] {
        let tang = TangServer::start_on_curve(Some(crv));
        let token = bind(&tang.url, crv.as_bytes());
        let header = token["jwe"]["protected"].as_str().unwrap().to_owned();
        let token = parse_token("1", &token).unwrap();
        let got = recover_passphrase(&token, Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("{crv}: {e}"));
        assert_eq!(got.as_slice(), crv.as_bytes());
        // The exchange really ran on that curve.
        let decoded = String::from_utf8(
            base64::Engine::decode(&base64::engine::general_purpose::URL_SAFE_NO_PAD, header)
                .unwrap(),
        )
        .unwrap();
        assert!(
            decoded.contains(&format!("\"epk\":{{\"crv\":\"{crv}\"")),
            "{decoded}"
        );
    }
}
