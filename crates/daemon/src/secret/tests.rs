use super::*;
use crate::error::chain;
use cryptblk_control::api::ErrorKind;
use openssl::symm::encrypt;

const KEY: [u8; MASTER_KEY_BYTES] = *b"0123456789abcdef0123456789ABCDEF";
const IV: [u8; IV_BYTES] = *b"fedcba9876543210";

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// What libvirt sends: AES-256-CBC with PKCS#7 padding under the master key, base64.
fn seal(key: &[u8], iv: &[u8], plain: &[u8]) -> String {
    b64(&encrypt(Cipher::aes_256_cbc(), key, Some(iv), plain).unwrap())
}

fn refusal<T: std::fmt::Debug>(result: Result<T>, kind: ErrorKind) -> String {
    let err = result.unwrap_err();
    assert_eq!(err.kind(), kind, "{}", chain(&err));
    chain(&err)
}

#[test]
fn round_trips_what_openssl_encrypts() {
    let master = MasterKey::from_bytes(&KEY).unwrap();
    // One block short, exactly one block (padded with a whole block), several blocks, binary.
    for plain in [
        &b"short"[..],
        b"sixteen bytes!!!",
        b"a passphrase that spans three AES blocks\n",
        &[0u8, 255, 10, 13, 0],
    ] {
        let got = master
            .decrypt(&seal(&KEY, &IV, plain), &b64(&IV), "key")
            .unwrap();
        assert_eq!(got.as_slice(), plain);
    }
    // Line breaks, as `openssl enc -a` wraps long output, are ignored.
    let long = vec![b'x'; 100];
    let wrapped = seal(&KEY, &IV, &long)
        .as_bytes()
        .chunks(64)
        .map(|c| std::str::from_utf8(c).unwrap())
        .collect::<Vec<_>>()
        .join("\n");
    let got = master.decrypt(&wrapped, &b64(&IV), "key").unwrap();
    assert_eq!(got.as_slice(), long.as_slice());
}

#[test]
fn a_wrong_master_key_breaks_the_padding_and_is_named() {
    let master = MasterKey::from_bytes(&KEY).unwrap();
    let mut other = KEY;
    other[0] ^= 1;
    // This key and IV decrypt the block to bytes whose padding does not check out (checked
    // once; a random wrong key fails so 255 times in 256).
    let sealed = seal(&other, &IV, b"the passphrase");
    let message = refusal(
        master.decrypt(&sealed, &b64(&IV), "new-key"),
        ErrorKind::InvalidParams,
    );
    assert_eq!(
        message,
        "new-key-secret did not decrypt with the daemon's master key (wrong key or IV?): \
         encrypt the passphrase with AES-256-CBC under the key in serve's --master-key-file"
    );
}

#[test]
fn bad_padding_bad_base64_and_bad_lengths_are_invalid_params() {
    let master = MasterKey::from_bytes(&KEY).unwrap();
    // A block whose last byte is not valid PKCS#7 padding, made with padding off.
    let mut raw = Crypter::new(Cipher::aes_256_cbc(), Mode::Encrypt, &KEY, Some(&IV)).unwrap();
    raw.pad(false);
    let mut block = [0u8; 32];
    // Its last byte, 0, is no PKCS#7 pad length.
    let n = raw.update(&[0u8; 16], &mut block).unwrap();
    let unpadded = b64(&block[..n]);
    let message = refusal(
        master.decrypt(&unpadded, &b64(&IV), "key"),
        ErrorKind::InvalidParams,
    );
    assert!(message.contains("key-secret did not decrypt"), "{message}");

    let sealed = seal(&KEY, &IV, b"the passphrase");
    let message = refusal(
        master.decrypt("not base64!", &b64(&IV), "key"),
        ErrorKind::InvalidParams,
    );
    assert!(message.starts_with("key-secret is not base64"), "{message}");
    let message = refusal(
        master.decrypt(&sealed, "%%", "key"),
        ErrorKind::InvalidParams,
    );
    assert!(
        message.starts_with("key-secret-iv is not base64"),
        "{message}"
    );
    let message = refusal(
        master.decrypt(&sealed, &b64(&IV[..8]), "key"),
        ErrorKind::InvalidParams,
    );
    assert!(
        message.contains("key-secret-iv holds 8 bytes, not 16"),
        "{message}"
    );
    let message = refusal(
        master.decrypt(&b64(b"twelve bytes"), &b64(&IV), "key"),
        ErrorKind::InvalidParams,
    );
    assert!(
        message.contains("not whole 16-byte AES blocks"),
        "{message}"
    );
    let message = refusal(
        master.decrypt("", &b64(&IV), "key"),
        ErrorKind::InvalidParams,
    );
    assert!(message.contains("is 0 bytes"), "{message}");
}

#[test]
fn an_empty_passphrase_and_a_missing_master_key_are_refused() {
    let master = MasterKey::from_bytes(&KEY).unwrap();
    let message = refusal(
        master.decrypt(&seal(&KEY, &IV, b""), &b64(&IV), "key"),
        ErrorKind::Usage,
    );
    assert!(
        message.contains("decrypts to an empty passphrase"),
        "{message}"
    );
    let sealed = seal(&KEY, &IV, b"the passphrase");
    let message = refusal(
        decrypt_secret(None, &sealed, &b64(&IV), "key"),
        ErrorKind::InvalidParams,
    );
    assert!(
        message.contains("the daemon has no master key: start serve with --master-key-file"),
        "{message}"
    );
    let got = decrypt_secret(Some(&master), &sealed, &b64(&IV), "key").unwrap();
    assert_eq!(got.as_slice(), b"the passphrase");
}

#[test]
fn the_master_key_file_holds_exactly_32_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("master.key");
    std::fs::write(&path, KEY).unwrap();
    let master = MasterKey::from_file(&path).unwrap();
    assert_eq!(format!("{master:?}"), "MasterKey(..)");
    assert!(master
        .decrypt(&seal(&KEY, &IV, b"abc"), &b64(&IV), "key")
        .is_ok());
    for (bytes, said) in [
        (&KEY[..31], "holds 31 bytes, not exactly 32"),
        (&[], "holds 0 bytes"),
        (&[1u8; 33][..], "holds more than 32 bytes"),
    ] {
        std::fs::write(&path, bytes).unwrap();
        let message = refusal(MasterKey::from_file(&path), ErrorKind::Usage);
        assert!(message.contains(said), "{message}");
    }
    let message = refusal(MasterKey::from_file(dir.path()), ErrorKind::Usage);
    assert!(message.contains("is a directory"), "{message}");
    let message = refusal(
        MasterKey::from_file(Path::new("/dev/zero")),
        ErrorKind::Usage,
    );
    assert!(message.contains("is a device"), "{message}");
    let missing = MasterKey::from_file(&dir.path().join("none")).unwrap_err();
    assert!(chain(&missing).contains("reading the master key file"));
}
