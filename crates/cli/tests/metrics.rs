//! `cryptblk serve --metrics`: a LUKS2 disk served over NBD takes a known number of reads,
//! writes and flushes; the scrape is parsed by the Prometheus project's own Python parser
//! (Debian's python3-prometheus-client) and must count exactly that I/O (and the reads a
//! vhost-user frontend sends on one of two queues, on that queue only), with histograms
//! whose counts equal the request counts, and no trace of the passphrase. The endpoint's
//! HTTP answers to wrong paths, methods and garbage are checked too.
mod common;

use common::*;
use frontend::S_OK;
use serde_json::Value;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};

/// Debian's interpreter, where python3-prometheus-client is installed (not a pyenv one).
const PYTHON: &str = "/usr/bin/python3";

/// Parses the exposition text on stdin with prometheus_client and prints every sample as
/// JSON: [family, type, sample name, labels, value].
const PARSE: &str = r#"
import json, sys
from prometheus_client.parser import text_string_to_metric_families
out = []
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        out.append([family.name, family.type, s.name, s.labels, s.value])
print(json.dumps(out))
"#;

/// Sends `request` raw and returns the status line, the head and the body.
fn http(socket: &Path, request: &[u8]) -> (String, String, Vec<u8>) {
    let mut stream = UnixStream::connect(socket).unwrap();
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(20)))
        .unwrap();
    stream.write_all(request).unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).unwrap();
    let split = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head");
    let head = String::from_utf8(answer[..split].to_vec()).unwrap();
    let status = head.lines().next().unwrap().to_string();
    (status, head, answer[split + 4..].to_vec())
}

/// The value of the one sample named `name` whose labels include `labels`.
fn value(samples: &[Value], name: &str, labels: &[(&str, &str)]) -> f64 {
    let found: Vec<f64> = samples
        .iter()
        .filter(|s| s[2] == name)
        .filter(|s| labels.iter().all(|(k, v)| s[3][*k] == *v))
        .map(|s| s[4].as_f64().unwrap())
        .collect();
    assert_eq!(found.len(), 1, "{name} {labels:?}: {found:?}");
    found[0]
}

