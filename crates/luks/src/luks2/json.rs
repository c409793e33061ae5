//! Serde model of the LUKS2 JSON metadata. Every object keeps the fields it does not know in
//! `extra` so rewriting a header never drops what another tool wrote. 64-bit numbers are JSON
//! strings, as the spec requires (JSON parsers are not guaranteed to keep 64-bit precision).
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

pub type Extra = Map<String, Value>;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Metadata {
    pub keyslots: BTreeMap<String, Keyslot>,
    #[serde(default)]
    pub tokens: BTreeMap<String, Value>,
    pub segments: BTreeMap<String, Segment>,
    pub digests: BTreeMap<String, Digest>,
    pub config: Config,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Keyslot {
    #[serde(rename = "type")]
    pub kind: String,
    pub key_size: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub af: Option<Af>,
    pub area: Area,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kdf: Option<KdfJson>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<u32>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Af {
    #[serde(rename = "type")]
    pub kind: String,
    pub stripes: u32,
    pub hash: String,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Area {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(with = "u64_string")]
    pub offset: u64,
    #[serde(with = "u64_string")]
    pub size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encryption: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_size: Option<u32>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// A keyslot KDF as stored: which fields are present depends on `kind`, checked in validation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KdfJson {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iterations: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<u32>,
    pub salt: String,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentSize {
    /// The segment runs to the end of the device.
    Dynamic,
    Fixed(u64),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Segment {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(with = "u64_string")]
    pub offset: u64,
    pub size: SegmentSize,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "opt_u64_string"
    )]
    pub iv_tweak: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encryption: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sector_size: Option<u32>,
    #[serde(flatten)]
    pub extra: Extra,
}

impl Segment {
    /// The flags the segment carries (an absent or malformed list carries none).
    pub fn flags(&self) -> Vec<&str> {
        self.extra
            .get("flags")
            .and_then(serde_json::Value::as_array)
            .map(|a| a.iter().filter_map(serde_json::Value::as_str).collect())
            .unwrap_or_default()
    }

    /// A reencryption's backup segment (`backup-previous`, `backup-final`, `backup-moved-segment`):
    /// a description of a key or layout, not a part of the device.
    pub fn is_backup(&self) -> bool {
        self.flags().iter().any(|f| f.starts_with("backup-"))
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Digest {
    #[serde(rename = "type")]
    pub kind: String,
    pub keyslots: Vec<String>,
    pub segments: Vec<String>,
    pub hash: String,
    pub iterations: u32,
    pub salt: String,
    pub digest: String,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Config {
    #[serde(with = "u64_string")]
    pub json_size: u64,
    #[serde(with = "u64_string")]
    pub keyslots_size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flags: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requirements: Option<Requirements>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Requirements {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mandatory: Vec<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// Strict decimal parse: digits only (no sign, spaces or exponent), must fit in u64.
pub fn parse_u64(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

mod u64_string {
    use super::*;

    pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&v.to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        let s = String::deserialize(d)?;
        parse_u64(&s).ok_or_else(|| {
            serde::de::Error::custom(format!("'{s}' is not a decimal 64-bit number string"))
        })
    }
}

mod opt_u64_string {
    use super::*;

    pub fn serialize<S: Serializer>(v: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => s.serialize_str(&v.to_string()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        u64_string::deserialize(d).map(Some)
    }
}

impl Serialize for SegmentSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            SegmentSize::Dynamic => s.serialize_str("dynamic"),
            SegmentSize::Fixed(n) => s.serialize_str(&n.to_string()),
        }
    }
}

impl<'de> Deserialize<'de> for SegmentSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s == "dynamic" {
            return Ok(SegmentSize::Dynamic);
        }
        parse_u64(&s).map(SegmentSize::Fixed).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "segment size '{s}' is neither \"dynamic\" nor a number string"
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"{"keyslots":{"0":{"type":"luks2","key_size":32,"af":{"type":"luks1","stripes":4000,"hash":"sha256"},"area":{"type":"raw","offset":"32768","size":"131072","encryption":"aes-xts-plain64","key_size":32},"kdf":{"type":"pbkdf2","hash":"sha256","iterations":1667,"salt":"m25ohERlUp7dJXp5T70x2+Ejfxs0PnF+fGagmcmTVGs="},"x-vendor":[1,2]}},"tokens":{"1":{"type":"luks2-keyring","key_description":"k","keyslots":["0"]}},"segments":{"0":{"type":"crypt","offset":"4194304","iv_tweak":"0","size":"dynamic","encryption":"aes-xts-plain64","sector_size":512}},"digests":{"0":{"type":"pbkdf2","keyslots":["0"],"segments":["0"],"hash":"sha256","iterations":1000,"salt":"2CPh+/nNSjVQgLDhzuKgHeth9PMhl3pLRtZIVovC+Hc=","digest":"GaFZ1+Ouc3x9msdB+KT/3DPcZfzFnjlYWbDjd+zHFmQ="}},"config":{"json_size":"12288","keyslots_size":"4161536","requirements":{"mandatory":["req0"]}}}"#;

    #[test]
    fn round_trips_without_losing_unknown_fields() {
        let m: Metadata = serde_json::from_str(SAMPLE).unwrap();
        assert_eq!(m.keyslots["0"].area.offset, 32768);
        assert_eq!(m.segments["0"].size, SegmentSize::Dynamic);
        assert_eq!(
            m.config.requirements.as_ref().unwrap().mandatory,
            vec!["req0"]
        );
        let a: Value = serde_json::from_str(SAMPLE).unwrap();
        let b = serde_json::to_value(&m).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn numbers_must_be_strict_strings() {
        for bad in [
            "\"-1\"",
            "\"1e3\"",
            "\" 12\"",
            "12",
            "\"18446744073709551616\"",
        ] {
            let j = SAMPLE.replace("\"offset\":\"32768\"", &format!("\"offset\":{bad}"));
            assert!(
                serde_json::from_str::<Metadata>(&j).is_err(),
                "{bad} accepted"
            );
        }
        assert_eq!(parse_u64("18446744073709551615"), Some(u64::MAX));
    }
}
