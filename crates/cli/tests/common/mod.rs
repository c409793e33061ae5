//! Shared helpers for the `cryptblk` integration tests: run the real binary and the real
//! interop tools (cryptsetup, qemu-img, qemu-io), make key files and data, compare images.
//!
//! Every passphrase written with [`key_file`] is remembered, and every `cryptblk` run checks
//! that none of them appears in its stdout or stderr: a leak fails whichever test caused it.
#![allow(dead_code)]

use rand::{RngCore, SeedableRng};
use std::ffi::OsStr;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

pub mod guest;
pub mod online;
pub mod secret;
pub mod xts;

pub const MIB: u64 = 1 << 20;

/// Exit statuses from the CLI contract (`crates/cli/src/exit.rs`).
pub mod code {
    pub const OK: i32 = 0;
    pub const USAGE: i32 = 1;
    pub const WRONG_PASSPHRASE: i32 = 2;
    pub const UNSUPPORTED: i32 = 3;
    pub const DAMAGED: i32 = 4;
    pub const IO: i32 = 5;
    pub const IN_USE: i32 = 6;
    pub const RESOURCE_LIMIT: i32 = 7;
    pub const OTHER: i32 = 8;
}

/// Cheap keyslots for cryptblk (KDF time must not dominate the suite).
pub const CHEAP_PBKDF2: &[&str] = &["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"];
pub const CHEAP_ARGON2ID: &[&str] = &[
    "--pbkdf",
    "argon2id",
    "--pbkdf-memory",
    "64",
    "--pbkdf-force-iterations",
    "4",
];
/// Cheap keyslots for cryptsetup.
pub const CS_CHEAP_PBKDF2: &[&str] = &["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"];

/// `cryptblk format`s a LUKS2 image at `img`: 4096-byte sectors, `size` of payload (`"8M"`),
/// one keyslot for the passphrase in `key` with [`CHEAP_PBKDF2`].
pub fn format_luks2(img: &Path, key: &Path, size: &str) {
    let mut args = vec![
        "format",
        "-q",
        "--key-file",
        s(key),
        "--sector-size",
        "4096",
    ];
    args.extend_from_slice(CHEAP_PBKDF2);
    args.extend([s(img), size]);
    cryptblk(&args).ok();
}

static SECRETS: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

/// The result of one process run.
#[derive(Debug)]
pub struct Out {
    pub what: String,
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Out {
    /// Panics with the full output unless the exit status is `expected`.
    #[track_caller]
    pub fn expect_code(&self, expected: i32) -> &Self {
        assert_eq!(
            self.code, expected,
            "`{}` exited {} (expected {expected})\n--- stdout\n{}\n--- stderr\n{}",
            self.what, self.code, self.stdout, self.stderr
        );
        self
    }

    #[track_caller]
    pub fn ok(&self) -> &Self {
        self.expect_code(0)
    }

    /// For a failing cryptblk command: exactly one non-empty line of error on stderr, starting
    /// `cryptblk: `, that contains every word of `needles` (case-insensitive); returns that line.
    #[track_caller]
    pub fn error_line(&self, needles: &[&str]) -> String {
        let errors: Vec<&str> = self
            .stderr
            .lines()
            .filter(|l| l.starts_with("cryptblk: ") && !is_note(l))
            .collect();
        assert_eq!(
            errors.len(),
            1,
            "`{}`: expected exactly one `cryptblk: ` error line on stderr, got:\n{}",
            self.what,
            self.stderr
        );
        let line = errors[0].to_string();
        let lower = line.to_lowercase();
        for needle in needles {
            assert!(
                lower.contains(&needle.to_lowercase()),
                "`{}`: the error line does not mention {needle:?}:\n{line}",
                self.what
            );
        }
        line
    }
}

fn is_note(line: &str) -> bool {
    line.starts_with("cryptblk: warning:") || line.starts_with("cryptblk: note:")
}

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_cryptblk")
}

