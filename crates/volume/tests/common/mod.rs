//! Helpers shared by the integration tests: running the real QEMU tools and comparing what
//! cryptblk reads with what QEMU reads.
#![allow(dead_code)]

pub mod aio;

use cryptblk_block::BlockDevice;
use std::path::Path;
use std::process::Command;

pub use cryptblk_testutil::tool;

/// Runs a tool and fails the test with its stderr if it does not succeed.
pub fn run(name: &str, args: &[&str]) {
    let out = Command::new(tool(name))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {name}: {e}"));
    assert!(
        out.status.success(),
        "{name} {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
}

/// Runs a tool and returns its stdout.
pub fn output(name: &str, args: &[&str]) -> String {
    let out = Command::new(tool(name))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {name}: {e}"));
    assert!(
        out.status.success(),
        "{name} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `qemu-img` for commands that calibrate a KDF (creating encrypted images); panics unless it
/// succeeds. QEMU's calibration fails at random with "Unable to get accurate CPU usage": see
/// [`cryptblk_testutil::qemu_img_kdf`], which retries only that failure.
pub fn qemu_img_kdf(args: &[&str]) {
    let program = tool("qemu-img");
    let refs: Vec<&std::ffi::OsStr> = args.iter().map(std::ffi::OsStr::new).collect();
    cryptblk_testutil::qemu_img_kdf_ok(program.as_os_str(), &refs);
}

pub fn qemu_img(args: &[&str]) {
    run("qemu-img", args);
}

/// `qemu-io -c <cmd>` on a qcow2 image, one invocation with all commands.
pub fn qemu_io(image: &Path, cmds: &[&str]) {
    let mut args: Vec<&str> = vec!["-f", "qcow2"];
    for c in cmds {
        args.push("-c");
        args.push(c);
    }
    let img = image.to_str().unwrap();
    args.push(img);
    run("qemu-io", &args);
}

/// What QEMU says the guest sees: `qemu-img convert -O raw`.
pub fn qemu_raw(image: &Path, dir: &Path) -> Vec<u8> {
    let out = dir.join(format!(
        "{}.expected.raw",
        image.file_name().unwrap().to_str().unwrap()
    ));
    qemu_img(&[
        "convert",
        "-O",
        "raw",
        image.to_str().unwrap(),
        out.to_str().unwrap(),
    ]);
    std::fs::read(out).unwrap()
}

/// Reads the whole device with reads of `chunk` bytes (the last one shorter).
pub fn read_all(dev: &dyn BlockDevice, chunk: usize) -> Vec<u8> {
    let size = dev.size() as usize;
    let mut out = vec![0u8; size];
    let mut off = 0;
    while off < size {
        let n = chunk.min(size - off);
        dev.read_at(&mut out[off..off + n], off as u64).unwrap();
        off += n;
    }
    out
}

/// Asserts equality with a short message instead of dumping megabytes.
pub fn assert_same(ours: &[u8], theirs: &[u8], what: &str) {
    assert_eq!(ours.len(), theirs.len(), "{what}: length differs");
    if let Some(i) = ours.iter().zip(theirs).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at byte {i}: cryptblk {:#04x}, qemu {:#04x}",
            ours[i], theirs[i]
        );
    }
}

/// An in-memory device, for tests of layers above the backend.
pub struct MemDevice {
    pub data: std::sync::RwLock<Vec<u8>>,
}

impl MemDevice {
    pub fn new(size: usize) -> Self {
        MemDevice {
            data: std::sync::RwLock::new(vec![0u8; size]),
        }
    }

    pub fn snapshot(&self) -> Vec<u8> {
        self.data.read().unwrap().clone()
    }
}

impl BlockDevice for MemDevice {
    fn size(&self) -> u64 {
        self.data.read().unwrap().len() as u64
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), cryptblk_block::BlockError> {
        let d = self.data.read().unwrap();
        let o = offset as usize;
        assert!(
            o + buf.len() <= d.len(),
            "layer above read beyond the backend"
        );
        buf.copy_from_slice(&d[o..o + buf.len()]);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), cryptblk_block::BlockError> {
        let mut d = self.data.write().unwrap();
        let o = offset as usize;
        assert!(
            o + buf.len() <= d.len(),
            "layer above wrote beyond the backend"
        );
        d[o..o + buf.len()].copy_from_slice(buf);
        Ok(())
    }
    fn flush(&self) -> Result<(), cryptblk_block::BlockError> {
        Ok(())
    }
}

/// Formats `path` (created with `payload` bytes after a 2 MiB header) as LUKS1 with
/// cryptsetup. A fixed PBKDF2 iteration count avoids the KDF benchmark, which is slow and, in
/// `qemu-img create -f luks`, fails intermittently on a loaded machine.
pub fn cryptsetup_format(
    path: &Path,
    luks_type: &str,
    sector: u32,
    total_size: u64,
    passphrase: &[u8],
) {
    std::fs::File::create(path)
        .unwrap()
        .set_len(total_size)
        .unwrap();
    let sector = sector.to_string();
    let mut args = vec![
        "luksFormat",
        "--type",
        luks_type,
        "--cipher",
        "aes-xts-plain64",
        "--key-size",
        "512",
    ];
    args.extend([
        "--hash",
        "sha256",
        "--pbkdf",
        "pbkdf2",
        "--pbkdf-force-iterations",
        "1000",
    ]);
    if luks_type == "luks2" {
        args.extend(["--sector-size", sector.as_str()]);
    }
    args.extend(["--batch-mode", "--key-file", "-", path.to_str().unwrap()]);
    let mut child = Command::new(tool("cryptsetup"))
        .args(&args)
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("running cryptsetup");
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), passphrase).unwrap();
    drop(child.stdin.take());
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "cryptsetup luksFormat failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
