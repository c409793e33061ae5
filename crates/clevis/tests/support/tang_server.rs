//! A real tang server for tests: Debian's `tangd` behind `socat` on a loopback port (as its
//! systemd socket unit runs it, one `tangd` per connection), with keys made by
//! `tangd-keygen` in a temporary directory. Stopped by its PID when dropped.
//! Shared by the clevis crate's tests and the CLI's (`#[path]`-included there).
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TANGD: &str = "/usr/libexec/tangd";
const TANGD_KEYGEN: &str = "/usr/libexec/tangd-keygen";

pub struct TangServer {
    child: Option<Child>,
    /// `http://127.0.0.1:PORT`, what clevis binds to.
    pub url: String,
    /// The key directory tangd serves.
    pub db: PathBuf,
    _dir: tempfile::TempDir,
}

/// Panics naming the package when a tool is missing: a missing interop tool fails the suite
/// (scripts/install-deps.sh installs it).
pub fn require(path: &str, package: &str) -> PathBuf {
    let found = if path.starts_with('/') {
        Some(PathBuf::from(path)).filter(|p| p.is_file())
    } else {
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .map(|d| d.join(path))
            .find(|p| p.is_file())
    };
    found.unwrap_or_else(|| {
        panic!("`{path}` is not installed: run scripts/install-deps.sh (Debian package {package})")
    })
}

#[allow(dead_code)]
impl TangServer {
    /// Generates keys (`tangd-keygen`'s: P-521) and starts serving them on a free loopback
    /// port.
    pub fn start() -> TangServer {
        Self::start_on_curve(None)
    }

    /// With `Some("P-256")` etc., a signing and an exchange key on that curve, made with
    /// `jose jwk gen` as tang's documentation does by hand.
    pub fn start_on_curve(crv: Option<&str>) -> TangServer {
        require(TANGD, "tang");
        require(TANGD_KEYGEN, "tang");
        require("socat", "socat");
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("db");
        std::fs::create_dir(&db).unwrap();
        match crv {
            None => {
                let keygen = Command::new(TANGD_KEYGEN).arg(&db).output().unwrap();
                assert!(keygen.status.success(), "tangd-keygen: {keygen:?}");
            }
            Some(crv) => {
                let sig = match crv {
                    "P-256" => "ES256",
                    "P-384" => "ES384",
                    _ => "ES512",
                };
                for (name, template) in [
                    ("sig", format!("{{\"alg\":\"{sig}\"}}")),
                    ("exc", format!("{{\"alg\":\"ECMR\",\"crv\":\"{crv}\"}}")),
                ] {
                    let out = Command::new(require("jose", "jose"))
                        .args(["jwk", "gen", "-i", &template, "-o"])
                        .arg(db.join(format!("{name}.jwk")))
                        .output()
                        .unwrap();
                    assert!(out.status.success(), "jose jwk gen: {out:?}");
                }
            }
        }
        let mut server = TangServer {
            child: None,
            url: String::new(),
            db,
            _dir: dir,
        };
        server.restart();
        server
    }

    /// (Re)starts tangd, on the port it had if it ran before (tokens name the URL).
    pub fn restart(&mut self) {
        self.stop();
        let port = match self.url.rsplit_once(':') {
            Some((_, port)) => port.parse().unwrap(),
            None => std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port(),
        };
        let child = Command::new("socat")
            .arg(format!("TCP-LISTEN:{port},bind=127.0.0.1,reuseaddr,fork"))
            .arg(format!("EXEC:{TANGD} {}", self.db.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting socat");
        self.child = Some(child);
        self.url = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "tang on port {port} did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the server (by the PID of the socat this test started).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Replaces the server's keys with new ones (what a lost or rebuilt server looks like to
    /// an old token; `tangd-rotate-keys` would keep the old ones for recovery). tangd reads
    /// the directory per connection, so a running server answers with the new keys.
    pub fn replace_keys(&self) {
        for entry in std::fs::read_dir(&self.db).unwrap() {
            std::fs::remove_file(entry.unwrap().path()).unwrap();
        }
        let keygen = Command::new(TANGD_KEYGEN).arg(&self.db).output().unwrap();
        assert!(keygen.status.success(), "tangd-keygen: {keygen:?}");
    }
}

impl Drop for TangServer {
    fn drop(&mut self) {
        self.stop();
    }
}
