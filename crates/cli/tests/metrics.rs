//! `serve --metrics`: Prometheus scrapes while I/O runs. The answer must parse with a real
//! parser (the Python `prometheus_client` Debian ships), its counters must equal the I/O this
//! test did through NBD, its histograms must be consistent (cumulative buckets, `+Inf` ==
//! `_count` == requests), nothing of the passphrase may appear, and other paths and methods
//! get HTTP errors.
mod common;

use common::nbd_client::NbdClient;
use common::{cryptblk, key_file, passphrase, s};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn http(socket: &Path, request: &str) -> (String, String) {
    let mut stream = UnixStream::connect(socket).unwrap();
    stream.write_all(request.as_bytes()).unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    (head.to_owned(), body.to_owned())
}

/// Parses `text` with prometheus_client and prints `name{labels} value` per sample, sorted
/// label keys, so the test can look values up.
fn parse(text: &str) -> Vec<String> {
    let program = r#"
import sys
from prometheus_client.parser import text_string_to_metric_families
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
        print(f"{family.type} {s.name}{{{labels}}} {s.value!r}")
"#;
    let mut child = Command::new("python3")
        .args(["-c", program])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "prometheus_client rejects the metrics: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

fn value(samples: &[String], key: &str) -> f64 {
    samples
        .iter()
        .find_map(|l| {
            l.split_once(' ')
                .and_then(|(_, rest)| rest.strip_prefix(key))
                .map(str::trim)
        })
        .unwrap_or_else(|| panic!("no sample {key}"))
        .parse()
        .unwrap()
}

struct Serve(Child);

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn prometheus_scrapes_count_what_was_done() {
    let have_parser = Command::new("python3")
        .args(["-c", "import prometheus_client"])
        .status()
        .is_ok_and(|s| s.success());
    if !have_parser {
        cryptblk_testutil::skip(
            "python3-prometheus-client is not installed (scripts/install-deps.sh)",
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = |n: &str| dir.path().join(n);
    let secret = passphrase("metrics");
    let key = key_file(dir.path(), "key", &secret);
    let img = path("disk.luks");
    cryptblk([
        "format",
        "--key-file",
        s(&key),
        "--pbkdf",
        "pbkdf2",
        "--pbkdf-force-iterations",
        "1000",
        s(&img),
        "16M",
    ])
    .ok();
    let (nbd, metrics) = (path("nbd.sock"), path("metrics.sock"));
    let serve = Serve(
        Command::new(common::bin())
            .args([
                "serve",
                "--image",
                s(&img),
                "--key-file",
                s(&key),
                "--name",
                "vm\"1",
            ])
            .args(["--nbd", &format!("unix:{}", s(&nbd))])
            .args(["--metrics", &format!("unix:{}", s(&metrics))])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while !(metrics.exists() && nbd.exists()) {
        assert!(Instant::now() < deadline, "serve did not start");
        std::thread::sleep(Duration::from_millis(20));
    }

    // Before any I/O: zero, and the parser already accepts it.
    let (head, body) = http(&metrics, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    assert!(
        head.contains("Content-Type: text/plain; version=0.0.4"),
        "{head}"
    );
    let labels = "disk=vm\"1,export=nbd,queue=0";
    assert_eq!(
        value(
            &parse(&body),
            &format!("cryptblk_read_requests_total{{{labels}}}")
        ),
        0.0
    );

    // 40 reads of 4 KiB and 10 writes of 64 KiB, then a flush.
    let mut client = NbdClient::connect(&nbd, "vm\"1").unwrap();
    for i in 0..40u64 {
        client.read(i * 4096, 4096).unwrap();
    }
    for i in 0..10u64 {
        client
            .write(i * 65536, &vec![i as u8; 65536], false)
            .unwrap();
    }
    client.flush().unwrap();

    let (_, body) = http(&metrics, "GET /metrics?x=y HTTP/1.0\r\n\r\n");
    assert!(!body.contains(&secret), "the passphrase is in the metrics");
    let samples = parse(&body);
    let v = |name: &str| value(&samples, &format!("{name}{{{labels}}}"));
    assert_eq!(v("cryptblk_read_requests_total"), 40.0);
    assert_eq!(v("cryptblk_read_bytes_total"), 40.0 * 4096.0);
    assert_eq!(v("cryptblk_write_requests_total"), 10.0);
    assert_eq!(v("cryptblk_written_bytes_total"), 10.0 * 65536.0);
    assert_eq!(v("cryptblk_flush_requests_total"), 1.0);
    assert_eq!(v("cryptblk_request_errors_total"), 0.0);
    assert_eq!(v("cryptblk_requests_in_flight"), 0.0);
    assert_eq!(v("cryptblk_read_latency_seconds_count"), 40.0);
    assert_eq!(v("cryptblk_write_latency_seconds_count"), 10.0);
    assert!(v("cryptblk_read_latency_seconds_sum") > 0.0);
    // Cumulative buckets, ending at the count.
    for hist in [
        "cryptblk_read_latency_seconds",
        "cryptblk_write_latency_seconds",
    ] {
        let buckets: Vec<f64> = samples
            .iter()
            .filter(|l| l.contains(&format!(" {hist}_bucket{{")) && l.contains(labels))
            .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
            .collect();
        assert_eq!(buckets.len(), 23, "{hist}");
        assert!(
            buckets.windows(2).all(|w| w[0] <= w[1]),
            "{hist}: {buckets:?}"
        );
        assert_eq!(*buckets.last().unwrap(), v(&format!("{hist}_count")));
    }
    assert_eq!(value(&samples, "cryptblk_disks{}"), 1.0);
    assert!(value(&samples, "cryptblk_crypto_pool_threads{}") >= 1.0);

    // Other paths, methods and garbage.
    for (request, status) in [
        ("GET / HTTP/1.1\r\n\r\n", "404"),
        ("POST /metrics HTTP/1.1\r\n\r\n", "405"),
        ("hello\r\n\r\n", "400"),
    ] {
        let (head, _) = http(&metrics, request);
        assert!(
            head.starts_with(&format!("HTTP/1.1 {status}")),
            "{request:?}: {head}"
        );
    }
    let huge = format!("GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(20_000));
    let (head, _) = http(&metrics, &huge);
    assert!(head.starts_with("HTTP/1.1 431"), "{head}");
    drop(serve);
}
