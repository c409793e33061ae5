//! `qemu:dirty-bitmap:NAME` metadata contexts: what LIST/SET_META_CONTEXT answer, the chunks
//! of a BLOCK_STATUS reply (raw bytes), the limits, and what nbdinfo and qemu-img read.
mod common;

use common::{export, raw_file, run, TestServer};
use cryptblk_block::BlockError;
use cryptblk_nbd::protocol::*;
use cryptblk_nbd::{DirtyBitmaps, ExportRegistry, MAX_META_CONTEXT_QUERIES};
use cryptblk_testutil::nbd::RawClient;
use std::io::Read;
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 8 * MIB;

/// Bitmap "a": 64 KiB at 1 MiB and 128 KiB at 3 MiB changed; "b": nothing; "many": every
/// other 64 KiB region of the export.
struct Bitmaps;

impl DirtyBitmaps for Bitmaps {
    fn names(&self) -> Vec<String> {
        vec!["a".into(), "b".into(), "many".into()]
    }

    fn dirty_runs(
        &self,
        name: &str,
        from: u64,
        limit: usize,
    ) -> Result<Vec<(u64, u64)>, BlockError> {
        let runs: Vec<(u64, u64)> = match name {
            "a" => vec![(MIB, 64 << 10), (3 * MIB, 128 << 10)],
            "b" => Vec::new(),
            "many" => (0..SIZE / (128 << 10))
                .map(|i| (i * (128 << 10), 64 << 10))
                .collect(),
            _ => return Err(BlockError::corrupt(format!("no bitmap {name}"))),
        };
        Ok(runs
            .into_iter()
            .filter(|&(o, l)| o + l > from)
            .take(limit)
            .collect())
    }
}

struct Fixture {
    server: TestServer,
    _dir: tempfile::TempDir,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let registry = ExportRegistry::new();
    let mut backup = export(
        "backup",
        raw_file(&dir.path().join("a.raw"), SIZE, SIZE as usize),
    );
    backup.read_only = true;
    backup.dirty_bitmaps = Some(Arc::new(Bitmaps));
    registry.add(backup).unwrap();
    let server = TestServer::unix(dir.path(), registry);
    Fixture { server, _dir: dir }
}

fn meta_request(export: &str, queries: &[&str]) -> Vec<u8> {
    let mut data = Vec::new();
    data.extend_from_slice(&(export.len() as u32).to_be_bytes());
    data.extend_from_slice(export.as_bytes());
    data.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for query in queries {
        data.extend_from_slice(&(query.len() as u32).to_be_bytes());
        data.extend_from_slice(query.as_bytes());
    }
    data
}

/// Sends a meta-context option; returns the (id, name) replies and the final reply type.
fn meta(client: &mut RawClient, option: u32, queries: &[&str]) -> (Vec<(u32, String)>, u32) {
    client.send_option(option, &meta_request("backup", queries));
    let mut contexts = Vec::new();
    loop {
        let (_, reply, payload) = client.read_option_reply();
        if reply != REP_META_CONTEXT {
            return (contexts, reply);
        }
        let id = u32::from_be_bytes(payload[..4].try_into().unwrap());
        contexts.push((id, String::from_utf8(payload[4..].to_vec()).unwrap()));
    }
}