#[test]
fn metrics_count_the_io_done_and_parse_with_prometheus_client() {
    let has_parser = Command::new(PYTHON)
        .args(["-c", "import prometheus_client.parser"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_parser {
        cryptblk_testutil::skip("python3-prometheus-client is not installed");
        return;
    }
    let t = TestDir::new();
    let key = t.key("key");
    let secret = key.passphrase.clone();
    let img = t.luks2("disk.luks", "16M", &key);

    // A name with characters the format must escape in label values.
    let name = "vm \"one\" \\ data";
    let serve = t.serve().disk(&img).name(name).nbd().control().metrics();
    let mut daemon = serve.vhost_user().args(&["--num-queues", "2"]).start();
    let metrics = daemon.metrics_socket().to_path_buf();

    const READS: u64 = 37;
    const WRITES: u64 = 11;
    const FLUSHES: u64 = 3;
    let mut client = daemon.nbd(name);
    for i in 0..WRITES {
        client.write(i * 8192, &[i as u8 + 1; 8192], false).unwrap();
    }
    for _ in 0..FLUSHES {
        client.flush().unwrap();
    }
    for i in 0..READS {
        client.read((i * 7 % 4096) * 4096, 4096).unwrap();
    }
    client.disconnect().unwrap();
    const VHOST_READS: u64 = 5;
    let mut guest = daemon.frontend(2, 256);
    for i in 0..VHOST_READS {
        let (status, _) = guest.read(1, i * 8, 4096);
        assert_eq!(status, S_OK);
    }
    drop(guest);

    let (status, head, body) = http(
        &metrics,
        b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n",
    );
    assert_eq!(status, "HTTP/1.1 200 OK", "{head}");
    assert!(
        head.contains("Content-Type: text/plain; version=0.0.4; charset=utf-8"),
        "{head}"
    );
    let text = String::from_utf8(body).unwrap();
    assert!(
        !text.contains(&secret),
        "the passphrase appears in the metrics"
    );
    assert!(!text.contains(s(&key)), "the key file is named: {text}");

    let mut python = Command::new(PYTHON)
        .args(["-c", PARSE])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    python
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let parsed = python.wait_with_output().unwrap();
    assert!(
        parsed.status.success(),
        "prometheus_client refused:\n{text}"
    );
    let samples: Vec<Value> = serde_json::from_slice(&parsed.stdout).unwrap();
    let types: std::collections::HashMap<&str, &str> = samples
        .iter()
        .map(|s| (s[0].as_str().unwrap(), s[1].as_str().unwrap()))
        .collect();
    assert_eq!(types["cryptblk_io_requests"], "counter");
    assert_eq!(types["cryptblk_io_request_duration_seconds"], "histogram");
    assert_eq!(types["cryptblk_io_in_flight_requests"], "gauge");

    let export = [("disk", name), ("export", "nbd")];
    let with_op = |op: &'static str| {
        let mut l = export.to_vec();
        l.push(("op", op));
        l
    };
    let requests = |op| value(&samples, "cryptblk_io_requests_total", &with_op(op));
    assert_eq!(requests("read"), READS as f64);
    assert_eq!(requests("write"), WRITES as f64);
    assert_eq!(requests("flush"), FLUSHES as f64);
    assert_eq!(requests("discard"), 0.0);
    let bytes = |op| value(&samples, "cryptblk_io_bytes_total", &with_op(op));
    assert_eq!(bytes("read"), (READS * 4096) as f64);
    assert_eq!(bytes("write"), (WRITES * 8192) as f64);
    for op in ["read", "write", "flush", "discard", "other"] {
        assert_eq!(
            value(&samples, "cryptblk_io_errors_total", &with_op(op)),
            0.0
        );
    }
    assert_eq!(
        value(&samples, "cryptblk_io_in_flight_requests", &export),
        0.0
    );

    for (queue, reads) in [("0", 0), ("1", VHOST_READS)] {
        let labels = [
            ("disk", name),
            ("export", "vhost-user-blk"),
            ("queue", queue),
            ("op", "read"),
        ];
        assert_eq!(
            value(&samples, "cryptblk_io_requests_total", &labels),
            reads as f64
        );
        assert_eq!(
            value(&samples, "cryptblk_io_bytes_total", &labels),
            (reads * 4096) as f64
        );
        assert_eq!(
            value(
                &samples,
                "cryptblk_io_request_duration_seconds_count",
                &labels
            ),
            reads as f64
        );
    }

    // Every histogram: cumulative buckets ending in +Inf = _count = the request count.
    for op in ["read", "write", "flush", "discard"] {
        let labels = with_op(op);
        let count = value(
            &samples,
            "cryptblk_io_request_duration_seconds_count",
            &labels,
        );
        assert_eq!(count, requests(op), "{op}");
        let mut buckets: Vec<(f64, f64)> = samples
            .iter()
            .filter(|s| s[2] == "cryptblk_io_request_duration_seconds_bucket")
            .filter(|s| labels.iter().all(|(k, v)| s[3][*k] == *v))
            .map(|s| {
                let le = s[3]["le"].as_str().unwrap();
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap()
                };
                (le, s[4].as_f64().unwrap())
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        assert_eq!(buckets.len(), 20, "{op}");
        assert_eq!(buckets[0].0, 0.00001);
        assert_eq!(buckets[18].0, 10.0);
        assert!(
            buckets.windows(2).all(|w| w[0].1 <= w[1].1),
            "{op}: {buckets:?}"
        );
        assert_eq!(buckets[19].1, count, "{op}");
        let sum = value(
            &samples,
            "cryptblk_io_request_duration_seconds_sum",
            &labels,
        );
        assert!(sum >= 0.0 && (count > 0.0 || sum == 0.0), "{op}: {sum}");
    }

    value(
        &samples,
        "cryptblk_crypto_engine_info",
        &[
            ("disk", name),
            ("cipher", "aes-xts-plain64"),
            ("key_bits", "512"),
        ],
    );
    value(
        &samples,
        "cryptblk_disk_info",
        &[("disk", name), ("image", s(&img)), ("format", "luks")],
    );
    assert_eq!(
        value(&samples, "cryptblk_disk_size_bytes", &[("disk", name)]),
        (16 * MIB) as f64
    );
    assert!(value(&samples, "cryptblk_crypto_pool_threads", &[]) >= 1.0);
    value(&samples, "cryptblk_build_info", &[]);

    // `ctl stats` counts the same requests.
    let stats = daemon.ctl_ok(&["stats"]);
    let nbd_stats = &stats["disks"][0]["nbd"];
    assert_eq!(nbd_stats["read-ops"], READS, "{stats}");
    assert_eq!(nbd_stats["write-bytes"], WRITES * 8192, "{stats}");

    // HEAD, other paths, other methods, garbage.
    let (status, _, body) = http(&metrics, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_eq!((status.as_str(), body.len()), ("HTTP/1.1 200 OK", 0));
    let (status, _, _) = http(&metrics, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_eq!(status, "HTTP/1.1 404 Not Found");
    let (status, head, _) = http(&metrics, b"POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_eq!(status, "HTTP/1.1 405 Method Not Allowed");
    assert!(head.contains("Allow: GET, HEAD"), "{head}");
    let (status, _, _) = http(&metrics, b"\x16\x03\x01 hello\r\n\r\n");
    assert_eq!(status, "HTTP/1.1 400 Bad Request");
    let (status, _, _) = http(&metrics, &[b'A'; 9000]);
    assert_eq!(status, "HTTP/1.1 431 Request Header Fields Too Large");

    // Sixteen clients that send nothing hold every connection slot (each for 5 s at most): the
    // next is turned away at once. (Over TCP, one peer address holds at most four of them.)
    // (The threads of the requests above end once their clients have closed.)
    std::thread::sleep(std::time::Duration::from_millis(200));
    let idle: Vec<UnixStream> = (0..16)
        .map(|_| UnixStream::connect(&metrics).unwrap())
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(200));
    // (It is answered without being read: a request sent would race with the close.)
    let mut turned_away = UnixStream::connect(&metrics).unwrap();
    let mut answer = String::new();
    turned_away.read_to_string(&mut answer).unwrap();
    assert!(
        answer.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
        "{answer}"
    );
    drop(idle);

    assert_eq!(daemon.terminate(), 0);
    assert!(!metrics.exists(), "the metrics socket is removed at exit");
}
