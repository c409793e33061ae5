//! Checkpoints and backup chains as the tests read them.
use cryptblk_backup::extents::Reader;
use cryptblk_fixture::Daemon;
use serde_json::Value;
use std::path::Path;

/// Touching `(offset, length)` ranges joined.
pub fn merged(ranges: impl IntoIterator<Item = (u64, u64)>) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (offset, length) in ranges {
        match out.last_mut() {
            Some(last) if last.0 + last.1 == offset => last.1 += length,
            _ => out.push((offset, length)),
        }
    }
    out
}

/// The dirty extents `nbdinfo --map=qemu:dirty-bitmap:NAME` reads from the export at `uri`,
/// touching ones joined.
pub fn nbdinfo_dirty(uri: &str, bitmap: &str) -> Vec<(u64, u64)> {
    let out = cryptblk_fixture::tool(
        "nbdinfo",
        ["--json", &format!("--map=qemu:dirty-bitmap:{bitmap}"), uri],
    );
    out.ok();
    let map: Value = serde_json::from_str(&out.stdout).unwrap();
    merged(
        map.as_array()
            .unwrap()
            .iter()
            .filter(|e| e["type"].as_u64().unwrap() & 1 == 1)
            .map(|e| (e["offset"].as_u64().unwrap(), e["length"].as_u64().unwrap())),
    )
}

/// The dirty extents `qemu-img map` reads through `x-dirty-bitmap` from `export` on the NBD
/// server at `socket` (QEMU reports the bitmap's dirty flag as its "hole" bit: dirty extents
/// show as not data), touching ones joined.
pub fn qemu_img_dirty(socket: &Path, export: &str, bitmap: &str) -> Vec<(u64, u64)> {
    let image = format!(
        "json:{{\"driver\":\"raw\",\"file\":{{\"driver\":\"nbd\",\"server\":{{\"type\":\
         \"unix\",\"path\":\"{}\"}},\"export\":\"{export}\",\"x-dirty-bitmap\":\
         \"qemu:dirty-bitmap:{bitmap}\"}}}}",
        cryptblk_fixture::s(socket)
    );
    let out = cryptblk_fixture::tool("qemu-img", ["map", "--output=json", &image]);
    out.ok();
    let map: Value = serde_json::from_str(&out.stdout).unwrap();
    merged(
        map.as_array()
            .unwrap()
            .iter()
            .filter(|e| e["data"] == false)
            .map(|e| (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap())),
    )
}

/// The ranges of the image that `entry` of the manifest of the chain in `chain` holds (its
/// extents file), touching ones joined.
pub fn chain_extents(chain: &Path, entry: &Value) -> Vec<(u64, u64)> {
    let file = std::fs::File::open(chain.join(entry["extents"]["file"].as_str().unwrap())).unwrap();
    let mut reader = Reader::new(
        std::io::BufReader::new(file),
        entry["disk_size"].as_u64().unwrap(),
    )
    .unwrap();
    let mut records = Vec::new();
    while let Some(r) = reader.next_record().unwrap() {
        records.push((r.offset, r.length));
    }
    merged(records)
}

/// The `(offset, length)` ranges `ctl checkpoint-list DISK --extents` gives for `checkpoint`,
/// all of them (the list is not truncated).
pub fn checkpoint_extents(daemon: &Daemon, disk: &str, checkpoint: &str) -> Vec<(u64, u64)> {
    let list = daemon.ctl_ok(&["checkpoint-list", disk, "--extents"]);
    let entry = list["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == checkpoint)
        .unwrap_or_else(|| panic!("no checkpoint {checkpoint} in {list}"));
    assert_eq!(entry["truncated"], Value::Null, "{list}");
    entry["extents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e[0].as_u64().unwrap(), e[1].as_u64().unwrap()))
        .collect()
}

/// Whether `ranges` (sorted) together cover `len` bytes at `offset`.
pub fn covers(ranges: &[(u64, u64)], offset: u64, len: u64) -> bool {
    let mut at = offset;
    for &(o, l) in ranges {
        if o <= at && at < o + l {
            at = o + l;
        }
        if at >= offset + len {
            return true;
        }
    }
    false
}

/// The chain's `manifest.json`.
pub fn manifest(chain: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(chain.join("manifest.json")).unwrap()).unwrap()
}
