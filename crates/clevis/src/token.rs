//! The clevis token as `clevis luks bind` stores it in the LUKS2 header: `{"type":"clevis",
//! "keyslots":["1"],"jwe":{flattened JWE}}`. The JWE's protected header carries everything
//! the tang pin needs to recover the key: the client's ephemeral public key (`epk`), the
//! server key's thumbprint (`kid`), the server's advertisement and URL (`clevis.tang`).
//! Header JSON is untrusted: every field is checked and a bad one is an error, never a panic.
use crate::base64url::b64;
use crate::error::{Result, TokenError};
use crate::jose::{FlattenedJwe, TangHeader};
use crate::jwk::EcJwk;
use cryptblk_luks::LuksImage;
use serde_json::{Map, Value};

/// A clevis token of a LUKS2 header, bound with the tang pin.
#[derive(Debug, Clone)]
pub struct ClevisToken {
    /// The token's id in the header (`cryptsetup token` numbering).
    pub id: String,
    /// The keyslots whose passphrase the token holds.
    pub keyslots: Vec<String>,
    pub(crate) jwe: FlattenedJwe,
    pub(crate) header: TangHeader,
}

impl ClevisToken {
    /// The tang server the token was bound to.
    pub fn url(&self) -> &str {
        &self.header.url
    }
}

/// The clevis tokens of `image` in id order, each parsed or with the reason it cannot be
/// used. A LUKS1 image (no tokens) and tokens of other types are left out.
pub fn clevis_tokens(image: &LuksImage) -> Vec<(String, Result<ClevisToken>)> {
    let LuksImage::V2(header) = image else {
        return Vec::new();
    };
    let mut tokens: Vec<(&String, &Value)> = header
        .metadata()
        .tokens
        .iter()
        .filter(|(_, t)| t.get("type").and_then(Value::as_str) == Some("clevis"))
        .collect();
    // Ids are decimal strings; "10" sorts after "9".
    tokens.sort_by_key(|(id, _)| (id.len(), id.as_str()));
    tokens
        .into_iter()
        .map(|(id, t)| (id.clone(), parse_token(id, t)))
        .collect()
}

/// Parses one `clevis` token object and checks everything the recovery needs that does not
/// take the server: the curve, the client key on it, the server key `kid` names.
pub fn parse_token(id: &str, token: &Value) -> Result<ClevisToken> {
    let obj = token
        .as_object()
        .ok_or_else(|| malformed("the token is not a JSON object"))?;
    let keyslots = obj
        .get("keyslots")
        .and_then(Value::as_array)
        .ok_or_else(|| malformed("no \"keyslots\" list"))?
        .iter()
        .map(|k| k.as_str().map(str::to_owned))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| malformed("\"keyslots\" holds a non-string"))?;
    if keyslots.is_empty() {
        return Err(malformed("the token names no keyslot"));
    }
    let jwe = obj
        .get("jwe")
        .and_then(Value::as_object)
        .ok_or_else(|| malformed("no \"jwe\" object"))?;
    let jwe = parse_jwe(jwe)?;
    let header = parse_header(&jwe.protected)?;
    // The keys too, so a token that parses is one the exchange can run on.
    crate::tang::check_keys(&header)?;
    Ok(ClevisToken {
        id: id.to_owned(),
        keyslots,
        jwe,
        header,
    })
}

fn parse_jwe(jwe: &Map<String, Value>) -> Result<FlattenedJwe> {
    if jwe.contains_key("recipients") {
        return Err(TokenError::Unsupported(
            "a JWE with several recipients (clevis writes one)".into(),
        ));
    }
    let text = |name: &str| -> Result<Option<&str>> {
        match jwe.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(malformed(format!("jwe.{name} is not a string"))),
        }
    };
    let required = |name: &str| -> Result<Vec<u8>> {
        let s = text(name)?.ok_or_else(|| malformed(format!("jwe.{name} is missing")))?;
        b64(s).map_err(|e| malformed(format!("jwe.{name}: {e}")))
    };
    if !text("encrypted_key")?.unwrap_or_default().is_empty() {
        return Err(TokenError::Unsupported(
            "a JWE with a wrapped key (the tang pin uses direct ECDH-ES)".into(),
        ));
    }
    // AES-GCM as JWE uses it (RFC 7518 5.3): a 96-bit IV and a 128-bit tag.
    let (iv, tag) = (required("iv")?, required("tag")?);
    if iv.len() != 12 || tag.len() != 16 {
        return Err(malformed(format!(
            "jwe.iv is {} bytes and jwe.tag {}, not AES-GCM's 12 and 16",
            iv.len(),
            tag.len()
        )));
    }
    Ok(FlattenedJwe {
        protected: text("protected")?
            .ok_or_else(|| malformed("jwe.protected is missing"))?
            .to_owned(),
        aad: text("aad")?.map(str::to_owned),
        iv,
        ciphertext: required("ciphertext")?,
        tag,
    })
}

fn parse_header(protected: &str) -> Result<TangHeader> {
    let bytes = b64(protected).map_err(|e| malformed(format!("jwe.protected: {e}")))?;
    let hdr: Value = serde_json::from_slice(&bytes)
        .map_err(|e| malformed(format!("the JWE protected header is not JSON: {e}")))?;
    let field =
        |path: &[&str]| -> Option<&Value> { path.iter().try_fold(&hdr, |v, key| v.get(key)) };
    let string = |path: &[&str]| -> Result<String> {
        field(path)
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| malformed(format!("the JWE header has no \"{}\"", path.join("."))))
    };
    let pin = string(&["clevis", "pin"])?;
    if pin != "tang" {
        return Err(TokenError::Unsupported(format!(
            "pin \"{pin}\" (cryptblk unlocks the tang pin only; use `clevis luks unlock` for others)"
        )));
    }
    let alg = string(&["alg"])?;
    if alg != "ECDH-ES" {
        return Err(TokenError::Unsupported(format!(
            "JWE algorithm \"{alg}\" (the tang pin uses ECDH-ES)"
        )));
    }
    if field(&["zip"]).is_some() {
        return Err(TokenError::Unsupported("a compressed JWE (\"zip\")".into()));
    }
    let enc = string(&["enc"])?;
    crate::jwe::key_len(&enc)?;
    let epk = EcJwk::parse(field(&["epk"]).ok_or_else(|| malformed("no \"epk\""))?)
        .map_err(|e| malformed(format!("epk: {e}")))?;
    let party = |name: &str| -> Result<Vec<u8>> {
        match field(&[name]) {
            None => Ok(Vec::new()),
            Some(Value::String(s)) => b64(s).map_err(|e| malformed(format!("{name}: {e}"))),
            Some(_) => Err(malformed(format!("{name} is not a string"))),
        }
    };
    let adv_keys = field(&["clevis", "tang", "adv", "keys"])
        .and_then(Value::as_array)
        .cloned()
        .ok_or_else(|| malformed("the JWE header has no \"clevis.tang.adv\" key list"))?;
    Ok(TangHeader {
        enc,
        epk,
        kid: string(&["kid"])?,
        apu: party("apu")?,
        apv: party("apv")?,
        url: string(&["clevis", "tang", "url"])?,
        adv_keys,
    })
}

fn malformed(reason: impl Into<String>) -> TokenError {
    TokenError::Malformed(reason.into())
}