/// Runs `cryptblk ARGS` with stdin closed and checks that no known passphrase leaks.
pub fn cryptblk<I, S>(args: I) -> Out
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = Command::new(bin());
    cmd.args(args).stdin(Stdio::null()).env_remove("RUST_LOG");
    let out = run_cmd(cmd);
    assert_no_secret(&out);
    out
}

/// `cryptblk ctl --socket CONTROL ARGS`.
pub fn ctl(control: &Path, args: &[&str]) -> Out {
    let mut all = vec!["ctl", "--socket", s(control)];
    all.extend_from_slice(args);
    cryptblk(all)
}

/// `ctl` that must succeed; its JSON answer.
pub fn ctl_json(control: &Path, args: &[&str]) -> serde_json::Value {
    let out = ctl(control, args);
    out.ok();
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", out.stdout))
}

/// Polls `migrate-status vol` through `ctl` until it reports `phase`; panics on a failed or
/// cancelled migration or after 2 minutes, with `context()` (e.g. the daemon's log) appended.
pub fn wait_migrate_phase(
    ctl: impl Fn(&[&str]) -> serde_json::Value,
    phase: &str,
    context: impl Fn() -> String,
) -> serde_json::Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let st = ctl(&["migrate-status", "vol"]);
        let now = st["phase"].as_str().unwrap_or_default().to_string();
        if now == phase {
            return st;
        }
        assert!(
            !matches!(now.as_str(), "failed" | "cancelled") && std::time::Instant::now() < deadline,
            "waiting for {phase}: {st:#}{}",
            context()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Runs `cryptblk ARGS` with `input` on stdin.
pub fn cryptblk_stdin<I, S>(args: I, input: &[u8]) -> Out
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    use std::io::Write;
    let mut cmd = Command::new(bin());
    cmd.args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env_remove("RUST_LOG");
    let what = describe(&cmd);
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run `{what}`: {e}"));
    let mut stdin = child.stdin.take().expect("piped stdin");
    stdin.write_all(input).expect("writing the child's stdin");
    drop(stdin);
    let output = child.wait_with_output().expect("waiting for cryptblk");
    let out = Out {
        what,
        code: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    };
    assert_no_secret(&out);
    out
}

/// Runs an external tool.
pub fn tool<I, S>(name: &str, args: I) -> Out
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = Command::new(cryptblk_testutil::tool(name));
    cmd.args(args).stdin(Stdio::null());
    run_cmd(cmd)
}

/// Runs `qemu-io` on `target` (its image arguments) with each of `cmds` as a `-c` command, and
/// fails if any of them reports a failure (qemu-io exits 0 after a failed `read -P`).
pub fn qemu_io_cmds(target: &[String], cmds: &[&str]) {
    let mut args = target.to_vec();
    for c in cmds {
        args.push("-c".into());
        args.push((*c).into());
    }
    let out = tool("qemu-io", &args);
    out.ok();
    assert!(!out.stdout.contains("fail"), "{cmds:?}: {}", out.stdout);
}

