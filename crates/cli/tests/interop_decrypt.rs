//! `cryptblk reencrypt --decrypt` against the real cryptsetup 2.7 (built by
//! scripts/build-cryptsetup27.sh; Debian 12's 2.6.1 cannot decrypt an image whose header is
//! at its head). cryptblk does not decrypt in place yet: it refuses before touching the image,
//! and the way out its error names does decrypt that image, so the advice stays true.
//!
//! No cryptsetup 2.7 fails the test (it is never skipped): scripts/test.sh builds it.
mod common;

use common::*;
use std::path::{Path, PathBuf};

/// A LUKS2 image made by the system's cryptsetup (2.6) whose payload starts with `plain`.
fn luks2_image(dir: &Path, key: &Path, plain: &[u8]) -> PathBuf {
    cryptsetup_encrypt_in_place(dir, "img", plain, key, CS_CHEAP_PBKDF2)
}

#[test]
fn decrypt_is_refused_before_any_write_and_the_named_cryptsetup_27_way_decrypts() {
    let cs27 = cryptsetup27();
    let dir = tempdir();
    let key = key_file(dir.path(), "key", &passphrase("decrypt-refused"));
    let plain_path = dir.path().join("plain");
    random_file(&plain_path, 24 * MIB, 23);
    let plain = read(&plain_path);
    let img = luks2_image(dir.path(), &key, &plain);
    let before = read(&img);

    let refused = cryptblk([
        "reencrypt",
        "--decrypt",
        "--key-file",
        s(&key),
        "-p",
        s(&img),
    ]);
    refused.expect_code(code::UNSUPPORTED);
    let line = refused.error_line(&["decrypt", "--header", "cryptsetup 2.7", "convert -O raw"]);
    assert!(
        line.contains(
            "cryptsetup reencrypt --decrypt --header NEW-FILE --force-offline-reencrypt IMAGE"
        ),
        "the refusal does not give the cryptsetup command line: {line}"
    );
    assert!(
        read(&img) == before,
        "a refused --decrypt changed the image"
    );

    // The command the refusal names, on the same image: the plaintext ends up at offset 0 and
    // the header in the new file.
    let header = dir.path().join("img.hdr");
    tool(
        s(&cs27),
        [
            "reencrypt",
            "--decrypt",
            "--header",
            s(&header),
            "--force-offline-reencrypt",
            "--batch-mode",
            "--key-file",
            s(&key),
            s(&img),
        ],
    )
    .ok();
    let after = read(&img);
    assert_same_bytes(
        &after[..plain.len()],
        &plain,
        "the image decrypted by cryptsetup 2.7",
    );
    assert!(header.is_file(), "cryptsetup 2.7 wrote no header file");
    // The image is a plain disk now: no LUKS header left for cryptblk to find.
    cryptblk(["dump", s(&img)]).expect_code(code::DAMAGED);
}
