//! The keys each method's params accept, read from the param types themselves (what serde's
//! derive hands to `deserialize_struct`), so tests can hold the method table and `ctl` to
//! what the server really takes.
use super::*;
use serde::de::{self, Deserialize, Deserializer, Visitor};
use std::collections::BTreeSet;

#[derive(Debug)]
struct Found(&'static [&'static str]);

impl std::fmt::Display for Found {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "fields found")
    }
}

impl std::error::Error for Found {}

impl de::Error for Found {
    fn custom<T: std::fmt::Display>(_: T) -> Self {
        Found(&[])
    }
}

struct Recorder;

impl<'de> Deserializer<'de> for Recorder {
    type Error = Found;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Found> {
        Err(Found(&[]))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        _visitor: V,
    ) -> Result<V::Value, Found> {
        Err(Found(fields))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf option unit unit_struct newtype_struct seq tuple
        tuple_struct map enum identifier ignored_any
    }
}

/// The keys `T` accepts (aliases included).
fn fields<'de, T: Deserialize<'de>>() -> BTreeSet<&'static str> {
    match T::deserialize(Recorder) {
        Ok(_) => unreachable!("the recorder never produces a value"),
        Err(Found(fields)) => fields.iter().copied().collect(),
    }
}

/// The keys the daemon accepts in `method`'s params (a config file's spellings left out), or
/// `None` for a method it does not have.
pub fn accepted_params(method: &str) -> Option<Vec<&'static str>> {
    let aliases: BTreeSet<&str> = CONFIG_FILE_ALIASES.iter().map(|(a, _)| *a).collect();
    let all = match method {
        "disk-add" => fields::<DiskConfig>(),
        "disk-remove" => fields::<DiskRemoveParams>(),
        "disk-resize" => fields::<DiskResizeParams>(),
        "disk-list" => fields::<NoParams>(),
        "stats" => fields::<StatsParams>(),
        "key-add" => fields::<KeyAddParams>(),
        "key-remove" => fields::<KeyRemoveParams>(),
        "migrate-incoming" => fields::<MigrateIncomingParams>(),
        "migrate-start" => fields::<MigrateStartParams>(),
        "migrate-switchover" => fields::<MigrateSwitchoverParams>(),
        "migrate-postcopy" | "migrate-status" | "migrate-cancel" => fields::<NameParams>(),
        "migrate-recover" => fields::<MigrateRecoverParams>(),
        "reencrypt-start" => fields::<super::ReencryptStartParams>(),
        "reencrypt-status" | "reencrypt-pause" => fields::<NameParams>(),
        "checkpoint-add" | "checkpoint-remove" => fields::<CheckpointParams>(),
        "checkpoint-list" => fields::<CheckpointListParams>(),
        "backup-start" => fields::<super::BackupStartParams>(),
        "backup-end" => fields::<super::BackupEndParams>(),
        "upgrade" => fields::<UpgradeParams>(),
        _ => return None,
    };
    // The aliases are spellings of a disk's config (`DiskConfig`): another method may take a
    // param of the same name (`backup-start`'s `nbd`).
    if method != "disk-add" {
        return Some(all.into_iter().collect());
    }
    Some(all.difference(&aliases).copied().collect())
}

#[cfg(test)]
#[test]
fn the_table_lists_exactly_what_the_server_accepts() {
    for m in METHODS {
        let table: BTreeSet<&str> = m.params.iter().map(|p| p.name).collect();
        let types: BTreeSet<&str> = accepted_params(m.name).unwrap().into_iter().collect();
        assert_eq!(table, types, "method {}", m.name);
        // Every method of the table is one the server parses, and the other way round.
        let example = serde_json::Value::Object(Default::default());
        match Request::parse(m.name, example) {
            Err(e) => assert_ne!(e.code, crate::METHOD_NOT_FOUND, "{}", m.name),
            Ok(r) => assert_eq!(r.method(), m.name),
        }
    }
    assert_eq!(
        Request::parse("no-such", serde_json::Value::Null)
            .unwrap_err()
            .code,
        crate::METHOD_NOT_FOUND
    );
}

#[cfg(test)]
#[test]
fn required_params_are_the_ones_without_default() {
    // A request with only the required params (typed plausibly) parses; dropping any one of
    // them fails.
    fn sample(kind: ParamKind) -> serde_json::Value {
        match kind {
            ParamKind::Name | ParamKind::Text | ParamKind::Checkpoint => "x".into(),
            ParamKind::Path | ParamKind::KeyFile => "/x".into(),
            ParamKind::Address => "tcp:127.0.0.1:1".into(),
            ParamKind::Flag | ParamKind::FlagIfGiven | ParamKind::FlagDefaultOn => true.into(),
            ParamKind::Count | ParamKind::Bytes | ParamKind::Millis => 1.into(),
            ParamKind::KeyFd => 0.into(),
            ParamKind::Base64 => "AAAA".into(),
            ParamKind::Choice(names) => names[0].into(),
        }
    }
    for m in METHODS {
        let all: serde_json::Map<String, serde_json::Value> = m
            .params
            .iter()
            .map(|p| (p.name.to_string(), sample(p.kind)))
            .collect();
        Request::parse(m.name, all.clone().into())
            .unwrap_or_else(|e| panic!("{}: every param: {e}", m.name));
        let required: serde_json::Map<_, _> = m
            .params
            .iter()
            .filter(|p| p.required)
            .map(|p| (p.name.to_string(), sample(p.kind)))
            .collect();
        Request::parse(m.name, required.clone().into())
            .unwrap_or_else(|e| panic!("{}: required params: {e}", m.name));
        for p in m.params.iter().filter(|p| p.required) {
            let mut less = required.clone();
            less.remove(p.name);
            assert!(
                Request::parse(m.name, less.into()).is_err(),
                "{} accepted without {}",
                m.name,
                p.name
            );
        }
    }
}