/// `qemu-img` for commands that calibrate a KDF (creating or converting to LUKS): QEMU's
/// calibration fails at random with "Unable to get accurate CPU usage"; see
/// [`cryptblk_testutil::qemu_img_kdf`], which retries only that failure.
pub fn qemu_img_kdf<I, S>(args: I) -> Out
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let args: Vec<std::ffi::OsString> = args.into_iter().map(|a| a.as_ref().to_owned()).collect();
    let program = cryptblk_testutil::tool("qemu-img");
    let mut what = program.display().to_string();
    for a in &args {
        what.push(' ');
        what.push_str(&a.to_string_lossy());
    }
    let refs: Vec<&OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    let output = cryptblk_testutil::qemu_img_kdf(program.as_os_str(), &refs);
    Out {
        what,
        code: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

fn run_cmd(mut cmd: Command) -> Out {
    let what = describe(&cmd);
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run `{what}`: {e}"));
    Out {
        what,
        code: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

#[track_caller]
fn assert_no_secret(out: &Out) {
    let secrets = SECRETS.lock().unwrap_or_else(|p| p.into_inner());
    for secret in secrets.iter() {
        let s = String::from_utf8_lossy(secret);
        for (stream, text) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
            assert!(
                !text.contains(s.as_ref()),
                "`{}` printed a passphrase on {stream}:\n{text}",
                out.what
            );
        }
    }
}

/// Writes a key file holding exactly `passphrase` (no newline) and remembers the passphrase so
/// that every later cryptblk run checks it never shows up in the output.
pub fn key_file(dir: &Path, name: &str, passphrase: &str) -> PathBuf {
    assert!(
        passphrase.len() >= 12,
        "test passphrases must be distinctive"
    );
    let path = dir.join(name);
    std::fs::write(&path, passphrase).expect("writing a key file");
    // As an operator should: a key file others may read is used with a warning.
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .expect("chmod 600 a key file");
    SECRETS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(passphrase.as_bytes().to_vec());
    path
}

/// A distinctive passphrase that cannot appear in normal output by accident.
pub fn passphrase(tag: &str) -> String {
    format!("Xq9-{tag}-pW7z-correct-horse")
}

/// Writes `size` bytes of seeded pseudo-random data.
pub fn random_file(path: &Path, size: u64, seed: u64) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut data = vec![0u8; size as usize];
    rng.fill_bytes(&mut data);
    std::fs::write(path, &data).expect("writing a random file");
}

/// Random data with zeroed runs and holes (every 1 MiB: 512 KiB data, 256 KiB zeros, 256 KiB hole).
pub fn mixed_file(path: &Path, size: u64, seed: u64) {
    use std::os::unix::fs::FileExt;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let file = std::fs::File::create(path).expect("creating a mixed file");
    file.set_len(size).unwrap();
    let mut off = 0u64;
    while off < size {
        let n = (512 * 1024).min(size - off) as usize;
        let mut buf = vec![0u8; n];
        rng.fill_bytes(&mut buf);
        file.write_all_at(&buf, off).unwrap();
        let z = (256 * 1024).min(size.saturating_sub(off + n as u64)) as usize;
        if z > 0 {
            file.write_all_at(&vec![0u8; z], off + n as u64).unwrap();
        }
        off += MIB;
    }
}

pub fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The first `len` bytes of a file.
pub fn read_prefix(path: &Path, len: u64) -> Vec<u8> {
    let mut f =
        std::fs::File::open(path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
    let mut buf = vec![0u8; len as usize];
    f.read_exact(&mut buf)
        .unwrap_or_else(|e| panic!("reading {} bytes of {}: {e}", len, path.display()));
    buf
}

/// Asserts two byte strings are equal, reporting sizes and the first differing offset.
#[track_caller]
pub fn assert_same_bytes(actual: &[u8], expected: &[u8], what: &str) {
    if actual == expected {
        return;
    }
    let first = actual.iter().zip(expected).position(|(a, b)| a != b);
    panic!(
        "{what}: contents differ (sizes {} vs {} expected; first differing byte at {:?})",
        actual.len(),
        expected.len(),
        first
    );
}

#[track_caller]
pub fn assert_same_files(actual: &Path, expected: &Path) {
    assert_same_bytes(
        &read(actual),
        &read(expected),
        &format!("{} vs {}", actual.display(), expected.display()),
    );
}

pub fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("cryptblk-cli-test")
        .tempdir()
        .expect("creating a temp dir")
}

pub fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 test path")
}

/// Decrypts a LUKS image with cryptblk into a raw file and returns its bytes.
#[track_caller]
pub fn cryptblk_decrypt(image: &Path, key: &Path, out: &Path) -> Vec<u8> {
    let _ = std::fs::remove_file(out);
    cryptblk([
        "convert",
        "-O",
        "raw",
        "--source-key-file",
        s(key),
        s(image),
        s(out),
    ])
    .ok();
    read(out)
}

/// `cryptblk dump --json` parsed.
#[track_caller]
pub fn dump_json(image: &Path) -> serde_json::Value {
    let out = cryptblk(["dump", "--json", s(image)]);
    out.ok();
    serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| panic!("dump --json output is not JSON ({e}):\n{}", out.stdout))
}

