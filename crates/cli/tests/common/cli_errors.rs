//! What the bad-input tests (`cli_errors.rs`, `cli_errors_image.rs`, `cli_errors_keys.rs`)
//! share: a small LUKS image made by cryptblk with its key file and payload, and the checks
//! that a refused command left it as it was.
use super::{
    argv, assert_same_bytes, cryptblk, cryptblk_decrypt, mixed_file, read, Key, TestDir, MIB,
};
use std::path::{Path, PathBuf};

/// A small LUKS image made by cryptblk, with its key file and known payload.
pub struct Fixture {
    pub t: TestDir,
    pub key: Key,
    pub img: PathBuf,
    pub payload: Vec<u8>,
}

/// A `version` image made by `cryptblk convert` with `kdf` (its options).
pub fn fixture(version: &str, kdf: &str) -> Fixture {
    let t = TestDir::new();
    let key = t.key("key");
    let (src, img) = (t.path("src.raw"), t.path("img"));
    mixed_file(&src, 2 * MIB, 17);
    let mut args = argv!("convert -O {} --key-file {}", version, key);
    args.extend(kdf.split_whitespace().map(Into::into));
    args.extend([src.clone().into(), img.clone().into()]);
    cryptblk(&args).ok();
    let payload = read(&src);
    std::fs::remove_file(&src).unwrap();
    Fixture {
        t,
        key,
        img,
        payload,
    }
}

pub const LUKS1_CHEAP: &str = "--pbkdf-force-iterations 1000";

pub fn luks2_fixture() -> Fixture {
    fixture("luks2", "--pbkdf pbkdf2 --pbkdf-force-iterations 1000")
}

impl Fixture {
    pub fn path(&self, name: &str) -> PathBuf {
        self.t.path(name)
    }

    /// The image still decrypts to its payload.
    #[track_caller]
    pub fn assert_intact(&self) {
        let out = cryptblk_decrypt(&self.img, &self.key, &self.path("check.raw"));
        assert_same_bytes(&out, &self.payload, "the image after a refused command");
        std::fs::remove_file(self.path("check.raw")).unwrap();
    }

    pub fn decrypt_cmd(&self, key: &Path) -> Vec<std::ffi::OsString> {
        let out = self.path("out.raw");
        argv!(
            "convert -O raw --source-key-file {} {} {}",
            key,
            self.img,
            out
        )
    }

    /// The image's bytes are `before`.
    #[track_caller]
    pub fn assert_unchanged(&self, before: &[u8], what: &str) {
        assert!(read(&self.img) == before, "{what}");
    }
}