fn structured_client(f: &Fixture) -> RawClient {
    let mut client = RawClient::connect(f.server.socket_path());
    client.send_flags(CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES);
    client.send_option(OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(client.read_option_reply().1, REP_ACK);
    client
}

fn go(client: &mut RawClient) {
    let mut go = Vec::new();
    go.extend_from_slice(&6u32.to_be_bytes());
    go.extend_from_slice(b"backup");
    go.extend_from_slice(&0u16.to_be_bytes());
    client.send_option(OPT_GO, &go);
    while client.read_option_reply().1 != REP_ACK {}
}

/// One structured reply chunk: (flags, type, payload).
fn read_chunk(client: &mut RawClient) -> (u16, u16, Vec<u8>) {
    let mut header = [0u8; 20];
    client.stream.read_exact(&mut header).unwrap();
    assert_eq!(&header[..4], &STRUCTURED_REPLY_MAGIC.to_be_bytes());
    let flags = u16::from_be_bytes([header[4], header[5]]);
    let kind = u16::from_be_bytes([header[6], header[7]]);
    let len = u32::from_be_bytes(header[16..20].try_into().unwrap());
    let mut payload = vec![0u8; len as usize];
    client.stream.read_exact(&mut payload).unwrap();
    (flags, kind, payload)
}

/// A BLOCK_STATUS chunk's context id and (length, flags) descriptors.
fn descriptors(payload: &[u8]) -> (u32, Vec<(u32, u32)>) {
    let id = u32::from_be_bytes(payload[..4].try_into().unwrap());
    let list = payload[4..]
        .chunks_exact(8)
        .map(|d| {
            (
                u32::from_be_bytes(d[..4].try_into().unwrap()),
                u32::from_be_bytes(d[4..].try_into().unwrap()),
            )
        })
        .collect();
    (id, list)
}

#[test]
fn list_answers_prefixes_and_everything_with_id_zero() {
    let f = fixture();
    let mut client = structured_client(&f);
    let all = [
        "base:allocation",
        "qemu:dirty-bitmap:a",
        "qemu:dirty-bitmap:b",
    ];
    let (listed, end) = meta(&mut client, OPT_LIST_META_CONTEXT, &[]);
    assert_eq!(end, REP_ACK);
    assert!(listed.iter().all(|(id, _)| *id == 0), "{listed:?}");
    let names: Vec<&str> = listed.iter().map(|(_, n)| n.as_str()).collect();
    assert_eq!(names, [&all[..], &["qemu:dirty-bitmap:many"]].concat());

    for prefix in ["qemu:", "qemu:dirty-bitmap:"] {
        let (listed, _) = meta(&mut client, OPT_LIST_META_CONTEXT, &[prefix]);
        assert_eq!(listed.len(), 3, "{prefix}: {listed:?}");
        assert!(listed
            .iter()
            .all(|(_, n)| n.starts_with("qemu:dirty-bitmap:")));
    }
    let (listed, _) = meta(
        &mut client,
        OPT_LIST_META_CONTEXT,
        &["qemu:dirty-bitmap:zz"],
    );
    assert!(listed.is_empty(), "{listed:?}");
}

#[test]
fn block_status_answers_a_chunk_per_selected_context_the_last_done() {
    let f = fixture();
    let mut client = structured_client(&f);
    let (selected, end) = meta(
        &mut client,
        OPT_SET_META_CONTEXT,
        &[
            "qemu:dirty-bitmap:a",
            "qemu:dirty-bitmap:unknown",
            "base:allocation",
            "qemu:dirty-bitmap:b",
        ],
    );
    assert_eq!(end, REP_ACK);
    assert_eq!(
        selected,
        [
            (1, "qemu:dirty-bitmap:a".to_string()),
            (2, "base:allocation".to_string()),
            (3, "qemu:dirty-bitmap:b".to_string()),
        ]
    );
    go(&mut client);

    // 512 KiB .. 4 MiB: clean, dirty 64 KiB at 1 MiB, clean, dirty 128 KiB at 3 MiB, clean.
    let offset = 512 << 10;
    client.send_request(CMD_BLOCK_STATUS, 0, 7, offset, (4 * MIB - offset) as u32);
    let mut chunks = Vec::new();
    loop {
        let (flags, kind, payload) = read_chunk(&mut client);
        assert_eq!(kind, REPLY_TYPE_BLOCK_STATUS);
        chunks.push(descriptors(&payload));
        if flags & REPLY_FLAG_DONE != 0 {
            break;
        }
    }
    let k = 1024;
    assert_eq!(
        chunks,
        [
            (
                1,
                vec![
                    (512 * k, 0),
                    (64 * k, STATE_DIRTY),
                    (1984 * k, 0),
                    (128 * k, STATE_DIRTY),
                    (896 * k, 0),
                ]
            ),
            (2, vec![((4 * MIB - offset) as u32, 0)]),
            (3, vec![((4 * MIB - offset) as u32, 0)]),
        ]
    );

    // REQ_ONE: one extent per context.
    client.send_request(CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 8, MIB, MIB as u32);
    let (flags, _, payload) = read_chunk(&mut client);
    assert_eq!(flags, 0);
    assert_eq!(descriptors(&payload), (1, vec![(64 * k, STATE_DIRTY)]));
    read_chunk(&mut client);
    let (flags, _, _) = read_chunk(&mut client);
    assert_eq!(flags, REPLY_FLAG_DONE);
}

#[test]
fn a_fragmented_bitmap_is_answered_in_bounded_pieces() {
    let f = fixture();
    let mut client = structured_client(&f);
    let (selected, _) = meta(
        &mut client,
        OPT_SET_META_CONTEXT,
        &["qemu:dirty-bitmap:many"],
    );
    assert_eq!(selected.len(), 1);
    go(&mut client);
    // 64 regions of 128 KiB, each half dirty: 128 extents, all in one reply.
    client.send_request(CMD_BLOCK_STATUS, 0, 1, 0, SIZE as u32);
    let (flags, _, payload) = read_chunk(&mut client);
    assert_eq!(flags, REPLY_FLAG_DONE);
    let (_, list) = descriptors(&payload);
    assert_eq!(list.len(), 128);
    assert!(list
        .iter()
        .enumerate()
        .all(|(i, &(len, flags))| len == 64 << 10 && flags == if i % 2 == 0 { 1 } else { 0 }));
}

#[test]
fn too_many_queries_are_refused_and_a_failed_set_selects_nothing() {
    let f = fixture();
    let mut client = structured_client(&f);
    let (selected, end) = meta(&mut client, OPT_SET_META_CONTEXT, &["base:allocation"]);
    assert_eq!((selected.len(), end), (1, REP_ACK));
    let queries = vec!["qemu:dirty-bitmap:a"; MAX_META_CONTEXT_QUERIES + 1];
    let (selected, end) = meta(&mut client, OPT_SET_META_CONTEXT, &queries);
    assert_eq!((selected.len(), end), (0, REP_ERR_TOO_BIG));
    let (listed, end) = meta(&mut client, OPT_LIST_META_CONTEXT, &queries);
    assert_eq!((listed.len(), end), (0, REP_ERR_TOO_BIG));
    go(&mut client);
    // The earlier selection went with the failed SET: BLOCK_STATUS has no context to answer.
    client.send_request(CMD_BLOCK_STATUS, 0, 1, 0, 4096);
    let (flags, kind, payload) = read_chunk(&mut client);
    assert_eq!((flags, kind), (REPLY_FLAG_DONE, REPLY_TYPE_ERROR));
    assert_eq!(&payload[..4], &(NbdErrno::Inval as u32).to_be_bytes());
}

/// `nbdinfo --map=CONTEXT` output as (offset, length, flags) rows.
fn nbdinfo_map(context: &str, uri: &str) -> Vec<(u64, u64, u32)> {
    let map = run("nbdinfo", &[&format!("--map={context}"), uri]);
    map.lines()
        .map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (
                fields[0].parse().unwrap(),
                fields[1].parse().unwrap(),
                fields[2].parse().unwrap(),
            )
        })
        .collect()
}