/// Whether cryptsetup accepts a passphrase for an image (no root needed).
pub fn cryptsetup_accepts(image: &Path, key: &Path) -> bool {
    let out = tool(
        "cryptsetup",
        [
            "luksOpen",
            "--test-passphrase",
            "--key-file",
            s(key),
            s(image),
        ],
    );
    match out.code {
        0 => true,
        2 => false,
        _ => panic!("cryptsetup --test-passphrase failed unexpectedly: {out:?}"),
    }
}

/// Runs `cryptsetup reencrypt --encrypt` over a file holding `plain`, giving a LUKS2 image whose
/// payload starts with `plain` (data offset 8 MiB). `extra` varies cipher, KDF, sector size.
pub fn cryptsetup_encrypt_in_place(
    dir: &Path,
    name: &str,
    plain: &[u8],
    key: &Path,
    extra: &[&str],
) -> PathBuf {
    let img = dir.join(name);
    std::fs::write(&img, plain).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
    f.set_len(plain.len() as u64 + 16 * MIB).unwrap();
    drop(f);
    let mut args: Vec<&str> = vec![
        "reencrypt",
        "--encrypt",
        "--type",
        "luks2",
        "--reduce-device-size",
        "16M",
        "--key-file",
        s(key),
        "--batch-mode",
    ];
    args.extend_from_slice(extra);
    args.push(s(&img));
    tool("cryptsetup", &args).ok();
    img
}

/// Makes the kernel refuse `cmd`'s writes at or past `limit` bytes into a file with EFBIG
/// (`RLIMIT_FSIZE`), as a full filesystem or a quota would refuse them.
pub fn limit_file_size(cmd: &mut Command, limit: u64) {
    use std::os::unix::process::CommandExt;
    // SAFETY: between fork and exec only async-signal-safe calls (setrlimit, signal) run.
    unsafe {
        cmd.pre_exec(move || {
            let limit = libc::rlimit {
                rlim_cur: limit,
                rlim_max: limit,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Without this the kernel would kill the process (SIGXFSZ) instead of failing
            // the write with EFBIG.
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            Ok(())
        });
    }
}

/// A `cryptblk serve` process for a test: started with `args`, ready once `ready` exists;
/// killed when dropped (a failing test leaves no daemon behind), stopped with SIGTERM by
/// `terminate`.
#[allow(dead_code)]
pub struct ServeProcess(Option<std::process::Child>);

#[allow(dead_code)]
impl ServeProcess {
    pub fn start(args: &[&str], ready: &Path) -> ServeProcess {
        Self::start_cmd(Self::command(args), ready)
    }

    /// As `start`, with these environment variables set for the daemon.
    pub fn start_with_env(args: &[&str], ready: &Path, env: &[(&str, &str)]) -> ServeProcess {
        let mut cmd = Self::command(args);
        cmd.envs(env.iter().copied());
        Self::start_cmd(cmd, ready)
    }

    /// As `start`, with the daemon's file writes at or past `limit` bytes refused
    /// (`limit_file_size`).
    pub fn start_with_file_limit(args: &[&str], ready: &Path, limit: u64) -> ServeProcess {
        let mut cmd = Self::command(args);
        limit_file_size(&mut cmd, limit);
        Self::start_cmd(cmd, ready)
    }

    fn command(args: &[&str]) -> Command {
        let mut cmd = Command::new(bin());
        cmd.arg("serve")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .env_remove("RUST_LOG");
        cmd
    }

    fn start_cmd(mut cmd: Command, ready: &Path) -> ServeProcess {
        let mut child = cmd.spawn().unwrap();
        cryptblk_testutil::wait_for_path(ready, &mut child);
        ServeProcess(Some(child))
    }

    /// SIGTERM; returns the exit code.
    pub fn terminate(mut self) -> i32 {
        cryptblk_testutil::terminate(self.0.take().unwrap())
    }

    /// The daemon's process id (e.g. for `prlimit --pid`).
    pub fn id(&self) -> u32 {
        self.0.as_ref().unwrap().id()
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
