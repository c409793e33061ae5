//! The control benchmark's clients: the loops that run `cryptblk ctl` processes back to back
//! beside the data path (or only start the binary), and the round trips of one call.
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

/// What a loop does per pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// ctl disk-add dK --image IMG --nbd-export, disk-list, stats, disk-remove dK.
    Churn,
    /// `cryptblk --version` four times: as many process starts, no daemon involved.
    Spawn,
}

/// What one loop did until it was stopped.
#[derive(Debug, Default)]
pub struct Count {
    /// Commands that exited 0.
    pub ops: u64,
    pub errors: u64,
    /// The first few failures, command and stderr.
    pub failures: Vec<String>,
}

/// The argument lists of one pass of loop `k` (1..).
pub fn pass(kind: Kind, k: usize, ctl: &Path, image: &Path) -> Vec<Vec<String>> {
    let ctl_cmd = |args: &[&str]| {
        let mut v = vec!["ctl".to_string(), "-s".into(), ctl.display().to_string()];
        v.extend(args.iter().map(|a| a.to_string()));
        v
    };
    let disk = format!("d{k}");
    match kind {
        Kind::Churn => vec![
            ctl_cmd(&[
                "disk-add",
                &disk,
                "--image",
                &image.display().to_string(),
                "--nbd-export",
            ]),
            ctl_cmd(&["disk-list"]),
            ctl_cmd(&["stats"]),
            ctl_cmd(&["disk-remove", &disk]),
        ],
        Kind::Spawn => vec![vec!["--version".to_string()]; 4],
    }
}

/// Starts a loop on a thread: whole passes, back to back, until `stop` is set (the pass in
/// progress is finished, so every disk added is removed again).
pub fn start(bin: PathBuf, commands: Vec<Vec<String>>, stop: Arc<AtomicBool>) -> JoinHandle<Count> {
    std::thread::spawn(move || {
        let mut count = Count::default();
        while !stop.load(Ordering::Relaxed) {
            for args in &commands {
                match crate::command::quiet_output(Command::new(&bin).args(args)) {
                    Ok(_) => count.ops += 1,
                    Err(e) => {
                        count.errors += 1;
                        if count.failures.len() < 5 {
                            count.failures.push(format!("{e:#}"));
                        }
                    }
                }
            }
        }
        count
    })
}

/// Median wall milliseconds of `n` runs of the command, each to its end.
pub fn process_ms(bin: &Path, args: &[&str], n: usize) -> Result<f64> {
    let mut ms = Vec::with_capacity(n);
    eprintln!("+ {n} x {} {}", bin.display(), args.join(" "));
    for _ in 0..n {
        let t = Instant::now();
        crate::command::quiet_output(Command::new(bin).args(args).stdin(Stdio::null()))?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    crate::summary::median(&ms).context("no runs")
}

/// One JSON-RPC connection to the control socket: a request line out, a reply line back.
pub struct Rpc {
    writer: UnixStream,
    reader: BufReader<UnixStream>,
    next_id: u64,
}

impl Rpc {
    pub fn connect(socket: &Path) -> Result<Rpc> {
        let writer = UnixStream::connect(socket)
            .with_context(|| format!("connecting to {}", socket.display()))?;
        let reader = BufReader::new(writer.try_clone()?);
        Ok(Rpc {
            writer,
            reader,
            next_id: 1,
        })
    }

    /// The call's result; an error reply is an error with its message.
    pub fn call(&mut self, method: &str, params: Value) -> Result<Value> {
        let id = self.next_id;
        self.next_id += 1;
        let mut line = serde_json::to_string(&serde_json::json!({
            "jsonrpc": "2.0", "id": id, "method": method, "params": params,
        }))?;
        line.push('\n');
        self.writer.write_all(line.as_bytes())?;
        let mut reply = String::new();
        if self.reader.read_line(&mut reply)? == 0 {
            bail!("the daemon closed the control connection");
        }
        parse_reply(&reply, id)
    }
}

/// The result of a reply to request `id`.
fn parse_reply(line: &str, id: u64) -> Result<Value> {
    let mut v: Value = serde_json::from_str(line)
        .with_context(|| format!("the control socket answered {}", line.trim()))?;
    if v["id"] != id {
        bail!("reply to request {id} carries id {}", v["id"]);
    }
    if let Some(e) = v.get("error") {
        bail!("the daemon answered an error: {e}");
    }
    v.get_mut("result")
        .map(Value::take)
        .with_context(|| format!("reply without a result: {}", line.trim()))
}

/// Median µs of `n` "stats" calls on one open connection (after one call that warms it up).
pub fn rpc_stats_us(socket: &Path, n: usize) -> Result<f64> {
    eprintln!(
        "+ {n} x {{\"method\":\"stats\"}} on one connection to {}",
        socket.display()
    );
    let mut rpc = Rpc::connect(socket)?;
    rpc.call("stats", serde_json::json!({}))?;
    let mut us = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        rpc.call("stats", serde_json::json!({}))?;
        us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    crate::summary::median(&us).context("no calls")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_churn_pass_adds_lists_and_removes_its_own_disk() {
        let p = pass(
            Kind::Churn,
            3,
            Path::new("/w/ctl.sock"),
            Path::new("/w/img3.raw"),
        );
        let lines: Vec<String> = p.iter().map(|a| a.join(" ")).collect();
        assert_eq!(
            lines,
            [
                "ctl -s /w/ctl.sock disk-add d3 --image /w/img3.raw --nbd-export",
                "ctl -s /w/ctl.sock disk-list",
                "ctl -s /w/ctl.sock stats",
                "ctl -s /w/ctl.sock disk-remove d3",
            ]
        );
        assert_eq!(
            pass(Kind::Spawn, 1, Path::new("c"), Path::new("i")).len(),
            4
        );
    }

    #[test]
    fn replies_are_matched_to_their_request_and_errors_surface() {
        let ok = r#"{"jsonrpc":"2.0","id":7,"result":{"disks":[]}}"#;
        assert_eq!(
            parse_reply(ok, 7).unwrap(),
            serde_json::json!({"disks": []})
        );
        assert!(parse_reply(ok, 8).unwrap_err().to_string().contains("id 7"));
        let err = r#"{"jsonrpc":"2.0","id":2,"error":{"code":-32601,"message":"no such method"}}"#;
        assert!(format!("{:#}", parse_reply(err, 2).unwrap_err()).contains("no such method"));
        assert!(parse_reply("not json", 1).is_err());
    }

    #[test]
    fn a_loop_counts_successes_and_failures_until_stopped() {
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("ran");
        let stop = Arc::new(AtomicBool::new(false));
        let commands = vec![
            vec!["-c".to_string(), format!("touch {}", marker.display())],
            vec!["-c".into(), "echo bad >&2; exit 1".into()],
        ];
        let handle = start("sh".into(), commands, stop.clone());
        while !marker.exists() {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        stop.store(true, Ordering::Relaxed);
        let c = handle.join().unwrap();
        // A pass once begun is finished: as many successes as failures.
        assert!(c.ops >= 1 && c.ops == c.errors, "{c:?}");
        assert!(c.failures.len() <= 5);
        assert!(
            c.failures[0].contains("echo bad >&2; exit 1 failed (exit status: 1): bad"),
            "{c:?}"
        );
    }
}