#[test]
fn nbdinfo_and_qemu_img_read_the_dirty_extents() {
    let f = fixture();
    let uri = f.server.uri("backup");
    assert_eq!(
        nbdinfo_map("qemu:dirty-bitmap:a", &uri),
        [
            (0, MIB, 0),
            (MIB, 64 << 10, 1),
            (MIB + (64 << 10), 2 * MIB - (64 << 10), 0),
            (3 * MIB, 128 << 10, 1),
            (3 * MIB + (128 << 10), SIZE - 3 * MIB - (128 << 10), 0),
        ]
    );
    let contexts = run("nbdinfo", &["--json", &uri]);
    assert!(contexts.contains("qemu:dirty-bitmap:b"), "{contexts}");

    // qemu-img reads a bitmap through x-dirty-bitmap as allocation: dirty shows as "data"
    // (false zero/allocated flags inverted: QEMU reports dirty extents as unallocated).
    let image = format!(
        "json:{{\"driver\":\"raw\",\"file\":{{\"driver\":\"nbd\",\"server\":{{\"type\":\"unix\",\
         \"path\":\"{}\"}},\"export\":\"backup\",\"x-dirty-bitmap\":\"qemu:dirty-bitmap:a\"}}}}",
        f.server.socket_path().display()
    );
    let map = run("qemu-img", &["map", "--output=json", &image]);
    let extents: serde_json::Value = serde_json::from_str(&map).unwrap();
    let dirty: Vec<(u64, u64)> = extents
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["data"] == false)
        .map(|e| (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap()))
        .collect();
    assert_eq!(dirty, [(MIB, 64 << 10), (3 * MIB, 128 << 10)], "{map}");
}
