//! Secrets as libvirt makes them for QEMU, with the real `openssl` CLI: a 32-byte master key
//! file, and passphrases encrypted under it (AES-256-CBC, PKCS#7, base64) with fresh IVs.
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// `openssl ARGS` with `input` on stdin (a passphrase never goes on argv); its stdout, or
/// `None` when it fails.
pub fn openssl(args: &[&str], input: &[u8]) -> Option<Vec<u8>> {
    let mut child = Command::new("openssl")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("openssl (scripts/install-deps.sh installs it)");
    child.stdin.take().unwrap().write_all(input).unwrap();
    let out = child.wait_with_output().unwrap();
    out.status.success().then_some(out.stdout)
}

pub fn random_bytes(n: usize) -> Vec<u8> {
    let bytes = openssl(&["rand", &n.to_string()], b"").unwrap();
    assert_eq!(bytes.len(), n);
    bytes
}

pub fn base64(bytes: &[u8]) -> String {
    String::from_utf8(openssl(&["base64", "-A"], bytes).unwrap()).unwrap()
}

/// A master key file as libvirt makes one: 32 random bytes, mode 0600.
pub fn master_key_file(dir: &Path, name: &str) -> (PathBuf, Vec<u8>) {
    let key = random_bytes(32);
    let path = dir.join(name);
    std::fs::write(&path, &key).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    (path, key)
}

/// A secret as libvirt sends it: base64 of the AES-256-CBC ciphertext of `plain` under
/// `master` with a fresh IV, and base64 of the IV.
pub struct Secret {
    pub data: String,
    pub iv: String,
    pub iv_bytes: Vec<u8>,
}

pub fn seal(master: &[u8], plain: &str) -> Secret {
    seal_with_iv(master, plain, random_bytes(16))
}

pub fn seal_with_iv(master: &[u8], plain: &str, iv: Vec<u8>) -> Secret {
    let data = openssl(
        &[
            "enc",
            "-aes-256-cbc",
            "-K",
            &hex::encode(master),
            "-iv",
            &hex::encode(&iv),
            "-a",
            "-A",
        ],
        plain.as_bytes(),
    )
    .unwrap();
    Secret {
        data: String::from_utf8(data).unwrap().trim().to_string(),
        iv: base64(&iv),
        iv_bytes: iv,
    }
}

/// Whether `openssl enc -d` takes `secret` under `master` (its padding checks out).
pub fn openssl_decrypts(master: &[u8], secret: &Secret) -> bool {
    let args = [
        "enc",
        "-d",
        "-aes-256-cbc",
        "-K",
        &hex::encode(master),
        "-iv",
        &hex::encode(&secret.iv_bytes),
        "-a",
        "-A",
    ];
    openssl(&args, format!("{}\n", secret.data).as_bytes()).is_some()
}

/// `plain` encrypted under a random master key whose decryption under `master` openssl itself
/// rejects (its padding does not check out), as a secret made for another daemon.
pub fn foreign_secret(master: &[u8], plain: &str) -> Secret {
    loop {
        let candidate = seal(&random_bytes(32), plain);
        if !openssl_decrypts(master, &candidate) {
            return candidate;
        }
    }
}
